"""Nightly fuzzing: tests/core/test_fuzz.py with many more examples and a fresh random seed each night.

    python benchmarks/fuzz_nightly.py [--scale 20] [--seed N] [--junit FILE] [-- extra pytest args]

CI runs the same properties derandomized at scale 0.25, the cheap ones at 0.5 (about 2,100 generated cases and
22 state-machine runs of 25 steps), so a failure there reproduces on any machine; this run explores new inputs
instead. A failure prints hypothesis' falsifying example and a ``@reproduce_failure`` blob; rerun with the printed
``--seed`` to get it back. Exit status is pytest's.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fuzz_nightly.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", type=float, default=20.0, help="multiplies every property's example count (default 20)")
    p.add_argument("--seed", type=int, default=None, help="hypothesis seed (default: a random one, printed)")
    p.add_argument("--junit", default=None, metavar="FILE", help="write pytest's JUnit XML report here")
    p.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --), e.g. -k load_weights")
    args = p.parse_args(argv)
    if args.scale <= 0:
        p.error(f"--scale={args.scale} must be > 0")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    env = dict(os.environ, GENENGINE_FUZZ_SCALE=str(args.scale), GENENGINE_FUZZ_RANDOM="1", OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        str(ROOT / "tests" / "core" / "test_fuzz.py"),
        "-q",
        "-p",
        "no:cacheprovider",
        "--hypothesis-show-statistics",
        f"--hypothesis-seed={seed}",
        *(["--junitxml", args.junit] if args.junit else []),
        *args.pytest_args,
    ]
    print(f"fuzz_nightly: scale {args.scale:g}, seed {seed}: {' '.join(cmd)}", flush=True)
    start = time.monotonic()
    code = subprocess.call(cmd, cwd=ROOT, env=env)
    verdict = "passed" if code == 0 else f"FAILED (exit {code}); reproduce with --seed {seed}"
    print(f"fuzz_nightly: {verdict} in {time.monotonic() - start:.0f} s", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
