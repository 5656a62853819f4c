"""The tiny-model builder under its documented older path: it lives in :mod:`genengine.models.tiny_model`."""

from genengine.models.tiny_model import (
    ARCHITECTURES,
    CHAT_TEMPLATE,
    EOS_TOKEN,
    build_tiny_model,
    count_params,
    tiny_model_dir,
)

__all__ = ["ARCHITECTURES", "CHAT_TEMPLATE", "EOS_TOKEN", "build_tiny_model", "count_params", "tiny_model_dir"]
