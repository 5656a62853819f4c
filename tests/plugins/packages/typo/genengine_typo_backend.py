"""Imports fine; its registrations are wrong in the ways issue 40 (A9) lists."""

from genengine.hookspecs import hookimpl


class Engine:
    """Never built: every backend below fails before its factory would run."""


@hookimpl
def register_backends(register):
    # A requirement that is missing, with an install hint that only reinstalls this plugin.
    register(
        "needsdep",
        "genengine_typo_backend:Engine",
        requires=("genengine_dependency_that_does_not_exist",),
        install_hint="pip install genengine-typo-backend",
    )
    register("typoattr", "genengine_typo_backend:Engin")  # the attribute misspelt
    register("typomodule", "genengine_typo_backendd:Engine")  # the module misspelt
    register("transformers", "genengine_typo_backend:Engine")  # a built-in's name
