from genengine.hookspecs import hookimpl


@hookimpl
def register_backends(register):
    register("example", "genengine_duplicate_backend:nothing")
