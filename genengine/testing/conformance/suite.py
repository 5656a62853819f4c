"""``EngineConformance``: the test mixins in the order the suite has always run them, and shutdown last."""

from __future__ import annotations

from typing import Any

from genengine.errors import EngineClosedError
from genengine.testing.conformance.adapters import AdapterTests
from genengine.testing.conformance.asynchronous import AsyncTests
from genengine.testing.conformance.generate import GenerateTests
from genengine.testing.conformance.sleep_wake import SleepWakeTests
from genengine.testing.conformance.weights import WeightsTests

__all__ = ["EngineConformance"]


# pytest collects inherited tests base by base in reverse MRO order, so these bases (listed last to
# first) run generate, then sleep/wake, then load_weights, then async (skipped for engines without it), then
# adapters (skipped for engines without them), then the class's own shutdown test.
class EngineConformance(AdapterTests, AsyncTests, WeightsTests, SleepWakeTests, GenerateTests):
    """The conformance suite. Subclass it, override ``make_engine`` and the capability flags."""

    # ---- shutdown --------------------------------------------------------------------------------------
    def test_context_manager_and_shutdown(self, other_record: dict[str, Any]) -> None:
        """Recorded on the fresh engine of ``other_record``: ``with`` returns it and shuts it down."""
        assert other_record["enter_returns_self"]
        assert other_record["closed"]
        assert other_record["second_shutdown"] is None, "shutdown must be idempotent"
        for call, error in other_record["errors_after_shutdown"].items():
            assert isinstance(error, EngineClosedError), f"{call} after shutdown raised {error!r}"
