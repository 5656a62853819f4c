from genengine.hookspecs import hookimpl


@hookimpl
def register_backends(register):
    register("example", "genengine_example_backend.engine:EchoEngine", description="echoes prompts (test fake)")
