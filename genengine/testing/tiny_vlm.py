"""The tiny Qwen2-VL builder under its documented older path: it lives in :mod:`genengine.models.tiny_vlm`."""

from genengine.models.tiny_vlm import (
    ARCHITECTURE,
    IMAGE_TOKEN,
    VIDEO_TOKEN,
    VISION_END_TOKEN,
    VISION_START_TOKEN,
    VLM_CHAT_TEMPLATE,
    build_tiny_vlm,
    tiny_image,
    tiny_image_png,
    tiny_vlm_dir,
)

__all__ = [
    "ARCHITECTURE",
    "IMAGE_TOKEN",
    "VIDEO_TOKEN",
    "VISION_END_TOKEN",
    "VISION_START_TOKEN",
    "VLM_CHAT_TEMPLATE",
    "build_tiny_vlm",
    "tiny_image",
    "tiny_image_png",
    "tiny_vlm_dir",
]
