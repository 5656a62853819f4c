"""Adapters that put genengine under other projects' trainers (``genengine.integrations.trl`` for TRL).

Nothing is imported here: each integration is imported only by the code that uses it, so ``import genengine``
stays light and a missing trainer library costs nothing until it is asked for.
"""
