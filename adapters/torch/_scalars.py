"""Scalar arguments of the torch ops (the policy: docs/scalar_policy.md).

Host numbers are checked by core_kernels._plan.as_int / as_float (shared with the
JAX adapter and the planners); tensors stay device data (never read on the host).
"""
from __future__ import annotations

import torch

from core_kernels._plan import as_float


def scale_tensor(name: str, value, like: torch.Tensor):
    """A scale given as a tensor (device data, passed as is: its shape and dtype are
    the planner's to check) or as a host number (finite and > 0, else ValueError),
    which becomes a 1-element float32 tensor on ``like``'s device."""
    if value is None or isinstance(value, torch.Tensor):
        return value
    return torch.tensor([as_float(name, value, positive=True)], dtype=torch.float32,
                        device=like.device if isinstance(like, torch.Tensor) else None)
