"""Plan of lightning attention's backward (framework-free): dq, dk, dv, the
starting state's and (optionally) the decay rates' gradients, from the
forward's inputs, its returned states and the output gradients.

Two forms. With the decay constant, and the returned states' gradient (if
any) on the final state alone, the three gradients are the forward recurrence
itself on other operands (_forward_passes), so they run the forward's kernels
(Gluon where those apply). With G_t = dL/dS_t and the reference's notation:

    dq_t = S_t dO_t      = forward(q=dO, k=v, v=k, history=S_hist^T)_t
    dv_t = k_t G_t       = reversed forward(q=k, k=q, v=dO, history=dKV, shifted)_t
    dk_t = v_t G_t^T     = reversed forward(q=v, k=dO, v=q, history=dKV^T, shifted)_t
    d kv_history = lambda G_0 = lambda * (the dV pass's final state)

"reversed" walks the sequence from its end (G_t collects tokens u >= t),
"shifted" lets the history (dKV, the final state's gradient) enter the first
token walked undecayed: G_{N-1} = q^T dO + dKV, not lambda dKV. Otherwise (the
decay's gradient, or gradients on per-block states, or a
LightningBackwardConfig): the scan kernels of backward_kernels.py, which also
carry the decay's tangent. Packed sequences (plan_lightning_attention_varlen_backward)
take the same two forms, each sequence on its own."""
from __future__ import annotations

import dataclasses

from .._plan import (ArrayInfo, Buffer, Launch, Plan, Scalar, cdiv, check_config, check_dtype,
                     check_shape, config_class, memoize, next_pow2, row_major_strides)
from .._target import Target
from .backward_kernels import (_lightning_bwd_decay_kernel, _lightning_bwd_dkv_kernel, _lightning_bwd_dq_kernel,
                               _state_map_kernel)
from .prefill_plan import (DEFAULT_DOT_PRECISION, DOT_PRECISIONS, _chunking, _planned_launch, _validate_prefill,
                           prefill_state_shape)


@config_class
class LightningBackwardConfig:
    """The scan kernels (backward_kernels.py); passing one forces them (by
    default they run only where the forward's kernels cannot: the decay's
    gradient, gradients on per-block states). block_t: tokens per chunk; block_d / block_e: the D-tile of the dq and dk
    programs and the E-tile of the dv programs (powers of two >= 16);
    dot_precision: the products' input precision on the GPU for fp32/fp16
    inputs ("tf32" or "ieee"; bf16 inputs multiply in bf16); num_warps: at
    most 4 are used where a tile is narrower than 64 (see _default_config)."""
    block_t: int = 64
    block_d: int = 64
    block_e: int = 64
    num_warps: int = 8
    num_stages: int = 1
    dot_precision: str = DEFAULT_DOT_PRECISION

    def __post_init__(self):
        if self.dot_precision not in DOT_PRECISIONS:
            raise ValueError(f"dot_precision: expected one of {DOT_PRECISIONS}, got {self.dot_precision!r}")
        for name in ("block_t", "block_d", "block_e"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"config: {name} must be a power of two >= 16, got {value}")


def _default_config(dtype: str) -> LightningBackwardConfig:
    """NOTE: H200, 2026-11-24, the backward launches alone (D = E = 128, final
    state, B1 H64 N4096 / B4 H64 N1024; benchmarks/bench_lightning_backward.py
    --sweep over block_t 32/64, tiles 32/64, 4/8 warps, 1/2 stages): bf16 best
    with block_t 64, tile 64, 8 warps (1518 / 1362 us; 4 warps: 5063 / 4212 us,
    register spills), fp32 with block_t 32, tile 64, 8 warps (2171 / 2044 us;
    block_t 64: 2364 / 2212 us). Below 64-wide tiles the plan runs 4 warps:
    with 8, bf16 dv at D 20, E 12 (16-wide tiles) came out NaN on the H200
    (2026-11-24), while 4 warps there were right."""
    return LightningBackwardConfig(block_t=64 if dtype == "bfloat16" else 32)


BACKWARD_RESULTS = ("grad_q", "grad_k", "grad_v", "grad_kv_history", "grad_ed")


@memoize
def plan_lightning_attention_backward(
    target: Target, q: ArrayInfo, k: ArrayInfo, v: ArrayInfo, ed: ArrayInfo,
    kv_history: ArrayInfo | None, kv: ArrayInfo, grad_output: ArrayInfo,
    grad_kv: ArrayInfo | None, *, block_size: int = 256, output_final_state_only: bool = False,
    need_grad_ed: bool = True, config: LightningBackwardConfig | None = None, batch_invariant: bool = False,
) -> Plan:
    """Plan the backward of ``plan_lightning_attention``.

    q, k, v, ed, kv_history, block_size, output_final_state_only: the
    forward's (same validation). ``kv``: the forward's returned states
    (contiguous float32, [B, H, NB + 1, D, E] or [B, H, D, E]; checked, not
    read); ``grad_output`` [B, H, N, E] in q's dtype, innermost dim
    contiguous; ``grad_kv``: kv's gradient (contiguous float32, kv's shape) or
    None (zero). Results: "grad_q", "grad_k" [B, H, N, D], "grad_v"
    [B, H, N, E] in q's dtype; "grad_kv_history" [B, H, D, E] float32 (zeros
    when kv_history is None); "grad_ed" [H] float32 (zeros unless
    ``need_grad_ed``). Deterministic (no atomics). The form (the forward's
    kernels or the scans) is the module docstring's. ``batch_invariant``: the
    forward's kernels planned as plan_lightning_attention plans them with it
    (each (b, h) row's gradients independent of the other rows; d ed sums
    over the batch whatever the plan).
    """
    check_config(config, (LightningBackwardConfig,))
    p = _validate_prefill(q, k, v, ed, kv_history, block_size, output_final_state_only)
    c = config or _default_config(p.dtype)
    kv_shape = prefill_state_shape(p.b, p.h, p.n, p.d, p.e, p.block_size, p.final_only)
    _check_gradients(grad_output, (p.b, p.h, p.n, p.e), "[B, H, N, E]", p.dtype, kv, grad_kv, kv_shape,
                     "the forward's returned states")
    buffers = {"grad_q": Buffer((p.b, p.h, p.n, p.d), p.dtype),
               "grad_k": Buffer((p.b, p.h, p.n, p.d), p.dtype),
               "grad_v": Buffer((p.b, p.h, p.n, p.e), p.dtype),
               "grad_kv_history": Buffer((p.b, p.h, p.d, p.e), "float32", zero_init=kv_history is None),
               "grad_ed": Buffer((p.h,), "float32", zero_init=not need_grad_ed)}
    if p.b == 0 or p.h == 0:
        for name in BACKWARD_RESULTS:
            buffers[name] = Buffer(buffers[name].shape, buffers[name].dtype, zero_init=True)
        return Plan(buffers, (), BACKWARD_RESULTS)
    if config is None and not need_grad_ed and (grad_kv is None or p.final_only):
        return Plan(buffers, _forward_passes(target, p, grad_output, grad_kv, buffers, bool(batch_invariant)),
                    BACKWARD_RESULTS)
    # chunks laid out per returned state block, as the forward's (prefill_kernels.py)
    block_len, chunks, _, num_chunks = _chunking(p, c.block_t)
    strides = {n: info.strides[:3] for n, info in (("q", p.q), ("k", p.k), ("v", p.v), ("o", grad_output))}
    dims = _Dims(p.b, p.h, p.d, p.e, p.dtype, p.ed.strides[0])
    walk = dict(seq_len=Scalar(p.n), block_len=Scalar(block_len), num_chunks=Scalar(num_chunks))
    launches = _launches(target, c, buffers, dims, strides, walk, chunks, p.kv_history, kv_shape,
                         grad_kv is not None, p.final_only, need_grad_ed, varlen=False)
    return Plan(buffers, launches, BACKWARD_RESULTS)


def _forward_passes(target, p, grad_output: ArrayInfo, grad_kv: ArrayInfo | None, buffers: dict,
                    invariant: bool) -> tuple:
    """dq, dv, dk as three launches of the forward prefill's kernel (the module
    docstring's identities), each planned as the forward plans it (Gluon where
    it applies) and its buffers renamed; plus the state maps around them:
    S_hist^T and dKV^T before, lambda * (the dV pass's final state) after.
    Adds the scratch to ``buffers``."""
    def plan_pass(qi, ki, vi, hi, reverse, shift):
        f = _validate_prefill(qi, ki, vi, p.ed, hi, p.block_size, True)
        return _planned_launch(target, f, None, invariant, reverse, shift)

    return _passes(p, p.kv_history, grad_output, grad_kv, buffers, plan_pass, False)


def _varlen_forward_passes(target, p, cu_seqlens: ArrayInfo, kv_history: ArrayInfo | None,
                           grad_output: ArrayInfo, grad_kv: ArrayInfo | None, buffers: dict,
                           invariant: bool) -> tuple:
    """_forward_passes for packed sequences: per pass the varlen kernel the
    forward would run (Gluon or Triton; each sequence walked, reversed and
    shifted on its own; the history of sequence b is row b), and d kv_history
    copied undecayed for an empty sequence (its final state is its history:
    G_0 = dKV)."""
    from . import varlen_plan as vp

    def plan_pass(qi, ki, vi, hi, reverse, shift):
        f = vp._validate(qi, ki, vi, p.ed, cu_seqlens, None, None, 256)
        # (no token at all: the Triton kernel, whose one item per sequence carries the history)
        if f.t and vp._use_gluon(target, f, None, invariant):
            plan = vp._gluon_launch(f, vp._gluon_config(target, f, None), hi is not None, reverse, shift)
        else:
            plan = vp._launch(target, f, vp._config(target, f, None, invariant), hi is not None, reverse, shift)
        return plan.buffers, plan.launches[0]

    return _passes(p, kv_history, grad_output, grad_kv, buffers, plan_pass, True)


def _passes(p, kv_history, grad_output, grad_kv, buffers, plan_pass, varlen: bool) -> tuple:
    """The launches of _forward_passes / _varlen_forward_passes; ``plan_pass(q,
    k, v, history, reverse, shift)`` plans one pass -> (buffers, launch)."""
    launches = []

    def state_map(src, info, dst, transpose):
        rows, cols = info.shape[2], info.shape[3]
        buffers[dst] = Buffer((p.b, p.h, cols, rows) if transpose else (p.b, p.h, rows, cols), "float32")
        launches.append(Launch(
            kernel=_state_map_kernel, grid=(p.b * p.h, cdiv(rows, 64), cdiv(cols, 64)),
            params=dict(src_ptr=src, decay_ptr="ed", cu_ptr="cu_seqlens" if varlen else "ed",
                        num_heads=Scalar(p.h), rows=Scalar(rows),
                        cols=Scalar(cols), stride_decay=Scalar(p.ed.strides[0]),
                        **{f"stride_s{a}": Scalar(int(x), "i64" if abs(int(x)) >= 2 ** 31 else "i32")
                           for a, x in zip("bhr", info.strides[:3])},
                        dst_ptr=dst),
            writes=("dst_ptr",), constexprs=dict(BLOCK_R=64, BLOCK_C=64, TRANSPOSE=transpose,
                                                 DECAY=not transpose, VARLEN=varlen and not transpose),
            num_warps=4, num_stages=1))
        return ArrayInfo.contiguous(buffers[dst].shape, "float32")

    hist_t = None if kv_history is None else state_map("kv_history", kv_history, "kv_history_t", True)
    dkv_t = None if grad_kv is None else state_map("grad_kv", grad_kv, "grad_kv_t", True)
    # (result, q', k', v', history, reversed): names and infos
    passes = (("grad_q", ("grad_output", grad_output), ("v", p.v), ("k", p.k), ("kv_history_t", hist_t), False),
              ("grad_v", ("k", p.k), ("q", p.q), ("grad_output", grad_output), ("grad_kv", grad_kv), True),
              ("grad_k", ("v", p.v), ("grad_output", grad_output), ("q", p.q), ("grad_kv_t", dkv_t), True))
    for out, (qn, qi), (kn, ki), (vn, vi), (hn, hi), reverse in passes:
        bufs, launch = plan_pass(qi, ki, vi, hi, reverse, reverse and hi is not None)
        # the final state: "kv" (prefill kernels) or "states" (varlen kernel)
        names = {"q": qn, "k": kn, "v": vn, "kv_history": hn, "output": out, "kv": f"{out}_state",
                 "states": f"{out}_state", "seg_state": f"{out}_seg_state", "sync": f"{out}_sync"}
        for name, buf in bufs.items():
            buffers[names[name]] = buf
        launches.append(Launch(kernel=launch.kernel, grid=launch.grid,
                               params={n: names.get(x, x) if isinstance(x, str) else x
                                       for n, x in launch.params.items()},
                               writes=launch.writes, constexprs=launch.constexprs, num_warps=launch.num_warps,
                               num_stages=launch.num_stages))
    if kv_history is not None:  # d kv_history = lambda G_0
        state_map("grad_v_state", ArrayInfo.contiguous((p.b, p.h, p.d, p.e), "float32"), "grad_kv_history", False)
    return tuple(launches)


def _check_gradients(grad_output, out_shape, out_layout, dtype, kv, grad_kv, kv_shape, kv_layout):
    """The output gradient (q's dtype, unit innermost stride) and the returned
    states with their gradient (contiguous float32)."""
    check_shape("grad_output", grad_output, out_shape, out_layout)
    if grad_output.dtype != dtype:
        raise TypeError(f"grad_output: dtype {grad_output.dtype} differs from q's {dtype}")
    if grad_output.strides[-1] != 1:
        raise ValueError("grad_output: the innermost dimension must be contiguous")
    for name, info in (("kv", kv), ("grad_kv", grad_kv)):
        if info is None:
            continue
        check_shape(name, info, kv_shape, kv_layout)
        check_dtype(name, info, ("float32",))
        if tuple(info.strides) != row_major_strides(kv_shape):
            raise ValueError(f"{name}: must be contiguous (row-major), got strides {tuple(info.strides)}")


@dataclasses.dataclass(frozen=True)
class _Dims:
    b: int      # batch rows, or sequences
    h: int
    d: int
    e: int
    dtype: str
    decay_stride: int


def _launches(target, c, buffers, p: _Dims, strides: dict, walk: dict, chunks: int, kv_history,
              kv_shape, has_dkv: bool, final_only: bool, need_grad_ed: bool, varlen: bool) -> tuple:
    """The launches of both backward plans (adds their scratch to ``buffers``).
    strides: name -> (batch, head, token) strides of q, k, v and the output
    gradient "o"; walk: seq_len / block_len / num_chunks Scalars."""
    tile_d, tile_e = min(c.block_d, max(16, next_pow2(p.d))), min(c.block_e, max(16, next_pow2(p.e)))
    full_d, full_e = max(16, next_pow2(p.d)), max(16, next_pow2(p.e))
    n_dt, n_et = cdiv(p.d, tile_d), cdiv(p.e, tile_e)
    # NOTE: at most 4 warps below 64-wide tiles, whatever the config says: 8 gave
    # NaN in bf16 dv at D 20, E 12 on the H200 (_default_config)
    warps = c.num_warps if min(tile_d, tile_e) >= 64 else min(c.num_warps, 4)
    # NOTE: a launch writes buffers of its own in full (the JAX executor takes a
    # launch's outputs as written by it): scratch stands in for d kv_history
    # without a kv_history, for the dV launch's, and for the decay partials
    # without d ed
    buffers["decay_parts"] = Buffer((p.b * p.h, n_dt, 2), "float32")
    buffers["unused_grad_hist"] = Buffer((1,), "float32")
    buffers["unused_by_dv"] = Buffer((1,), "float32")
    # NOTE: bf16 inputs multiply in bf16 on the GPU (as the forward). Under the
    # interpreter the products are fp32: its bf16 products in these kernels came
    # out as garbage (1e10 for values of 0.3, 2026-11-24; the cause is not found),
    # while the forward's bf16 products there are right.
    dot_bf16 = p.dtype == "bfloat16" and target.backend != "interpreter"
    hist = kv_history.strides[:3] if kv_history is not None else (0, 0, 0)
    common = dict(
        q_ptr="q", k_ptr="k", v_ptr="v", do_ptr="grad_output", decay_ptr="ed",
        dkv_ptr="grad_kv" if has_dkv else "q", cu_ptr="cu_seqlens" if varlen else "q",
        num_heads=Scalar(p.h), head_k=Scalar(p.d), head_v=Scalar(p.e), **walk,
        num_states=Scalar(1 if final_only else kv_shape[2]), stride_decay=Scalar(p.decay_stride),
        **{f"stride_{n}{axis}": Scalar(int(x)) for n, st in strides.items() for axis, x in zip("bht", st)})
    consts = dict(BLOCK_T=c.block_t, CHUNKS=chunks, HAS_HIST=kv_history is not None, HAS_DKV=has_dkv,
                  FINAL_ONLY=final_only, DOT_BF16=dot_bf16, DOT_PRECISION=c.dot_precision, VARLEN=varlen)
    launches = [Launch(
        kernel=_lightning_bwd_dq_kernel, grid=(n_dt, p.b * p.h),
        params=dict(common, hist_ptr="kv_history" if kv_history is not None else "q",
                    stride_hb=Scalar(hist[0]), stride_hh=Scalar(hist[1]), stride_hd=Scalar(hist[2]),
                    dq_ptr="grad_q", part_ptr="decay_parts"),
        writes=("dq_ptr", "part_ptr"),
        constexprs=dict(consts, BLOCK_D=tile_d, BLOCK_E=full_e, NEED_DECAY=need_grad_ed),
        num_warps=warps, num_stages=c.num_stages)]
    for for_dk in (True, False):
        launches.append(Launch(
            kernel=_lightning_bwd_dkv_kernel, grid=(n_dt if for_dk else n_et, p.b * p.h),
            params=dict(common, grad_ptr="grad_k" if for_dk else "grad_v",
                        dhist_ptr="grad_kv_history" if for_dk and kv_history is not None else
                        "unused_grad_hist" if for_dk else "unused_by_dv"),
            writes=("grad_ptr", "dhist_ptr"),
            constexprs=dict(consts, BLOCK_D=tile_d if for_dk else full_d, BLOCK_E=full_e if for_dk else tile_e,
                            FOR_DK=for_dk),
            num_warps=warps, num_stages=c.num_stages))
    if need_grad_ed:
        launches.append(Launch(kernel=_lightning_bwd_decay_kernel, grid=(p.h,),
                               params=dict(part_ptr="decay_parts", batch=Scalar(p.b), num_heads=Scalar(p.h),
                                           num_parts=Scalar(n_dt), grad_ed_ptr="grad_ed"),
                               writes=("grad_ed_ptr",), constexprs={}, num_warps=1, num_stages=1))
    return tuple(launches)


VARLEN_BACKWARD_RESULTS = ("grad_q", "grad_k", "grad_v", "grad_ed", "grad_kv_history")


@memoize
def plan_lightning_attention_varlen_backward(
    target: Target, q: ArrayInfo, k: ArrayInfo, v: ArrayInfo, ed: ArrayInfo, cu_seqlens: ArrayInfo,
    kv: ArrayInfo, grad_output: ArrayInfo, grad_kv: ArrayInfo | None, kv_history: ArrayInfo | None = None,
    *, need_grad_ed: bool = True, config: LightningBackwardConfig | None = None, batch_invariant: bool = False,
) -> Plan:
    """Plan the backward of ``plan_lightning_attention_varlen``: sequence b
    starts from ``kv_history[b]`` ([B, H, D, E] float32, innermost dim
    contiguous; None: from zero) and ends in its final state ``kv[b]`` (a cache
    adapter gathers both through its slots).

    q, k, v, ed, cu_seqlens: the forward's (same validation); ``kv``: the final
    states [B, H, D, E] float32 contiguous; ``grad_output`` [T, H, E] in q's
    dtype, innermost dim contiguous; ``grad_kv``: the final states' gradient
    (kv's shape, contiguous float32) or None. Results: "grad_q", "grad_k"
    [T, H, D], "grad_v" [T, H, E] in q's dtype, contiguous; "grad_ed" [H]
    float32 (zeros unless ``need_grad_ed``); "grad_kv_history" [B, H, D, E]
    float32 (zeros without kv_history). Deterministic. The forms of the dense
    backward: with ed constant the varlen forward kernels run the three passes
    (_varlen_forward_passes), otherwise the scan kernels, one program per
    (sequence, head, tile). ``batch_invariant``: the forward kernels planned as
    plan_lightning_attention_varlen plans them with it."""
    from .varlen_plan import _validate as _validate_varlen
    check_config(config, (LightningBackwardConfig,))
    p = _validate_varlen(q, k, v, ed, cu_seqlens, None, None, 256)
    c = config or _default_config(p.dtype)
    states = (p.b, p.h, p.d, p.e)
    _check_gradients(grad_output, (p.t, p.h, p.e), "[T, H, E]", p.dtype, kv, grad_kv, states,
                     "[B, H, D, E], the forward's final states")
    if kv_history is not None:
        check_shape("kv_history", kv_history, states, "[B, H, D, E]")
        check_dtype("kv_history", kv_history, ("float32",))
        if kv_history.strides[-1] != 1:
            raise ValueError("kv_history: the innermost dimension must be contiguous")
    # an empty token axis still has work with a history: d kv_history = grad_kv
    empty = p.b == 0 or p.h == 0 or (p.t == 0 and kv_history is None)
    buffers = {"grad_q": Buffer((p.t, p.h, p.d), p.dtype, zero_init=empty),
               "grad_k": Buffer((p.t, p.h, p.d), p.dtype, zero_init=empty),
               "grad_v": Buffer((p.t, p.h, p.e), p.dtype, zero_init=empty),
               "grad_ed": Buffer((p.h,), "float32", zero_init=empty or not need_grad_ed),
               "grad_kv_history": Buffer(states, "float32", zero_init=empty or kv_history is None)}
    if empty:
        return Plan(buffers, (), VARLEN_BACKWARD_RESULTS)
    if config is None and not need_grad_ed:
        return Plan(buffers, _varlen_forward_passes(target, p, cu_seqlens, kv_history, grad_output, grad_kv,
                                                    buffers, bool(batch_invariant)), VARLEN_BACKWARD_RESULTS)
    # [T, H, *]: no batch stride; a program's sequence offset comes from cu_seqlens
    strides = {n: (0, info.strides[1], info.strides[0])
               for n, info in (("q", p.q), ("k", p.k), ("v", p.v), ("o", grad_output))}
    walk = dict(seq_len=Scalar(0), block_len=Scalar(c.block_t), num_chunks=Scalar(0))
    launches = _launches(target, c, buffers, _Dims(p.b, p.h, p.d, p.e, p.dtype, p.ed.strides[0]), strides,
                         walk, 1, kv_history, states, grad_kv is not None, True, need_grad_ed, varlen=True)
    return Plan(buffers, launches, VARLEN_BACKWARD_RESULTS)
