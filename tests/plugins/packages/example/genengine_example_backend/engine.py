from genengine.protocol import GenerationOutput, GenerationResult, LoadReport


class EchoEngine:
    """Implements the protocol by duck typing, without EngineBase: the registry must accept that."""

    supported_tags = ("weights", "kv_cache")

    def __init__(self, config):
        self.config = config
        self.sleeping = False

    @property
    def state(self):
        from genengine.protocol import EngineState

        return EngineState(released_tags=frozenset(self.supported_tags) if self.sleeping else frozenset())

    @property
    def is_sleeping(self):
        return self.sleeping

    def generate(self, prompts=None, sampling_params=None, *, prompt_token_ids=None, image_data=None):
        return [GenerationResult([], [GenerationOutput([], p, "length")]) for p in prompts]

    def sleep(self, level=1):
        self.sleeping = True

    def wake(self, tags=None):
        self.sleeping = False

    def load_weights(self, named_tensors, *, bucket_bytes=None, check_finite=False, version=None):
        return LoadReport(0, 0, 0, 0.0)

    def flush_cache(self):
        pass

    def shutdown(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
