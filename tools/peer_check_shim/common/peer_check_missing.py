"""A name a vLLM test imports that adapters.torch does not provide (our code)."""


class MissingInOurs(NotImplementedError):
    pass


MARK = "MISSING in adapters.torch"


def missing(vllm_module: str, name: str):
    def stub(*args, **kwargs):
        raise MissingInOurs(f"{MARK}: {vllm_module}.{name} has no adapters.torch counterpart")
    stub.__name__ = name
    stub.__qualname__ = name
    return stub
