"""This repository's own test helpers, kept out of the shipped ``genengine.testing`` (which holds what a
third-party backend's tests need: the conformance suite, the tiny models, the parity bound).

Imported as ``support``: pytest puts ``tests/`` on ``sys.path`` (pyproject's ``pythonpath``, and
``tests/conftest.py`` in "prepend" import mode), whichever folder a test file sits in; the scripts that run outside
pytest (``tests/gpu/tp2_*.py`` and ``dp2.py`` under torchrun, ``benchmarks/``) get it from
``tools/gpu/run_tests.sh``'s ``PYTHONPATH`` or put it there themselves.
"""
