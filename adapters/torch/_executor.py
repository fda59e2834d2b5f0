"""The one generic executor that runs a core_kernels Plan with torch tensors."""
from __future__ import annotations

import functools
import math
import operator
import os
import threading

import torch

from core_kernels._index_check import requested as _validation_requested
from core_kernels._interpret import INTERPRETER_LOCK, interpreted
from core_kernels._plan import ArrayInfo, Plan, Scalar, kernel_signature, row_major_strides
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


def planned(planner, tensors: dict, **options):
    """(plan, device): ``planner(target, *ArrayInfos, **options)`` over ``tensors``
    (name -> tensor or None, in the planner's positional order), after
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
    plan = planner(target_for(device), *(None if t is None else info(t) for t in tensors.values()), **options)
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


# ---------------------------------------------------------------- call memo
try:  # torch's C check of a tensor's layout, the one torch.compile's guards use
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:  # another torch: no memo (every call takes the regular path)
    _TensorGuards = None

_SCALAR_TYPES = (type(None), bool, int, float, str)
_Tensor = torch.Tensor
_is_compiling = torch.compiler.is_compiling


class _Recording(threading.local):
    """The call a CallMemo is recording on this thread: [memo, tensors,
    scalars, offers] (``execute`` appends (plan, device, tensors by name,
    runtime, whether it had a check) to offers), or None. ``commit`` or
    ``abandon`` (a failed call) ends it."""
    state = None


_RECORDING = _Recording()


def _layout_guard(tensors):
    """torch's C check that tensors have these tensors' type, dispatch keys
    (device type, inference, views such as neg), dtype, device index,
    requires_grad, sizes and strides; None where this torch has none."""
    if _TensorGuards is None:
        return None
    try:
        return _TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                             dynamic_dims_strides=[list(t.stride()) for t in tensors])
    except Exception:  # noqa: BLE001  (a torch whose guard takes other arguments)
        return None


_MEMOS = []  # every CallMemo
_MEMO_ENABLED = True


def set_call_memo(enabled: bool) -> None:
    """Turn the replay of repeated eager calls (CallMemo) on or off; either
    way the memos are emptied. Off, every call takes its op's regular path
    (benchmarks compare the two; tests that patch planner tables use it)."""
    global _MEMO_ENABLED
    _MEMO_ENABLED = bool(enabled)
    for memo in _MEMOS:
        memo.entries.clear()
        memo.seen.clear()
        memo.skip = memo.last_skip = 0


_SEEN_MAX = 64
_PAID_OFF = 10  # replays that repay making an entry (~60 us against ~6 us saved per replay)


class _MemoEntry:
    __slots__ = ("types", "scalars", "fixed", "pick", "guard", "run", "prog", "plan", "device", "runtime", "hits")


class CallMemo:
    """Recent eager calls of one public op, replayed without the op's Python.

    A call's plan follows from its tensors' layouts (type, dtype, device,
    sizes, strides) and its host scalars alone, so a call that matches an
    earlier successful one in all of them passes every check that one passed
    and runs the same plan: ``lookup`` finds it by torch's C layout check
    (``TensorGuards``, which torch.compile's guards use: ~0.1 us per tensor
    against ~0.4 us to hash a Python key of the same facts) and runs the plan
    on the new tensors (fresh outputs, the new data pointers). Not memoised,
    so always on the op's regular path: calls under torch.compile tracing,
    calls that validate index data, calls whose scalars are not None / bool /
    int / float / str (configs, tensors), calls with a tensor that requires
    grad (the guard then refuses any call that does), calls with a per-call
    host check (``execute``'s ``check``), tensor subclasses, and calls that
    run other than one ``execute``.

    An entry is made at the second regular-path call that runs a plan (cached
    by layouts and options) seen lately, so layouts that never repeat (prefill
    lengths) make none; the memo keeps ``size`` entries, and after one is
    dropped before it repaid its making, the next ones are skipped (backing
    off). On the development CPU with CUDA stubbed, a call whose layout is
    new every time costs ~2 us more than with the memo off (the lookup's
    failed checks, the recording), 13 vs 11 us for a block-sparse prefill.

    The op's function (try / except rather than ``with MEMO``: torch.compile's
    Dynamo refuses a context manager made outside the compiled function,
    ``Unsupported context manager``, so fullgraph compiles would break)::

        env = MEMO.lookup(tensors, scalars, validate_indices)
        if env is not None:
            return env["output"]
        try:
            ...  # the regular path
        except BaseException:
            MEMO.abandon()
            raise
        MEMO.commit()

    ``names``: the op's tensor arguments in ``tensors``' order, as its
    ``execute`` call names them; ``written``: those it updates in place (their
    version counters are bumped on a replay, as the regular path does).
    NOTE: with the CUDA calls stubbed (benchmarks/experiments/exp_host_python.py,
    2026-11-25, the development CPU, 7bd5f01: the replay written out,
    ``_straight``) a block-sparse decode call's Python took 4.3-4.4 us
    replayed against 10.2 us on the regular path; lightning prefill 4.3-4.6
    against 9.2, merge N1 3.0-3.1 against 7.7, prefix prefill 4.2 against 12.6.
    On the H200 host, torch eager / plain Triton launch went from 0.55-0.94 on
    the regular path to 0.25-0.52 (benchmarks/RESULTS.md).
    """
    __slots__ = ("names", "written", "entries", "size", "seen", "skip", "last_skip")

    def __init__(self, names, written=(), size=4):
        self.names, self.size = tuple(names), size
        self.written = tuple(self.names.index(n) for n in written)
        self.entries = []
        self.seen = {}  # id(plan) -> plan: plans run on the regular path lately
        self.skip = self.last_skip = 0
        _MEMOS.append(self)

    def lookup(self, tensors: tuple, scalars: tuple, validate=None):
        """The env (buffers and tensors by name) of this call run from a
        matching entry, or None: take the regular path (this then records it)."""
        if _is_compiling():
            return None
        if validate is not False and _validation_requested(validate):
            _RECORDING.state = None
            return None
        types = tuple(map(type, scalars))
        for entry in self.entries:
            if entry.types == types and entry.scalars == scalars and entry.guard.check(*entry.pick(tensors)):
                for j, i in entry.fixed:  # absent tensors, and one tensor passed twice
                    if tensors[j] is not (None if i is None else tensors[i]):
                        break
                else:
                    run = entry.run
                    env = run(tensors) if run is not None else None
                    if env is None:
                        env = self._replay(entry, tensors)
                    if env is not None:
                        entry.hits += 1
                        return env
                    break
        _RECORDING.state = [self, tensors, scalars, []] if all(t in _SCALAR_TYPES for t in types) else None
        return None

    def _replay(self, entry, tensors):
        """The entry's plan run on the call's tensors as the regular path runs it
        (where the entry has no straight-line run, or that run declined the call)."""
        if entry.prog is not None:
            env = _run_gpu(entry.prog, dict(zip(self.names, tensors)), entry.runtime, entry.device)
        elif torch.cuda.is_available() and not interpret_requested():
            return None  # the regular path's error (check_devices)
        else:
            env = _run_interpreted(entry.plan, dict(zip(self.names, tensors)), entry.runtime, entry.device)
        if self.written:
            _increment_version([t for t in map(tensors.__getitem__, self.written) if t is not None])
        return env

    def commit(self) -> None:
        """Keep the call that ``lookup`` started recording, when it qualifies."""
        if _is_compiling():
            return
        state = _RECORDING.state
        if state is None or state[0] is not self:
            return
        _RECORDING.state = None
        if not _MEMO_ENABLED:
            return
        _, tensors, scalars, offers = state
        if len(offers) != 1:
            return
        plan, device, named, runtime, checked = offers[0]
        if checked:
            return
        # NOTE: an entry costs ~60 us to make (the guard, the replay's tables and its
        # straight-line source: 2026-11-25, with CUDA stubbed) on the
        # development CPU: a plan (cached by the layouts and options) is given one
        # only when it comes back, so calls whose layouts never repeat (prefill
        # lengths) pay ~1.5 us of recording and no entries; and after an entry was
        # dropped before _PAID_OFF replays, the next ones are skipped (doubling, up to 64)
        seen = self.seen
        if seen.get(id(plan)) is not plan:
            seen[id(plan)] = plan
            if len(seen) > _SEEN_MAX:
                del seen[next(iter(seen))]
            return
        if self.skip:
            self.skip -= 1
            return
        index = {n: i for i, n in enumerate(self.names)}
        for name, t in named.items():  # every tensor the plan ran on is one of the call's, by name
            if name not in index or tensors[index[name]] is not t:
                return
        present, fixed, first = [], [], {}
        for j, t in enumerate(tensors):  # the guard takes each tensor once (it refuses aliases)
            i = None if t is None else first.setdefault(id(t), j)
            if i == j:
                present.append(j)
            else:
                fixed.append((j, i))
        chosen = [tensors[i] for i in present]
        if any(type(t) is not _Tensor or t.requires_grad for t in chosen):
            return
        guard = _layout_guard(chosen)
        if guard is None or not guard.check(*chosen):
            return
        entry = _MemoEntry()
        entry.types, entry.scalars = tuple(map(type, scalars)), scalars
        entry.fixed = tuple(fixed)
        entry.pick = _getter(present)
        entry.guard, entry.plan, entry.device, entry.runtime = guard, plan, device, runtime
        entry.prog = _program(plan) if device.type == "cuda" else None
        entry.run = None if entry.prog is None else _straight(
            entry.prog, self.names, device, runtime, [j for j in self.written if tensors[j] is not None])
        entry.hits = 0
        self.entries.insert(0, entry)
        for dropped in self.entries[self.size:]:
            self.skip = 0 if dropped.hits >= _PAID_OFF else min(2 * self.last_skip + 1, 64)
            self.last_skip = self.skip
        del self.entries[self.size:]

    def abandon(self) -> None:
        """End the recording of a call that failed (its tensors are let go)."""
        state = _RECORDING.state
        if state is not None and state[0] is self:
            _RECORDING.state = None


_increment_version = getattr(torch._C, "_increment_version", torch.autograd.graph.increment_version)


def _getter(index):
    """operator.itemgetter(*index), always returning a tuple (empty for no index)."""
    if len(index) > 1:
        return operator.itemgetter(*index)
    return (lambda s, i=index[0]: (s[i],)) if index else (lambda s: ())


# NOTE: a replay makes its outputs by new_empty_strided on a kept 0-element tensor of
# the dtype and device (positional arguments only): 0.72 against 0.84 us for
# torch.empty_strided(..., dtype=, device=) on the development CPU, 2026-11-25.
_new_empty_strided = torch.Tensor.new_empty_strided

# NOTE: compiling a replay's source takes ~190 us on the development CPU (2026-11-25);
# the source depends on the plan's structure, not on its shapes or values (those are
# make's arguments), so the code is kept by source and a new entry of a known
# structure pays the source's making and an exec.
_STRAIGHT_CODE = {}
_STRAIGHT_MAX = 256


def _straight(prog, names, device, runtime, written=()):
    """A memo entry's GPU run (what ``_run_gpu`` does for ``prog``) as one
    generated straight-line function of the call's tensors, in the op's order
    ``names`` (``_straight_source``); None where it cannot be (a launch not
    compiled for 16-byte aligned pointers, an unknown launcher). The function
    returns the buffers it made by name, or None where the call needs
    ``_run_gpu`` (another device current, launch hooks, a CUDA graph capture of
    a plan with per-stream scratch, a pointer not 16-byte aligned); it bumps the
    version counters of the tensors at positions ``written``."""
    if not _FAST_PATH:
        return None
    made = _straight_source(prog, names, device, runtime, tuple(written))
    if made is None:
        return None
    source, values = made
    code = _STRAIGHT_CODE.get(source)
    if code is None:
        if len(_STRAIGHT_CODE) >= _STRAIGHT_MAX:
            _STRAIGHT_CODE.clear()
        code = _STRAIGHT_CODE[source] = compile(source, "<call memo replay>", "exec")
    scope = {}
    exec(code, globals(), scope)  # noqa: S102  (our own generated source)
    return scope["make"](*values)


def _scratch_views(views, device, bufs, stream):
    """The per-stream buffers ``bufs`` ((name, Buffer)) on ``stream`` (_stream_scratch),
    kept in ``views`` by stream: a straight-line replay looks them up once per stream."""
    if len(views) >= _VIEWS_MAX:
        views.clear()
    found = views[stream] = [_stream_scratch(device, name, buf) for name, buf in bufs]
    return found


def _straight_source(prog, names, device, runtime, written):
    """The source of ``make(*values)``, which returns ``run(tensors)``: ``prog``
    run on the tensors ``names`` written out, with every fixed value (shapes,
    templates, placeholder pointers, launch arguments, compiled launchers) a
    closure variable; None where a launch has no compiled kernel for aligned
    pointers. Module functions (``_data_ptr``, ``_raw_stream``, ...) are looked
    up at each call, so a monkeypatch of the module reaches them.

    NOTE: on the development CPU with CUDA stubbed (2026-11-25), the replay of a
    block-sparse decode call took 2.4-2.5 us written out against 3.8-3.9 us by
    tables of positions and itemgetters (the decode launch has 31 arguments)."""
    values, value_names = [], {}

    def value(v):
        key = id(v)
        if key not in value_names:
            value_names[key] = f"v{len(values)}"
            values.append(v)
        return value_names[key]
    index = device.index if device.index is not None else torch.cuda.current_device()
    where = {name: f"tensors[{i}]" for i, name in enumerate(names)}  # each object's expression
    fixed = {}  # placeholders: name -> data pointer
    made, stream_bufs, allocs = [], [], []
    for name, shape, strides, dtype, mode, buf in prog.allocs:
        if name in where:
            raise ValueError(f"{name}: a buffer named as an argument")
        if mode is _PER_STREAM:
            where[name] = f"scratch[{len(stream_bufs)}]"
            stream_bufs.append((name, buf))
        elif mode is _PLACEHOLDER:
            fixed[name] = _placeholder(device, buf.dtype).data_ptr()
        else:
            where[name] = var = f"m{len(made)}"
            made.append((name, var))
            allocs.append(f"{var} = torch.zeros({value(shape)}, dtype={value(dtype)}, device={value(device)})"
                          if mode is _ZEROS else
                          f"{var} = _new_empty_strided({value(_empty_strided((0,), (1,), dtype=dtype, device=device))}, "
                          f"{value(shape)}, {value(strides)})")
    body = [f"if _current_device() != {value(index)} or _hooks_set():", "    return None",
            f"stream = _raw_stream({value(index)})"]
    if stream_bufs:
        views = value({})
        body += ["if _is_capturing():", "    return None", f"scratch = {views}.get(stream)", "if scratch is None:",
                 f"    scratch = _scratch_views({views}, {value(device)}, {value(tuple(stream_bufs))}, stream)"]
    body += allocs
    pointers, launches = {}, []  # pointers: name -> the variable holding its data pointer
    for _, recipe in prog.launches:
        rts = [runtime[n] for n in recipe.rt_names]
        fixed_ptrs = [fixed[n] for n in recipe.ptr_names if n in fixed]
        entry = None if _gcd(*fixed_ptrs) & 15 else recipe.compiled.get(_spec(index, fixed_ptrs, rts))
        if entry is None:
            return None
        ptrs = []
        for n in recipe.ptr_names:
            if n in fixed:
                ptrs.append(value(fixed[n]))
                continue
            if n not in pointers:
                pointers[n] = f"p{len(pointers)}"
                body.append(f"{pointers[n]} = _data_ptr({where[n]})")
            ptrs.append(pointers[n])
        rest = [*ptrs, *map(value, rts), *map(value, recipe.consts)]
        args = [rest[i] for i in recipe.index]  # the kernel's parameters in order
        g = entry.grid
        if entry.raw is not None:
            head = [*map(value, (g[0], g[1], g[2])), "stream", value(entry.function), value(entry.coop),
                    value(entry.pdl), "None", "None", value(entry.meta), "None", "None", "None"]
            launches.append(f"{value(entry.raw)}({', '.join(head + args)})")
        else:
            launches.append(f"{value(entry)}(stream, ({', '.join(args)},))")
    if pointers:
        body += [f"if _gcd({', '.join(pointers.values())}) & 15:", "    return None"]
    body += launches
    if written:
        body.append(f"_increment_version([{', '.join(f'tensors[{j}]' for j in written)}])")
    body.append("return {" + ", ".join(f"{name!r}: {var}" for name, var in made) + "}")
    source = (f"def make({', '.join(f'v{i}' for i in range(len(values)))}):\n"
              "    def run(tensors):\n" + "".join(f"        {line}\n" for line in body) + "    return run\n")
    return source, values


def _run_gpu(prog, tensors: dict, runtime, device) -> dict:
    env = tensors
    if prog.allocs:
        env = dict(tensors)
        capturing = None
        for name, shape, strides, dtype, mode, buf in prog.allocs:
            if mode is _PER_STREAM:
                if capturing is None:
                    capturing = _is_capturing()
                if not capturing:
                    env[name] = _stream_scratch(device, name, buf)
                    continue
                mode = _ZEROS if buf.zero_init else _EMPTY
            if mode is _EMPTY:
                env[name] = _empty_strided(shape, strides, dtype=dtype, device=device)
            elif mode is _ZEROS:
                env[name] = torch.zeros(shape, dtype=dtype, device=device)
            else:
                env[name] = _placeholder(device, buf.dtype)
    index = device.index
    if index is None:
        index = torch.cuda.current_device()
    if index != _current_device():
        with torch.cuda.device(device):
            for launch, recipe in prog.launches:
                _launch(launch, recipe, env, runtime, index)
    else:
        for launch, recipe in prog.launches:
            _launch(launch, recipe, env, runtime, index)
    return env


def _run_interpreted(plan, tensors, runtime, device) -> dict:
    env = dict(tensors)
    for name, buf in plan.buffers.items():
        alloc = torch.zeros if buf.zero_init else torch.empty
        env[name] = alloc(buf.shape, dtype=TORCH_DTYPES[buf.dtype], device=device)
    for launch in plan.launches:
        with INTERPRETER_LOCK:  # the interpreter is not thread-safe (core_kernels._interpret)
            interpreted(launch.kernel)[launch.grid](*_tensor_args(launch, env, runtime),
                                                   **launch.constexprs)
    return env


def _tensor_args(launch, env, runtime) -> list:
    """A launch's arguments as Triton's launch takes them: tensors and scalars, in order."""
    args = [(runtime[a.value] if isinstance(a.value, str) else a.value)
            if isinstance(a, Scalar) else env[a] for a in launch.args]
    return args + [env[o] for o in launch.outputs]


# Placeholder buffers (Buffer.placeholder: no launch reads or writes them) share
# one small tensor per (device, dtype) instead of an allocation per call.
_PLACEHOLDERS = {}


def _placeholder(device, dtype: str) -> torch.Tensor:
    key = (device, dtype)
    t = _PLACEHOLDERS.get(key)
    if t is None:
        t = _PLACEHOLDERS[key] = torch.zeros(16, dtype=TORCH_DTYPES[dtype], device=device)
    return t


# Per-stream scratch (Buffer.per_stream): (device index, raw stream, buffer name,
# dtype, zero_init) -> [flat tensor, {shape: view of it}]. Calls on one stream run
# in order, so each may use the buffer that the previous one has finished with;
# a zero_init buffer is zeroed when allocated and left zero by the launches.
# NOTE: a CUDA graph capture allocates its own instead (it keeps the address:
# two graphs captured on one stream may be replayed on two streams at once).
# Saves an allocation per call (torch.empty took 7 us of host time on the H200
# host, 2026-11-24).
_STREAM_SCRATCH = {}
_VIEWS_MAX = 64


def _stream_scratch(device, name: str, buf) -> torch.Tensor:
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, torch._C._cuda_getCurrentRawStream(index), name, buf.dtype, buf.zero_init)
    hit = _STREAM_SCRATCH.get(key)
    if hit is not None:
        view = hit[1].get(buf.shape)
        if view is not None:
            return view
    numel = math.prod(buf.shape)
    if hit is None or hit[0].numel() < numel:
        # growing frees the old one: the caching allocator hands it out again
        # only on this stream, after the work queued here
        alloc = torch.zeros if buf.zero_init else torch.empty
        hit = _STREAM_SCRATCH[key] = [alloc((numel,), dtype=TORCH_DTYPES[buf.dtype], device=device), {}]
    if len(hit[1]) >= _VIEWS_MAX:
        hit[1].clear()
    view = hit[1][buf.shape] = hit[0][:numel].view(buf.shape)
    return view


# How run_plan makes a buffer (_Program.allocs).
_EMPTY, _ZEROS, _PLACEHOLDER, _PER_STREAM = "empty", "zeros", "placeholder", "per_stream"
_current_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)
# NOTE: the C function behind torch.cuda.is_current_stream_capturing, without its
# Python wrapper (which also checks that CUDA is initialised: a tensor on the GPU
# is proof enough)
_is_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", torch.cuda.is_current_stream_capturing)
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


# NOTE: a contiguous buffer is made by torch.empty_strided with its strides
# worked out in advance: 2.25 us of host time per call against 3.5-3.7 us for
# torch.empty of the same shape (H200 host, 2026-11-25,
# benchmarks/experiments/exp_merge_small.py --only alloc).
_empty_strided = torch.empty_strided


class _Program:
    """A plan's GPU run, worked out once: the buffers to make, as (name, shape,
    contiguous strides, torch dtype, mode, Buffer), and the launches with their
    recipes."""
    __slots__ = ("plan", "allocs", "launches")

    def __init__(self, plan):
        self.plan = plan
        self.allocs = tuple(
            (name, tuple(buf.shape), row_major_strides(buf.shape), TORCH_DTYPES[buf.dtype],
             _PLACEHOLDER if buf.placeholder else _PER_STREAM if buf.per_stream
             else _ZEROS if buf.zero_init else _EMPTY, buf)
            for name, buf in plan.buffers.items())
        self.launches = tuple((launch, _Recipe(launch)) for launch in plan.launches)


class _Recipe:
    """A launch's arguments as the compiled kernel's C launcher takes them, in
    the kernel's parameter order, constexprs included: ``getter`` picks them
    from ``[data pointers of ptr_names] + [runtime values of rt_names] + consts``
    (the plan-time scalars and the constexprs). ``compiled``: the launch's
    compiled kernels by specialisation (_spec)."""
    __slots__ = ("ptr_names", "tensors", "rt_names", "getter", "index", "consts", "compiled")

    def __init__(self, launch):
        order = []  # per parameter: ("p" | "r" | "c", index)
        ptrs, rts, consts = [], [], []
        for name, const, _ in kernel_signature(launch.kernel):
            if const:
                order.append(("c", len(consts)))
                consts.append(launch.constexprs[name])
                continue
            a = launch.params[name]
            if isinstance(a, str):
                order.append(("p", len(ptrs)))
                ptrs.append(a)
            elif isinstance(a.value, str):
                order.append(("r", len(rts)))
                rts.append(a.value)
            else:
                order.append(("c", len(consts)))
                consts.append(a.value)
        base = {"p": 0, "r": len(ptrs), "c": len(ptrs) + len(rts)}
        self.index = index = [base[kind] + i for kind, i in order]
        self.getter = _getter(index)
        self.ptr_names, self.rt_names, self.consts = tuple(ptrs), tuple(rts), consts
        self.tensors = _getter(ptrs)
        self.compiled = {}


# Programs by plan (plans are cached, so few): id -> _Program, which keeps the
# plan so that its id cannot be reused while the entry lives.
_PROGRAMS = {}


def _program(plan) -> _Program:
    prog = _PROGRAMS.get(id(plan))
    if prog is None or prog.plan is not plan:
        if len(_PROGRAMS) >= _PLANS_MAX:
            _PROGRAMS.clear()
        prog = _PROGRAMS[id(plan)] = _Program(plan)
    return prog


# A cached plan's launch goes straight to the compiled kernel's C launcher,
# skipping JITFunction.run's argument binding and cache-key hashing (the bulk of
# a Triton launch's host time), with the pointers passed as integers: the
# launcher then neither calls data_ptr() nor asks the driver about each pointer
# (cuPointerGetAttribute); the devices were checked when the plan was made.
_FAST_PATH = True
_data_ptr = torch.Tensor.data_ptr


def _spec(device_index, ptrs, rts):
    """What Triton specialises on that can change between calls of one launch:
    pointer alignment and runtime integers equal to 1 or past int32 (never their
    divisibility: the integer policy of core_kernels._triton_utils.jit). The
    usual case, every pointer 16-byte aligned and no runtime integer, is the
    device index alone."""
    aligned = not (_gcd(*ptrs) & 15)
    if aligned and not rts:
        return device_index
    return (device_index, True if aligned else tuple(p & 15 == 0 for p in ptrs),
            tuple((v == 1, -2 ** 31 <= v < 2 ** 31) if isinstance(v, int) else None for v in rts))


# NOTE: every pointer is 16-byte aligned iff their gcd is a multiple of 16 (gcd(0, p) = p;
# no pointers: 0): one C call, ~0.1 us for eight pointers against ~0.35 us for
# functools.reduce(operator.or_) (the development CPU, 2026-11-25).
_gcd = math.gcd


_KNOBS = None
_HOOK_CHAIN = None


def _hooks_set() -> bool:
    """Whether Triton launch hooks (profilers) are installed. NOTE: Triton 3.6 keeps
    them as HookChain objects that are never None, empty when unused; comparing
    with None had disabled the fast path below on every launch (H200: 67 us of
    host time per decode call instead of ~7 us)."""
    global _KNOBS, _HOOK_CHAIN
    if _KNOBS is None:
        import triton
        _KNOBS = triton.knobs.runtime
        _HOOK_CHAIN = getattr(triton.knobs, "HookChain", None)
    for h in (_KNOBS.launch_enter_hook, _KNOBS.launch_exit_hook):
        if h is not None and (type(h) is not _HOOK_CHAIN or h.calls):
            return True
    return False


class _Compiled:
    """A compiled kernel's launcher: ``raw``, the C launch function itself, where
    the kernel needs no scratch allocation (else the launcher object, which
    allocates it)."""
    __slots__ = ("run", "raw", "function", "meta", "grid", "coop", "pdl")

    def __init__(self, compiled, grid):
        run = compiled.run
        self.run, self.function, self.meta = run, compiled.function, compiled.packed_metadata
        self.grid = grid
        no_scratch = not getattr(run, "global_scratch_size", 1) and not getattr(run, "profile_scratch_size", 1)
        self.raw = getattr(run, "launch", None) if no_scratch else None
        self.coop = getattr(run, "launch_cooperative_grid", False)
        self.pdl = getattr(run, "launch_pdl", False)

    def __call__(self, stream, args):
        g = self.grid
        if self.raw is not None:
            self.raw(g[0], g[1], g[2], stream, self.function, self.coop, self.pdl, None, None, self.meta,
                     None, None, None, *args)
        else:
            self.run(g[0], g[1], g[2], stream, self.function, self.meta, None, None, None, *args)


def _launch(launch, recipe, env, runtime, device_index):
    global _FAST_PATH
    if _FAST_PATH:
        ptrs = list(map(_data_ptr, recipe.tensors(env)))
        if recipe.rt_names:
            rts = [runtime[n] for n in recipe.rt_names]
            key, values = _spec(device_index, ptrs, rts), ptrs + rts + recipe.consts
        else:
            key = device_index if not (_gcd(*ptrs) & 15) else _spec(device_index, ptrs, ())
            values = ptrs + recipe.consts
        entry = recipe.compiled.get(key)
        if entry is not None and not _hooks_set():
            g, raw = entry.grid, entry.raw
            if raw is not None:
                raw(g[0], g[1], g[2], _raw_stream(device_index), entry.function, entry.coop, entry.pdl,
                    None, None, entry.meta, None, None, None, *recipe.getter(values))
            else:
                entry(_raw_stream(device_index), recipe.getter(values))
            return
    compiled = launch.kernel[launch.grid](*_tensor_args(launch, env, runtime), **launch.constexprs,
                                          num_warps=launch.num_warps, num_stages=launch.num_stages)
    if not _FAST_PATH or _hooks_set():
        return  # the regular path calls the hooks
    try:
        if not hasattr(compiled, "packed_metadata") or _raw_stream is None:
            raise AttributeError("unknown launcher")
        grid = tuple(launch.grid) + (1,) * (3 - len(launch.grid))
        recipe.compiled[key] = _Compiled(compiled, grid)
    except (AttributeError, KeyError):
        _FAST_PATH = False  # another Triton version: always take the regular path
