"""``genengine generate`` from the shell's point of view: output, JSON, options and errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from genengine.backends.transformers.engine import TransformersEngine
from genengine.cli import main
from genengine.models.tiny_model import tiny_model_dir


def test_json_output_equals_the_engine(capsys: pytest.CaptureFixture[str]) -> None:
    model = str(tiny_model_dir())
    argv = ["generate", "Hello", "Once upon a time", "--model", model, "--dtype", "float32", "--json"]
    argv += ["--temperature", "0", "--max-new-tokens", "6", "--logprobs", "--option", "max_batch_size=1"]
    assert main(argv) == 0
    results = json.loads(capsys.readouterr().out)
    with TransformersEngine(model, dtype="float32") as engine:
        want = engine.generate(["Hello", "Once upon a time"], {"temperature": 0, "max_new_tokens": 6, "logprobs": True})
    assert [r["outputs"][0]["token_ids"] for r in results] == [r.outputs[0].token_ids for r in want]
    assert [r["prompt_token_ids"] for r in results] == [r.prompt_token_ids for r in want]
    assert all(len(r["outputs"][0]["logprobs"]) == 6 for r in results)


def test_text_output_with_samples_and_stop(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "Hello", "--n", "2", "--seed", "1", "--max-new-tokens", "4", "--stop", "zz", "--ignore-eos"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "[0.0] 'Hello' -> " in out and "[0.1] 'Hello' -> " in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--top-p", "2"], "top_p=2.0"),
        (["--n", "0"], "n=0"),
        (["--temperature", "nan"], "temperature=nan"),
        (["--option", "devcie=cpu"], "did you mean 'device'"),
        (["--option", "device=tpu"], "device='tpu'"),
        (["--backend", "nope"], "unknown backend 'nope'"),
        (["--model", "/nonexistent"], "not a model directory"),
    ],
)
def test_bad_input_is_a_clear_error(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "hi", *argv]) == 2
    assert message in capsys.readouterr().err


def test_option_needs_key_value() -> None:
    with pytest.raises(SystemExit) as info:
        main(["generate", "hi", "--option", "device"])
    assert info.value.code == 2


def test_help_imports_nothing_heavy() -> None:
    code = (
        "import sys\n"
        "from genengine.cli import build_parser\n"
        "build_parser().parse_args(['generate', 'x'])\n"
        "build_parser().parse_args(['demo'])\n"
        "heavy = [m for m in ('torch', 'transformers', 'matplotlib', 'tqdm') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_backend_not_installed_is_said_once(backend: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 15: the message read "is not installed: not installed: pip install ..."."""
    from genengine.plugins.registry import available_backends

    if {b.name: b for b in available_backends()}[backend].loadable:
        pytest.skip(f"{backend} is installed here")
    assert main(["generate", "hi", "--backend", backend, "--model", "/nonexistent"]) == 2
    err = capsys.readouterr().err
    assert err.count("not installed") == 1, err
    assert (
        f"genengine: error: backend {backend!r} is not installed (missing module(s): {backend}); "
        f"to install: pip install 'genengine[{backend}]'"
    ) in err
