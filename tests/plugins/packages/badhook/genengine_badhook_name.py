"""The hook's name is misspelt: pluggy accepts it, genengine never calls it, so no backend is registered."""

from genengine.hookspecs import hookimpl


@hookimpl
def register_backend(register):
    register("badname", "genengine_badhook_name:nothing")
