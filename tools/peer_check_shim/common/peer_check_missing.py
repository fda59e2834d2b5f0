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


SCOPE_MARK = "peer-check: out of scope:"


def out_of_scope(vllm_module: str, name: str, why: str):
    """A name whose tests check something other than the kernel (vLLM's backend
    class, its NVFP4 cache format): calling it skips the calling test."""
    def stub(*args, **kwargs):
        import pytest
        pytest.skip(f"{SCOPE_MARK} {vllm_module}.{name}: {why}")
    stub.__name__ = name
    stub.__qualname__ = name
    return stub


def from_ours(vllm_module: str, name: str, ours: str | None = None):
    """adapters.torch.<ours or name>, or the MISSING stub while adapters.torch lacks it."""
    import adapters.torch as at
    return getattr(at, ours or name, None) or missing(vllm_module, name)
