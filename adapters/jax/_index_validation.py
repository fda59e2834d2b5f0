"""Opt-in index validation for the JAX ops (docs/index_validation.md).

An op function calls, before planning::

    if index_validation(validate_indices, *index_arrays):
        check_indices(_index_check.check_<op>, dict(name=array, ...), **static)

Off (the default): one flag test and one environment lookup; no transfer.
On: the index arrays come to the host in one ``jax.device_get`` of a tuple
(one sync) and core_kernels._index_check raises a ValueError naming the bad
argument before anything is launched.
"""
from __future__ import annotations

import jax
import numpy as np

from core_kernels import _index_check

_TRACED = ("validate_indices: index validation reads the index arrays on the host, but they are "
           "traced here (jax.jit, vmap, grad); validate in an eager call, or leave "
           f"validate_indices=None (the {_index_check.ENV_VAR} switch skips traced calls)")


def traced(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def index_validation(flag, *arrays) -> bool:
    """Whether this call validates its index data (see core_kernels._index_check.requested).
    When any index array is traced (under jax.jit, vmap, grad: no values on the
    host), an explicit ``validate_indices=True`` raises ValueError and the
    environment switch skips the call."""
    if not _index_check.requested(flag):
        return False
    if any(traced(x) for x in arrays):
        if flag:
            raise ValueError(_TRACED)
        return False
    return True


def host_arrays(arrays: dict) -> dict | None:
    """{name: numpy array} of the given arrays (None entries dropped), fetched in
    one ``jax.device_get``; None when they are not all int32/int64 arrays (the
    planner refuses those with its own message)."""
    items = {n: x for n, x in arrays.items() if x is not None}
    if not items or not all(np.dtype(getattr(x, "dtype", np.float32)).name in ("int32", "int64")
                            for x in items.values()):
        return None
    values = jax.device_get(tuple(items.values()))
    return {n: np.asarray(v) for n, v in zip(items, values)}


def check_indices(check, arrays: dict, **static) -> None:
    """Run ``check`` (a core_kernels._index_check function) over host copies of
    ``arrays`` (one transfer) with the op's ``static`` shapes and options."""
    host = host_arrays(arrays)
    if host is not None:
        check(host, **static)


def buffer_address(x) -> int | None:
    """The device address of a concrete GPU array's buffer (is_block_table_ptr)."""
    try:
        return int(x.unsafe_buffer_pointer())
    except Exception:  # noqa: BLE001 - traced, deleted or sharded: nothing to compare against
        return None
