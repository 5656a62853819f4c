"""The shared machinery every backend runs on: the state machine and load sessions (``base``), the async base
(``aio``), and the process plumbing (``lifecycle``, ``environ``, ``checkpoint``, ``ipc``).

Plugin authors reach it through :mod:`genengine.backend`; this package itself imports nothing.
"""
