"""The hook's parameter is misspelt: pluggy refuses the plugin when it is registered."""

from genengine.hookspecs import hookimpl


@hookimpl
def register_backends(reg):
    reg("badparam", "genengine_badhook_param:nothing")
