"""Shim of vllm.utils: the platform queries the fetched files and tests call."""
import torch


def is_hip() -> bool:
    return torch.version.hip is not None


def is_cpu() -> bool:
    return not torch.cuda.is_available()


def is_xpu() -> bool:
    return False


def get_max_shared_memory_bytes(gpu: int = 0) -> int:
    """Opt-in shared memory per block of the device (vLLM reads the same CUDA
    attribute, cudaDevAttrMaxSharedMemoryPerBlockOptin, through its extension).
    0 without a GPU (only collection happens there)."""
    if not torch.cuda.is_available():
        return 0
    props = torch.cuda.get_device_properties(gpu)
    value = getattr(props, "shared_memory_per_block_optin", None)
    if not value:
        raise RuntimeError("torch does not report shared_memory_per_block_optin")
    return int(value)
