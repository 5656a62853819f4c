"""Time of ``import genengine`` + listing backends, beside ``python -c pass`` in the same run.

Usage: python benchmarks/bench_import.py [--runs 20]
Runs the two commands alternately (this machine is shared and noisy) and prints medians, the
difference (what genengine costs) and the ratio. Goal: genengine's own cost <= 0.3 s.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

LISTING = "import genengine; genengine.available_backends()"


def wall(code: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    wall(LISTING)  # warm the file cache
    base, ours = [], []
    for _ in range(args.runs):
        base.append(wall("pass"))
        ours.append(wall(LISTING))
    b, o = statistics.median(base), statistics.median(ours)
    print(f"python -c pass                     median {b * 1000:7.1f} ms")
    print(f"import genengine + list backends   median {o * 1000:7.1f} ms")
    print(f"genengine's own cost               {1000 * (o - b):7.1f} ms   (goal <= 300 ms)")
    print(f"ratio to python -c pass            {o / b:7.2f}x   ({args.runs} alternating runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
