"""example_scale for PyTorch: the example op of ADDING_AN_OP.md (a custom op
over the shared kernel; the torch parts every op has, and nothing else)."""
from __future__ import annotations

import torch

from core_kernels.example_scale import EXAMPLE_SCALE, plan_example_scale

from ._executor import execute
from ._register import custom_op
from ._scalars import scale_tensor


def _impl(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return execute(plan_example_scale, dict(x=x, scale=scale))["out"]


_op = custom_op("example_scale", _impl, axes=EXAMPLE_SCALE,
                fake=lambda x, scale: torch.empty_like(x, memory_format=torch.contiguous_format))


def example_scale(x: torch.Tensor, scale) -> torch.Tensor:
    """``x * scale``, computed in fp32 and rounded once.

    Args:
        x: [T, H, D] float32/float16/bfloat16, contiguous.
        scale: a finite float > 0, or a 1-element float32 tensor on x's device
            (device data: never read on the host).
    Returns:
        a new [T, H, D] tensor of x's dtype. No backward: a call that needs one
        raises RuntimeError.
    """
    return _op(x, scale_tensor("scale", scale, x))
