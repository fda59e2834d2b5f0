"""The one generic executor that runs a core_kernels Plan with torch tensors:
the plan cache (``planned``) and the run (``run_plan``, ``execute``). The GPU
launches themselves are ``_launcher``'s; the replay of repeated eager calls is
``_call_memo``'s (``execute`` offers it the call it is recording)."""
from __future__ import annotations

import torch

from core_kernels._plan import Plan

from ._call_memo import _RECORDING, CallMemo, set_call_memo  # noqa: F401  (the ops' memo)
from ._device import TORCH_DTYPES, DTYPE_NAMES, check_devices, info, interpret_requested, target_for  # noqa: F401
from ._launcher import _program, _run_gpu, _run_interpreted

# Plans by the raw metadata of their tensors (see planned()).
_PLANS = {}
_PLANS_MAX = 4096


def planned(planner, tensors: dict, **options):
    """(plan, device): ``planner(target, **ArrayInfos, **options)`` over ``tensors``
    (name -> tensor or None, each named as the planner's parameter), after
    check_devices over them.

    Cached by each tensor's raw (shape, strides, dtype, device) and the
    options, so a repeated call with the same layouts (every decode step) skips
    the device checks, the ArrayInfo construction and the planner's own cache
    hashing. NOTE: that was ~11 us of a ~65 us block-sparse decode call's host
    time on the H200 machine. A failing check or plan is never cached.
    """
    key, hit = _cached(planner, tensors, options)
    return hit if hit is not None else _plan(planner, tensors, options, key)


def _cached(planner, tensors: dict, options: dict):
    """(key, cached (plan, device) or None); key None when the arguments cannot
    make one (not tensors, unhashable options: the checks in _plan say why)."""
    try:
        key = (planner, *[None if t is None else (t.shape, t.stride(), t.dtype, t.device)
                          for t in tensors.values()], *options.items())
        return key, _PLANS.get(key)
    except (AttributeError, TypeError):
        return None, None


def _plan(planner, tensors: dict, options: dict, key):
    device = check_devices(**tensors)
    # by keyword: the dict's names are the planner's parameters, so its order cannot swap arrays
    plan = planner(target_for(device), **{n: None if t is None else info(t) for n, t in tensors.items()},
                   **options)
    if key is not None:
        if len(_PLANS) >= _PLANS_MAX:
            _PLANS.clear()
        _PLANS[key] = (plan, device)
    return plan, device


def run_plan(plan: Plan, tensors: dict, runtime: dict | None = None,
             device: torch.device | None = None) -> dict:
    """Allocate ``plan.buffers``, run its launches; returns every buffer by name
    (with ``tensors``: entries that are None are never read)."""
    if device is None:
        device = next(t.device for t in tensors.values() if isinstance(t, torch.Tensor))
    if device.type != "cuda":
        return _run_interpreted(plan, tensors, runtime, device)
    return _run_gpu(_program(plan), tensors, runtime, device)


def execute(planner, tensors: dict, runtime: dict | None = None, check=None, **options) -> dict:
    """``planned`` then ``run_plan`` in one call (the eager path of the ops):
    returns every buffer by name. ``check(plan, device)``, when given, runs between
    them on every call (checks of host values against the planned shapes;
    ``device`` is the tensors' device)."""
    key, hit = _cached(planner, tensors, options)
    plan, device = hit if hit is not None else _plan(planner, tensors, options, key)
    if check is not None:
        check(plan, device)
    if device.type != "cuda":
        env = _run_interpreted(plan, tensors, runtime, device)
    else:
        env = _run_gpu(_program(plan), tensors, runtime, device)
    recording = _RECORDING.state
    if recording is not None:
        recording[3].append((plan, device, tensors, runtime, check is not None))
    return env
