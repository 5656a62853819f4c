"""verl's trainer on any genengine backend: ``actor_rollout_ref.rollout.name=genengine``.

A ``verl.plugins`` entry point (``genengine.integrations.verl.plugin``) registers, in every process that imports
verl, the replica (:mod:`~genengine.integrations.verl.replica`), the server actor verl's client calls
(:mod:`~genengine.integrations.verl.server`) and the server adapter in each trainer worker
(:mod:`~genengine.integrations.verl.adapter`). The backend and its options come from
``rollout.engine_kwargs.genengine`` (:mod:`~genengine.integrations.verl.config`, importable without verl).
See docs/verl.md. Importing this package imports neither verl, Ray nor torch.
"""

from genengine.integrations.verl.config import NAME, VerlEngineSettings, engine_settings

__all__ = ["NAME", "VerlEngineSettings", "engine_settings"]
