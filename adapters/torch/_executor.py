"""The one generic executor that runs a core_kernels Plan with torch tensors."""
from __future__ import annotations

import functools
import os

import torch

from core_kernels._interpret import INTERPRETER_LOCK, interpreted
from core_kernels._plan import ArrayInfo, Plan, Scalar
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


# Plans by the raw metadata of their tensors (see planned()).
_PLANS = {}
_PLANS_MAX = 4096


def _meta(t):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def planned(planner, tensors: dict, *, check_also: dict | None = None, **options):
    """(plan, device): ``planner(target, *ArrayInfos, **options)`` over ``tensors``
    (name -> tensor or None, in the planner's positional order), after
    check_devices over them and ``check_also`` (tensors the plan does not take).

    Cached by each tensor's raw (shape, strides, dtype, device) and the
    options, so a repeated call with the same layouts (every decode step) skips
    the device checks, the ArrayInfo construction and the planner's own cache
    hashing. NOTE: that was ~11 us of a ~65 us block-sparse decode call's host
    time on the H200 machine. A failing check or plan is never cached.
    """
    extra = check_also or {}
    try:
        key = (planner, tuple(map(_meta, tensors.values())), tuple(map(_meta, extra.values())),
               tuple(options.items()))
        hit = _PLANS.get(key)
    except (AttributeError, TypeError):  # not tensors / unhashable: the checks below say why
        key, hit = None, None
    if hit is None:
        device = check_devices(**tensors, **extra)
        plan = planner(target_for(device), *(None if t is None else info(t) for t in tensors.values()),
                       **options)
        hit = (plan, device)
        if key is not None:
            if len(_PLANS) >= _PLANS_MAX:
                _PLANS.clear()
            _PLANS[key] = hit
    return hit


def run_plan(plan: Plan, tensors: dict, runtime: dict | None = None,
             device: torch.device | None = None) -> dict:
    """Allocate ``plan.buffers``, run its launches; returns every buffer by name."""
    env = dict(tensors)
    if device is None:
        device = next(t.device for t in tensors.values() if isinstance(t, torch.Tensor))
    for name, buf in plan.buffers.items():
        alloc = torch.zeros if buf.zero_init else torch.empty
        env[name] = alloc(buf.shape, dtype=TORCH_DTYPES[buf.dtype], device=device)
    interpret = device.type == "cpu"
    switch = not interpret and device.index is not None and device.index != torch.cuda.current_device()
    for launch in plan.launches:
        args = [(runtime[a.value] if isinstance(a.value, str) else a.value)
                if isinstance(a, Scalar) else env[a] for a in launch.args]
        args += [env[o] for o in launch.outputs]
        if interpret:
            with INTERPRETER_LOCK:  # the interpreter is not thread-safe (core_kernels._interpret)
                interpreted(launch.kernel)[launch.grid](*args, **launch.constexprs)
        elif switch:
            with torch.cuda.device(device):
                _launch(launch, args, device.index)
        else:
            _launch(launch, args, device.index)
    return env


# Compiled kernels by (launch, specialisation key): a cached plan's launch
# goes straight to the compiled kernel's launcher, skipping JITFunction.run's
# argument binding and cache-key hashing (the bulk of a Triton launch's host time).
_COMPILED = {}
_FAST_PATH = True


def _spec_key(launch, args, device_index):
    """What Triton specialises on that can change between calls of one plan:
    pointer alignment, and runtime integers equal to 1 or past int32 (never their
    divisibility: the integer policy of core_kernels._triton_utils.jit)."""
    key = []
    for a, arg in zip(launch.args + launch.outputs, args):
        if isinstance(arg, torch.Tensor):
            key.append(arg.data_ptr() % 16 == 0)
        elif isinstance(a, Scalar) and isinstance(a.value, str):
            key.append((arg == 1, -2 ** 31 <= arg < 2 ** 31) if isinstance(arg, int) else None)
    return launch, device_index, tuple(key)


def _hooks_set() -> bool:
    """Whether Triton launch hooks (profilers) are installed. NOTE: Triton 3.6 keeps
    them as HookChain objects that are never None, empty when unused; comparing
    with None had disabled the fast path below on every launch (H200: 67 us of
    host time per decode call instead of ~7 us)."""
    import triton
    hooks = triton.knobs.runtime.launch_enter_hook, triton.knobs.runtime.launch_exit_hook
    return any(h is not None and bool(getattr(h, "calls", True)) for h in hooks)


def _launch(launch, args, device_index):
    global _FAST_PATH
    key = _spec_key(launch, args, device_index) if _FAST_PATH else None
    entry = _COMPILED.get(key) if _FAST_PATH and not _hooks_set() else None
    if entry is not None:
        compiled, grid, constexprs = entry
        stream = torch._C._cuda_getCurrentRawStream(device_index if device_index is not None
                                                    else torch.cuda.current_device())
        compiled.run(grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata,
                     None, None, None, *args, *constexprs)
        return
    compiled = launch.kernel[launch.grid](*args, **launch.constexprs,
                                          num_warps=launch.num_warps, num_stages=launch.num_stages)
    try:
        if not hasattr(compiled, "packed_metadata"):
            raise AttributeError("unknown launcher")
        if _hooks_set():
            return  # the regular path calls the hooks
        names = launch.kernel.arg_names[len(args):]
        grid = tuple(launch.grid) + (1,) * (3 - len(launch.grid))
        _COMPILED[key] = (compiled, grid, tuple(launch.constexprs[n] for n in names))
    except (AttributeError, KeyError):
        _FAST_PATH = False  # another Triton version: always take the regular path
