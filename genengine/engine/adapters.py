"""``AdapterHost``: LoRA adapters on ``EngineBase``, written once for every backend.

The checks (name, config, rank, target modules, shapes) and the registry live here; a backend that serves
adapters sets ``supports_adapters = True`` and fills in ``_max_lora_rank``, ``_add_adapter`` and
``_drop_adapter``. Requests are bound to the adapter object in force when the engine takes them, so a
replacement (a trainer's next sync under the same name) never changes a request in flight, and their
outputs carry that adapter's version.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from genengine.adapters import Adapter, AdapterConfig, AdapterInfo, check_adapter, check_adapter_name
from genengine.errors import EngineSleepingError, EngineStateError, InvalidArgumentError
from genengine.protocol import TAG_WEIGHTS
from genengine.requests import Request

if TYPE_CHECKING:
    import torch

    from genengine.weights import WeightInfo

__all__ = ["AdapterHost"]


class AdapterHost:
    """The adapter half of ``EngineBase`` (a mixin: ``EngineBase`` provides the state checks it calls)."""

    supports_adapters: ClassVar[bool] = False
    """True for a backend that serves LoRA adapters; the conformance suite's adapter tests skip otherwise."""
    adapter_modules: ClassVar[tuple[str, ...] | None] = None
    """Module-name suffixes the backend can adapt (None: every linear layer)."""

    # ---- what a backend that serves adapters implements ----------------------------------------------------
    def _max_lora_rank(self) -> int:
        return 0

    def _add_adapter(self, adapter: Adapter, replaced: Adapter | None) -> None:
        """Make ``adapter`` servable (set ``adapter.handle``); raising leaves ``replaced`` served as it was."""
        raise NotImplementedError

    def _drop_adapter(self, adapter: Adapter) -> None:
        """``adapter`` was replaced or unloaded: free it once the requests bound to it have finished."""
        raise NotImplementedError

    # ---- for a backend whose engine serves adapters by name (SGLang, vLLM) ----------------------------------
    @property
    def _retired_adapters(self) -> list[Adapter]:
        retired: list[Adapter] | None = self.__dict__.get("_retired_adapters_list")
        if retired is None:
            retired = self.__dict__["_retired_adapters_list"] = []
        return retired

    def _retire_adapter(self, adapter: Adapter, unload: Callable[[Adapter], None]) -> None:
        """A ``_drop_adapter`` for such a backend: ``adapter`` is freed by ``unload`` once no request uses it."""
        self._retired_adapters.append(adapter)
        self._unload_idle_adapters(unload)

    def _unload_idle_adapters(self, unload: Callable[[Adapter], None]) -> None:
        """``unload`` the retired adapters no request of ours uses any more (an engine serving them by name
        must not lose one under a request in flight)."""
        used = self._adapters_in_use()
        retired = self._retired_adapters
        for adapter in [a for a in retired if id(a) not in used]:
            retired.remove(adapter)
            unload(adapter)

    def _adapters_in_use(self) -> set[int]:
        """The ids of the adapters bound to requests not done (``AsyncEngineBase`` provides it)."""
        raise NotImplementedError

    # ---- EngineBase provides these -------------------------------------------------------------------------
    def _check_open(self) -> None:
        raise NotImplementedError

    def _check_no_open_load(self, what: str) -> None:
        raise NotImplementedError

    def _weight_spec(self) -> Mapping[str, WeightInfo]:
        raise NotImplementedError

    @property
    def released_tags(self) -> frozenset[str]:
        raise NotImplementedError

    # ---- the calls -----------------------------------------------------------------------------------------
    @property
    def _adapter_registry(self) -> dict[str, Adapter]:
        registry: dict[str, Adapter] | None = self.__dict__.get("_adapters_by_name")
        if registry is None:
            registry = self.__dict__["_adapters_by_name"] = {}
        return registry

    @property
    def max_lora_rank(self) -> int:
        """The largest adapter rank this engine takes (0: it serves none)."""
        return self._max_lora_rank() if self.supports_adapters else 0

    @property
    def adapters(self) -> Mapping[str, AdapterInfo]:
        """The adapters loaded now, by name."""
        return {name: adapter.info() for name, adapter in self._adapter_registry.items()}

    def _check_serves_adapters(self, what: str) -> None:
        if not self.supports_adapters:
            raise EngineStateError(
                f"{type(self).__name__} does not serve LoRA adapters ({what}); sync merged weights with "
                "load_weights instead"
            )

    def load_adapter(
        self,
        name: str,
        named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
        config: Any,
        *,
        version: int | None = None,
    ) -> AdapterInfo:
        """Check the whole adapter (PEFT's tensor names, its ``LoraConfig``), then serve it as ``name``.

        A bad adapter is refused before anything reaches the engine, which keeps serving what it had. Loading
        a name again replaces it for later requests; requests in flight finish under the one they started
        with. ``version`` (an int >= 0) labels the outputs generated with it; None keeps the replaced one's.
        """
        self._check_open()
        self._check_serves_adapters("load_adapter")
        check_adapter_name(name)
        config = AdapterConfig.coerce(config)
        if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 0):
            raise InvalidArgumentError(f"version={version!r} must be an integer >= 0 or None")
        self._check_no_open_load("load an adapter")
        if TAG_WEIGHTS in self.released_tags:
            raise EngineSleepingError("the weights are asleep: call wake(['weights']) before load_adapter")
        start = time.perf_counter()
        pairs = check_adapter(
            named_tensors, config, self._weight_spec(), max_rank=self._max_lora_rank(), servable=self.adapter_modules
        )
        registry = self._adapter_registry
        old = registry.get(name)
        label = version if version is not None else (old.version if old is not None else 0)
        adapter = Adapter(name=name, version=label, config=config, pairs=pairs)
        checked = time.perf_counter()
        adapter.phases["check_s"] = checked - start
        self._add_adapter(adapter, old)
        registry[name] = adapter
        added = time.perf_counter()
        adapter.phases["add_s"] = added - checked
        if old is not None:
            self._drop_adapter(old)
        end = time.perf_counter()
        adapter.phases["retire_s"] = end - added
        return adapter.info(end - start)

    def unload_adapter(self, name: str) -> None:
        """Stop serving ``name``; requests in flight with it finish, later ones naming it are refused."""
        self._check_open()
        self._check_serves_adapters("unload_adapter")
        registry = self._adapter_registry
        if name not in registry:
            raise InvalidArgumentError(f"adapter {name!r} is not loaded; loaded: {sorted(registry) or 'none'}")
        self._drop_adapter(registry.pop(name))

    def _bind_adapters(self, requests: list[Request]) -> list[Request]:
        """Each request that names an adapter, bound to the one loaded under that name now (or refused)."""
        if not any(r.params.adapter is not None for r in requests):
            return requests
        registry = dict(self._adapter_registry)
        bound = []
        for request in requests:
            name = request.params.adapter
            if name is not None:
                if not self.supports_adapters:
                    raise InvalidArgumentError(
                        f"adapter={name!r}: {type(self).__name__} does not serve LoRA adapters; leave adapter=None"
                    )
                if name not in registry:
                    raise InvalidArgumentError(
                        f"adapter={name!r} is not loaded; loaded: {sorted(registry) or 'none'} (load_adapter first)"
                    )
                request = dataclasses.replace(request, lora=registry[name])
            bound.append(request)
        return bound

    def _rebind_adapter(self, request: Request) -> Request:
        """A request as the engine starts it: bound to the adapter loaded under its name now (one queued during a
        pause was bound when submitted, and a sync may have replaced it since). Once started it keeps that one; a
        name unloaded meanwhile keeps the adapter it was submitted under."""
        if request.lora is None:
            return request
        current = self._adapter_registry.get(request.lora.name)
        if current is None or current is request.lora:
            return request
        return dataclasses.replace(request, lora=current)

    @staticmethod
    def _version_of(request: Request, base: int) -> int:
        """The ``weight_versions`` label of a request's tokens: its adapter's version, or the base weights'."""
        return base if request.lora is None else request.lora.version
