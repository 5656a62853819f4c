"""Image prompts through a real engine on the GPU: a tiny random-weight Qwen2-VL, SGLang or vLLM.

The path a VLM trainer (GRPO on image-question pairs) takes: a chat-formatted prompt with an image
placeholder, the image in ``image_data``, greedy tokens with logprobs. What must hold: the image reaches
the model (another image gives other logprobs), the logprobs match transformers' forward on the same
pixels and tokens within bf16's own error, and the VLM's full weight set (vision tower included) loads
back after a level-2 sleep with the outputs unchanged.

The engine is SGLang when it is importable, else vLLM (``GENENGINE_VLM_BACKEND`` overrides), as the GPU
kit installs one per run:

    bash tools/gpu/run_tests.sh sglang tests/gpu/test_vlm_gpu.py
    bash tools/gpu/run_tests.sh vllm tests/gpu/test_vlm_gpu.py
"""

from __future__ import annotations

import importlib.util
import math
import os
from typing import Any

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from support.gpu_checks import installed_engine  # noqa: E402

from genengine import create_engine  # noqa: E402
from genengine.protocol import GenerationResult, SamplingParams  # noqa: E402
from genengine.testing.parity import parity_bound  # noqa: E402

pytestmark = pytest.mark.gpu

if importlib.util.find_spec("flashinfer") is None:  # a setting of the GPU kit, as in test_vllm_gpu.py
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8, logprobs=True, ignore_eos=True)
QUESTIONS = ["Describe the image.", "What colour is it?"]


@pytest.fixture(scope="module")
def vlm() -> dict[str, Any]:
    from transformers import AutoProcessor

    from genengine.models.tiny_vlm import tiny_image, tiny_vlm_dir

    model = str(tiny_vlm_dir())
    processor = AutoProcessor.from_pretrained(model)
    prompts = [
        processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q}]}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for q in QUESTIONS
    ]
    return {"model": model, "processor": processor, "prompts": prompts, "images": [tiny_image(0), tiny_image(1)]}


@pytest.fixture(scope="module")
def engine(vlm: dict[str, Any]) -> Any:
    backend = installed_engine("GENENGINE_VLM_BACKEND")
    if backend is None:
        pytest.skip("needs sglang or vllm")
    options: dict[str, Any] = {"mem_util": 0.3, "disable_cuda_graph": True}
    if backend == "vllm":
        options["max_model_len"] = 1024
    eng = create_engine(backend=backend, model=vlm["model"], **options)
    yield eng
    eng.shutdown()


def _run(engine: Any, vlm: dict[str, Any], images: list[Any]) -> list[GenerationResult]:
    return engine.generate(vlm["prompts"], GREEDY, image_data=images)


def _hf_logprobs(model: Any, vlm: dict[str, Any], prompt: str, image: Any, tokens: list[int]) -> list[float]:
    """transformers' log-probabilities of ``tokens`` after ``prompt`` with ``image`` (one forward pass)."""
    inputs = vlm["processor"](text=[prompt], images=[image], return_tensors="pt").to("cuda")
    prompt_len = inputs["input_ids"].shape[1]
    extra = torch.tensor([tokens], device="cuda")
    kwargs = dict(inputs)
    kwargs["input_ids"] = torch.cat([inputs["input_ids"], extra], dim=1)
    kwargs["attention_mask"] = torch.ones_like(kwargs["input_ids"])
    # transformers >= 5 computes M-RoPE positions from the per-token modality (0 = text): the answer is text.
    if "mm_token_type_ids" in kwargs:
        kwargs["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"], torch.zeros_like(extra)], dim=1)
    kwargs["pixel_values"] = inputs["pixel_values"].to(next(model.parameters()).dtype)
    with torch.no_grad():
        out = model(**kwargs)
    logp = torch.log_softmax(out.logits[0, prompt_len - 1 : -1].float(), dim=-1)
    return logp.gather(1, torch.tensor(tokens, device="cuda")[:, None])[:, 0].tolist()


def test_image_prompts_generate(engine: Any, vlm: dict[str, Any]) -> None:
    results = _run(engine, vlm, [vlm["images"][0], vlm["images"][0]])
    for r in results:
        out = r.outputs[0]
        assert len(out.token_ids) == GREEDY.max_new_tokens
        assert out.logprobs is not None and all(math.isfinite(x) and x <= 0 for x in out.logprobs)
    again = _run(engine, vlm, [vlm["images"][0], vlm["images"][0]])
    assert [r.outputs[0].token_ids for r in again] == [r.outputs[0].token_ids for r in results]


def test_the_image_reaches_the_model(engine: Any, vlm: dict[str, Any]) -> None:
    first = _run(engine, vlm, [vlm["images"][0]] * 2)
    other = _run(engine, vlm, [vlm["images"][1]] * 2)
    differs = [
        a.outputs[0].token_ids != b.outputs[0].token_ids
        or max(abs(x - y) for x, y in zip(a.outputs[0].logprobs or [], b.outputs[0].logprobs or [], strict=True)) > 1e-3
        for a, b in zip(first, other, strict=True)
    ]
    assert all(differs), "another image gave the same tokens and logprobs: the image did not reach the model"


def test_logprobs_match_transformers_on_the_same_pixels(engine: Any, vlm: dict[str, Any]) -> None:
    from transformers import AutoModelForImageTextToText

    image = vlm["images"][0]
    results = _run(engine, vlm, [image, image])
    hf = AutoModelForImageTextToText.from_pretrained(vlm["model"], dtype=torch.float32).to("cuda").eval()
    hf16 = AutoModelForImageTextToText.from_pretrained(vlm["model"], dtype=torch.bfloat16).to("cuda").eval()
    gaps: list[float] = []
    floor: list[float] = []
    for prompt, r in zip(vlm["prompts"], results, strict=True):
        out = r.outputs[0]
        ref = _hf_logprobs(hf, vlm, prompt, image, out.token_ids)
        bf16 = _hf_logprobs(hf16, vlm, prompt, image, out.token_ids)
        gaps += [abs(a - b) for a, b in zip(out.logprobs or [], ref, strict=True)]
        floor += [abs(a - b) for a, b in zip(bf16, ref, strict=True)]
    mean, bf16_gap = sum(gaps) / len(gaps), sum(floor) / len(floor)
    bound = parity_bound(bf16_gap)
    print(f"VLM_PARITY mean={mean:.4f} bound={bound:.4f} transformers_bf16={bf16_gap:.4f}")
    assert mean <= bound, f"mean |logprob - transformers| = {mean:.4f} > {bound:.4f} (bf16 floor {bf16_gap:.4f})"


def test_full_weight_set_loads_after_level2_sleep(engine: Any, vlm: dict[str, Any]) -> None:
    """Every tensor of the checkpoint, vision tower included, goes back through load_weights."""
    from genengine.testing.conformance import load_checkpoint

    before = _run(engine, vlm, [vlm["images"][0]] * 2)
    weights = {name: t.to("cuda") for name, t in load_checkpoint(vlm["model"]).items()}
    assert any("visual" in name for name in weights), sorted(weights)[:5]
    engine.sleep(2)
    engine.wake(["weights"])
    report = engine.load_weights(weights.items())
    engine.wake(["kv_cache"])
    assert report.num_tensors == len(weights)
    after = _run(engine, vlm, [vlm["images"][0]] * 2)
    assert [r.outputs[0].token_ids for r in after] == [r.outputs[0].token_ids for r in before]
