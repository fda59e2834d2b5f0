"""Opt-in index validation for the torch ops (docs/index_validation.md).

An op function calls, before its custom op::

    if index_validation(validate_indices, *index_tensors):
        check_indices(_index_check.check_<op>, dict(name=tensor, ...), **static)

Off (the default): one flag test and one environment lookup; no sync, no
allocation, nothing traced. On: every index tensor of the call goes to the
host in one copy (one sync) and core_kernels._index_check raises a ValueError
naming the bad argument before anything is launched.
"""
from __future__ import annotations

import numpy as np
import torch

from core_kernels import _index_check

# the index dtypes every op accepts (others: the planner's TypeError comes first)
_INDEX_DTYPES = {torch.int32: np.int32, torch.int64: np.int64}
_TRACED = ("validate_indices: index validation reads the index tensors on the host, which "
           "{} cannot do; validate in an eager call, or leave validate_indices=None (the "
           f"{_index_check.ENV_VAR} switch skips such calls)")


def index_validation(flag, *tensors) -> bool:
    """Whether this call validates its index data (see core_kernels._index_check.requested).

    Where host values cannot be read, under torch.compile tracing and during
    CUDA graph capture, an explicit ``validate_indices=True`` raises ValueError
    (under ``torch.compile(fullgraph=True)`` Dynamo reports it as an error
    quoting this message; without fullgraph the call falls back to eager and
    is validated there), while the environment switch skips the call.
    """
    if torch.compiler.is_compiling():  # checked first: nothing else is traced
        if flag:
            raise ValueError(_TRACED.format("torch.compile tracing"))
        return False
    if not _index_check.requested(flag):
        return False
    if any(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors) \
            and torch.cuda.is_current_stream_capturing():
        if flag:
            raise ValueError(_TRACED.format("CUDA graph capture"))
        return False
    return True


def host_arrays(tensors: dict) -> dict | None:
    """{name: numpy array} of the given tensors (None entries dropped), copied
    to the host together: one concatenation on the device, one ``.cpu()``.
    Each keeps its dtype. None when they are not all int32/int64 tensors on one
    device (the planner refuses those with its own message)."""
    items = {n: t for n, t in tensors.items() if t is not None}
    if not items or not all(isinstance(t, torch.Tensor) and t.dtype in _INDEX_DTYPES
                            for t in items.values()):
        return None
    devices = {t.device for t in items.values()}
    if len(devices) != 1:
        return None
    if devices.pop().type == "cpu":
        return {n: t.detach().numpy() for n, t in items.items()}
    flat = torch.cat([t.detach().reshape(-1).to(torch.int64) for t in items.values()]).cpu().numpy()
    out, at = {}, 0
    for n, t in items.items():
        out[n] = flat[at:at + t.numel()].astype(_INDEX_DTYPES[t.dtype]).reshape(tuple(t.shape))
        at += t.numel()
    return out


def check_indices(check, tensors: dict, **static) -> None:
    """Run ``check`` (a core_kernels._index_check function) over host copies of
    ``tensors`` (one sync) with the op's ``static`` shapes and options."""
    host = host_arrays(tensors)
    if host is not None:
        check(host, **static)
