"""The shared machinery every backend runs on: the state machine and load sessions (``base``), the async base
(``aio``), the ``from_config`` factory (``factory``), a sample's seed, text and stop rules (``completion``), and the
process plumbing (``lifecycle``, ``environ``, ``checkpoint``, ``ipc``).

Plugin authors reach most of it through :mod:`genengine.backend`, and ``checkpoint``, ``environ`` and
``lifecycle`` directly where their engine needs them (docs/plugins.md); this package itself imports nothing.
"""
