"""What the conformance suite cannot know: this backend's registration, options and raw runner."""

from __future__ import annotations

import pytest

from genengine import available_backends, create_engine
from genengine.config import EngineConfig
from genengine.errors import ConfigError
from genengine.models.tiny_model import tiny_model_dir
from genengine.plugins.registry import get_backend


def test_registered_through_the_entry_point() -> None:
    info = get_backend("template")
    assert info.distribution == "genengine-backend-template"
    assert info.loadable and info.raw_runner == "genengine_template.raw:raw_tokens_per_second"
    assert "template" in {b.name for b in available_backends()}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tp_size": 2}, "tp_size=2"),
        ({"devise": "cpu"}, "unknown option 'devise' for backend 'template' (did you mean 'device'?)"),
        ({"device": "tpu"}, "device='tpu'"),
        ({"model": "/no/such/model"}, "'/no/such/model' is not a local model folder"),
    ],
)
def test_bad_configuration_is_rejected_before_loading(kwargs: dict[str, object], message: str) -> None:
    config = {"backend": "template", "model": str(tiny_model_dir()), **kwargs}
    with pytest.raises(ConfigError) as info:
        create_engine(**config)
    assert message in str(info.value)


def test_raw_runner_measures_the_loop_alone() -> None:
    from genengine_template.raw import raw_tokens_per_second

    config = EngineConfig(backend="template", model=str(tiny_model_dir()), dtype="float32")
    assert raw_tokens_per_second(config, [[1, 2, 3], [4, 5]], 4) > 0
