"""Fails at import like a plugin whose own dependency is missing."""

import genengine_dependency_that_does_not_exist  # noqa: F401
