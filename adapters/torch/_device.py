"""The torch adapter's device facts: dtype names, ArrayInfo of a tensor, the
Target a tensor's device launches on, and the one-device check of a call."""
from __future__ import annotations

import functools
import os

import torch

from core_kernels._plan import ArrayInfo
from core_kernels._target import Target

TORCH_DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
    "int32": torch.int32, "int64": torch.int64, "uint8": torch.uint8, "int8": torch.int8,
    "float64": torch.float64, "bool": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


def info(t: torch.Tensor) -> ArrayInfo:
    return ArrayInfo(tuple(t.shape), DTYPE_NAMES.get(t.dtype, str(t.dtype)), tuple(t.stride()))


def interpret_requested() -> bool:
    """True when the user asked for Triton's interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def gluon_available() -> bool:
    """Gluon kernels launch from torch through Triton itself (no bridge needed)."""
    try:
        import triton.experimental.gluon  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def _cuda_target(index: int) -> Target:
    props = torch.cuda.get_device_properties(index)
    return Target("cuda", props.major * 10 + props.minor, props.multi_processor_count,
                  gluon=gluon_available())


def target_for(device: torch.device) -> Target:
    """The Target of a torch device: the interpreter for CPU tensors, else the GPU's facts."""
    if device is None or device.type == "cpu":
        return Target.interpreter()
    return _cuda_target(device.index if device.index is not None else torch.cuda.current_device())


def check_devices(**tensors) -> torch.device:
    """All tensors on one device; CPU tensors need the interpreter. Returns the device."""
    device, first = None, None
    for name, t in tensors.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if type(t) is not torch.Tensor and type(t).__torch_dispatch__ is not \
                torch.Tensor.__torch_dispatch__:  # reached only when the first argument is plain
            raise TypeError(f"{name}: a {type(t).__name__} (a tensor subclass such as DTensor) "
                            "mixed with plain tensors; pass the same kind for every tensor "
                            "argument, the first included")
        if device is None:
            device, first = t.device, name
        elif t.device != device:
            raise ValueError(f"{name}: on {t.device}, but {first} is on {device}; "
                             "all tensors must be on one device")
    if device is not None and device.type == "cpu" and torch.cuda.is_available() \
            and not interpret_requested():
        raise ValueError(f"{first}: CPU tensors on a machine with a GPU; move them to the GPU, "
                         "or set TRITON_INTERPRET=1 to run the kernels under Triton's interpreter")
    return device
