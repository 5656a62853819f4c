"""Tiny random-weight models of real architectures, built offline in seconds: ``tiny_model`` (causal LMs) and
``tiny_vlm`` (a Qwen2-VL). Product code: the demos, the benchmarks and the tests build from here.

``genengine.testing.tiny_model`` / ``tiny_vlm`` re-export them under their documented older paths.
"""
