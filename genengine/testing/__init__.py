"""Test support that ships with genengine: the tiny-model builder and the backend conformance suite.

``genengine.testing.conformance`` needs pytest and is imported only by test modules; this package itself
imports nothing heavy.
"""

from genengine.models.tiny_model import build_tiny_model, tiny_model_dir

__all__ = ["build_tiny_model", "tiny_model_dir"]
