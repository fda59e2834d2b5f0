"""Validation and launch plan for lightning attention over packed sequences (framework-free).

``plan_lightning_attention_varlen``: B sequences packed along one token axis
(cu_seqlens, device data), each starting from a slot of a state cache (or from
zero) and ending in it (or in a returned [B, H, D, E]), in one launch of
varlen_kernels._lightning_varlen_kernel whatever the lengths: validate ->
problem -> config (:class:`LightningVarlenConfig`) -> launch.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .._plan import (FLOAT_DTYPES, INT_DTYPES, ArrayInfo, Buffer, Launch, Plan, Scalar, cdiv,
                     check_config, check_dtype, check_inner_contiguous, check_ndim, check_shape,
                     config_class, memoize, next_pow2, row_major_strides)
from .._target import Target
from .prefill_plan import (BLOCK_E, BLOCK_T, DEFAULT_DOT_PRECISION, DOT_PRECISIONS, GLUON_BE, GLUON_STAGES,
                   GLUON_STAGES_MANY, GLUON_T, GLUON_TF32_WS_REGS, MIN_SEGMENT_CHUNKS, NUM_STAGES,
                   NUM_WARPS, SEGMENT_WAVES, _aligned, _check_decay, _check_head, _full_wave,
                   gluon_scope_unfit)
from .varlen_kernels import _lightning_varlen_kernel


@config_class
class LightningVarlenConfig:
    """The varlen kernel (varlen_kernels._lightning_varlen_kernel). None fields are
    the planner's choice. block_t: tokens per chunk; block_e: E-tile (state columns
    per program); segment_len: tokens per work item (the packed token axis is cut
    at its multiples; 0: never cut a sequence, one program per sequence, head and
    E-tile); dot_precision: the products' input precision on the GPU (as
    LightningTritonConfig's)."""
    block_t: int | None = None
    block_e: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    segment_len: int | None = None
    dot_precision: str = DEFAULT_DOT_PRECISION

    def __post_init__(self):
        if self.dot_precision not in DOT_PRECISIONS:
            raise ValueError(f"dot_precision: expected one of {DOT_PRECISIONS}, got {self.dot_precision!r}")
        if self.segment_len is not None and (isinstance(self.segment_len, bool) or self.segment_len < 0):
            raise ValueError(f"segment_len: expected an int >= 0 (0: no split), got {self.segment_len!r}")


@config_class
class LightningVarlenGluonConfig:
    """The Gluon varlen kernels (gluon_kernels._gluon_varlen_kernel, bf16, and
    _gluon_varlen_tf32_kernel, fp32 with tf32 products): one program per
    (sequence, head, 64-column E-tile), sequences never cut; passing one forces
    them (ValueError where they do not apply). None fields are the planner's
    choice. stages: load ring depth (fp32 needs 2); longest_first: programs
    take the sequences longest first (at most LONGEST_FIRST_MAX sequences)."""
    stages: int | None = None
    longest_first: bool | None = None


@dataclasses.dataclass(frozen=True)
class _Varlen:
    q: ArrayInfo
    k: ArrayInfo
    v: ArrayInfo
    ed: ArrayInfo  # as [H]
    kv_cache: ArrayInfo | None
    t: int
    h: int
    d: int
    e: int
    b: int
    dtype: str
    offs_32: bool  # token-row offsets within one sequence's head slice fit in int32

    @property
    def block_d(self) -> int:
        return max(16, next_pow2(self.d))

    @property
    def has_cache(self) -> bool:
        return self.kv_cache is not None

    @property
    def results(self) -> tuple:
        return ("output", "kv_cache" if self.has_cache else "states")

    def buffers(self, items: int = 0, per_item: int = 0, segmented: bool = False,
                launched: bool | None = None) -> dict:
        """output, the final states (without a cache) and, when segmented, the
        published item end states [items, H, D, E] and the ticket counter + one
        ready flag per program (zeroed). launched: whether a launch writes the
        states (default: when there are items)."""
        out = {"output": Buffer((self.t, self.h, self.e), self.dtype)}
        if not self.has_cache:  # zeroed only for a plan without launches (T = 0)
            launched = bool(items) if launched is None else launched
            out["states"] = Buffer((self.b, self.h, self.d, self.e), "float32", zero_init=not launched)
        if items:
            out["seg_state"] = Buffer((items, self.h, self.d, self.e) if segmented else (1,), "float32",
                                      placeholder=not segmented)
            out["sync"] = Buffer((1 + items * per_item,) if segmented else (1,), "int32", zero_init=segmented,
                                 placeholder=not segmented)
        return out


@memoize
def plan_lightning_attention_varlen(
    target: Target, q: ArrayInfo, k: ArrayInfo, v: ArrayInfo, ed: ArrayInfo, cu_seqlens: ArrayInfo,
    kv_cache: ArrayInfo | None = None, slot_idx: ArrayInfo | None = None, *, block_size: int = 256,
    config: LightningVarlenConfig | None = None, batch_invariant: bool = False,
) -> Plan:
    """Plan lightning attention over B sequences packed along the token axis.

    Arrays: q, k [T, H, D], v [T, H, E] (one float dtype, innermost dim
    contiguous, other strides free), ed [H], [H, 1, 1] or [1, H, 1, 1] fp32,
    cu_seqlens [B + 1] int32/int64 (device data: cu_seqlens[0] = 0,
    non-decreasing, cu_seqlens[B] = T; checked by check_varlen_host_data where
    it is host data), kv_cache [num_slots, H, D, E] fp32 (innermost dim
    contiguous; read and written in place: an argument and a result) with
    slot_idx [B] int32/int64, or both None.
    Results: "output" [T, H, E] (q's dtype) and "kv_cache" (updated at the named
    slots, every other element untouched) or "states" [B, H, D, E] fp32 (each
    sequence's final state). block_size is validated and otherwise unused: only
    final states are returned.

    Kernels: the Gluon varlen kernels where they apply (_gluon_varlen_unfit)
    and the sequences fill the GPU without cuts, else the Triton kernel.
    ``config``: a LightningVarlenConfig forces the Triton kernel (and overrides
    its tiling and segmentation), a LightningVarlenGluonConfig the Gluon ones.
    ``batch_invariant``: each sequence's result independent of the other
    sequences and heads of the call and of the GPU's size (no cut sequences;
    the Gluon kernels wherever they apply; see INVARIANT_NOTE).
    """
    check_config(config, (LightningVarlenConfig, LightningVarlenGluonConfig))
    p = _validate(q, k, v, ed, cu_seqlens, kv_cache, slot_idx, block_size)
    if p.b == 0 or p.h == 0 or p.t == 0:  # nothing to compute: states are zero or the cache's
        return Plan(p.buffers(), (), p.results)
    if _use_gluon(target, p, config, batch_invariant):
        return _gluon_launch(p, _gluon_config(target, p, config))
    c = _config(target, p, config, batch_invariant)
    return _launch(target, p, c)


def varlen_config(target: Target, q: ArrayInfo, k: ArrayInfo, v: ArrayInfo, ed: ArrayInfo,
                  cu_seqlens: ArrayInfo, kv_cache: ArrayInfo | None = None,
                  slot_idx: ArrayInfo | None = None, *, block_size: int = 256, config=None,
                  batch_invariant: bool = False):
    """The Triton config (segment length, tiles) :func:`plan_lightning_attention_varlen`
    chooses for these arrays: ``config`` completed, or the measured default. The
    JAX adapter's vmap pins it, so that a folded launch does the per-example
    arithmetic."""
    p = _validate(q, k, v, ed, cu_seqlens, kv_cache, slot_idx, block_size)
    return _config(target, p, config, batch_invariant)


def _validate(q, k, v, ed, cu_seqlens, kv_cache, slot_idx, block_size) -> _Varlen:
    check_ndim("q", q, 3, "[T, H, D]")
    check_dtype("q", q, FLOAT_DTYPES)
    t, h, d = q.shape
    check_shape("k", k, (t, h, d), "same as q")
    check_ndim("v", v, 3, "[T, H, E]")
    e = v.shape[2]
    check_shape("v", v, (t, h, e), "[T, H, E] with q's T, H")
    for name, info in (("k", k), ("v", v)):
        if info.dtype != q.dtype:
            raise TypeError(f"{name}: dtype {info.dtype} differs from q's {q.dtype}")
    for name, info in (("q", q), ("k", k), ("v", v)):
        check_inner_contiguous(name, info)
    _check_head("q", d)
    _check_head("v", e)
    ed = _check_decay("ed", ed, h)
    check_ndim("cu_seqlens", cu_seqlens, 1, "[B + 1]")
    check_dtype("cu_seqlens", cu_seqlens, INT_DTYPES)
    check_inner_contiguous("cu_seqlens", cu_seqlens)  # read with unit stride
    if cu_seqlens.shape[0] < 1:
        raise ValueError("cu_seqlens: expected shape [B + 1] (at least [0]), got an empty array")
    b = cu_seqlens.shape[0] - 1
    if b == 0 and t:
        raise ValueError(f"cu_seqlens: shape (1,) holds no sequence, but q has T = {t} tokens")
    if (kv_cache is None) != (slot_idx is None):
        missing, given = ("slot_idx", "kv_cache") if slot_idx is None else ("kv_cache", "slot_idx")
        raise ValueError(f"{missing}: required with {given} (pass both or neither)")
    if kv_cache is not None:
        check_ndim("kv_cache", kv_cache, 4, "[num_slots, H, D, E]")
        check_shape("kv_cache", kv_cache, (kv_cache.shape[0], h, d, e), "[num_slots, H, D, E]")
        check_dtype("kv_cache", kv_cache, ("float32",))
        check_inner_contiguous("kv_cache", kv_cache)
        check_ndim("slot_idx", slot_idx, 1, "[B]")
        check_shape("slot_idx", slot_idx, (b,), "[B], one slot per sequence")
        check_dtype("slot_idx", slot_idx, INT_DTYPES)
        check_inner_contiguous("slot_idx", slot_idx)
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) or block_size < 1:
        raise ValueError(f"block_size: expected a positive int, got {block_size!r}")
    if t >= 2 ** 31:
        raise ValueError(f"q: T = {t} tokens; at most 2**31 - 1")
    # token-row offsets within one sequence (at most T rows) fit in int32
    offs_32 = max(max(t - 1, 0) * abs(x.strides[0]) + x.shape[2] for x in (q, k, v)) < 2 ** 31 \
        and t * h * e < 2 ** 31
    return _Varlen(q, k, v, ed, kv_cache, t, h, d, e, b, q.dtype, bool(offs_32))


# NOTE (not measured yet; the GPU benchmark benchmarks/bench_lightning_varlen.py
# sweeps segment_len): work items are sized like the prefill's chained-scan
# segments (prefill_plan.py: SEGMENT_WAVES, MIN_SEGMENT_CHUNKS, _full_wave). With one
# program per (sequence, head, E-tile) already SEGMENT_WAVES full waves, no
# sequence is cut: a cut item re-reads its k and v (phase 1), and with that
# many programs in flight the re-reads miss L2 (B=16, H=64 holds ~130 MB of k
# and v between the two phases), so cutting costs up to half the k/v traffic
# again. Below that, the packed axis is cut so that about SEGMENT_WAVES full
# waves of programs run, in items of at least MIN_SEGMENT_CHUNKS chunks.
def _segment_len(target: Target, p: _Varlen, per_item: int, block_t: int) -> int:
    """Tokens per work item, 0 for no cut (see the NOTE above)."""
    extra = cdiv(SEGMENT_WAVES * _full_wave(target), per_item) - p.b
    if extra <= 0:
        return 0
    # at most T / extra tokens, whole chunks: at least `extra` cuts
    return max(MIN_SEGMENT_CHUNKS, p.t // extra // block_t) * block_t


# NOTE (INVARIANT_NOTE): batch_invariant=True. Items are cut at multiples of
# segment_len along the packed token axis, so where a sequence is cut depends on
# the sequences packed before it, and the default segment_len and kernel on B,
# H, T and the SM count. Invariant plans cut no sequence (one program per
# sequence, head and E-tile, from the sequence's first token: the chunks are the
# sequence's own) and take the Gluon kernels wherever they apply (their scope
# depends on the packed axis only beyond 2**31 output elements), else the
# Triton kernel with E-tiles from the dtype and sizes. The price: a batch of few
# long sequences with few heads fills only part of the GPU (the prefill's
# invariant plans cut rows; the varlen kernels could cut at fixed offsets from
# each sequence's start, which they do not do yet).
def _config(target: Target, p: _Varlen, override, invariant: bool = False) -> LightningVarlenConfig:
    """The config from the prefill's tables (prefill_plan.py), ``override``'s fields
    first (``invariant``: INVARIANT_NOTE)."""
    o = override or LightningVarlenConfig()
    block_e, small_d = o.block_e, p.block_d <= 128
    if (block_e is None and not invariant and p.dtype == "bfloat16" and p.d == p.block_d <= 128
            and p.e % 64 == 0 and p.b * p.h * (p.e // 64) >= _full_wave(target)):
        block_e = 64  # the prefill's rule (prefill_plan._triton_config): enough (b, h) pairs for E-tile 64
    block_e = block_e or min(BLOCK_E[p.dtype] if small_d else 32, max(16, next_pow2(p.e)))
    block_t = o.block_t or (BLOCK_T[p.dtype] if small_d else 32)
    per_item = p.h * cdiv(p.e, block_e)
    seg = o.segment_len if o.segment_len is not None else (
        0 if invariant else _segment_len(target, p, per_item, block_t))
    return LightningVarlenConfig(block_t, block_e, o.num_warps or NUM_WARPS[p.dtype],
                                 o.num_stages or NUM_STAGES[p.dtype], seg, o.dot_precision)


def _sequence_params(p: _Varlen, history: str | None = None) -> dict:
    """The launch parameters both varlen kernels share: tokens, decay, the
    sequences and the cache, or the buffer named ``history`` for the Triton
    kernel's HIST_BY_SEQ (dummies when absent, never read)."""
    return dict(q_ptr="q", k_ptr="k", v_ptr="v", decay_ptr="ed", cu_ptr="cu_seqlens",
                slot_ptr="slot_idx" if p.has_cache else "cu_seqlens",
                cache_in_ptr="kv_cache" if p.has_cache else history or "ed",
                num_heads=Scalar(p.h), num_seqs=Scalar(p.b),
                num_slots=Scalar(p.kv_cache.shape[0] if p.has_cache else 0))


def _launch(target: Target, p: _Varlen, c: LightningVarlenConfig, history: bool = False,
            reverse: bool = False, hist_shift: bool = False) -> Plan:
    """The Triton kernel's plan. For the backward (backward_plan.py), without a
    cache: ``history`` starts sequence b from buffer "kv_history"[b] ([B, H, D, E]
    contiguous float32); ``reverse`` and ``hist_shift`` are the kernel's REVERSE
    and HIST_SHIFT."""
    n_e = cdiv(p.e, c.block_e)
    per_item = p.h * n_e
    # a cut only matters where some sequence can span a multiple of segment_len
    segmented = 0 < c.segment_len < p.t
    items = p.t // c.segment_len + p.b if segmented else p.b
    state = p.kv_cache.strides[:3] if p.has_cache else row_major_strides((p.b, p.h, p.d, p.e))[:3]
    pub = row_major_strides((items, p.h, p.d, p.e))[:3] if segmented else (0, 0, 0)
    even_d, even_e = p.d == p.block_d, p.e % c.block_e == 0
    # as the prefill (prefill_plan._triton_launch): bf16 operands only for whole tiles
    dot_bf16 = p.dtype == "bfloat16" and even_d and even_e
    launch = Launch(
        kernel=_lightning_varlen_kernel, grid=(items * per_item,),
        params=dict(
            **_sequence_params(p, "kv_history" if history else None),
            head_k=Scalar(p.d), head_v=Scalar(p.e), seg_len=Scalar(c.segment_len if segmented else 0),
            search_steps=Scalar(p.b.bit_length()), stride_decay=Scalar(p.ed.strides[0]),
            **_aligned("stride_qt stride_qh", p.q.strides[:2]),
            **_aligned("stride_kt stride_kh", p.k.strides[:2]),
            **_aligned("stride_vt stride_vh", p.v.strides[:2]),
            **_aligned("stride_ot stride_oh", (p.h * p.e, p.e)),
            **_aligned("stride_cs stride_ch stride_cd", state),
            **_aligned("stride_pw stride_ph stride_pd", pub),
            o_ptr="output", state_ptr="kv_cache" if p.has_cache else "states",
            pub_ptr="seg_state", sync_ptr="sync"),
        writes=("o_ptr", "state_ptr", "pub_ptr", "sync_ptr"),
        constexprs=dict(
            BLOCK_T=c.block_t, BLOCK_D=p.block_d, BLOCK_E=c.block_e, N_E=n_e, EVEN_D=even_d,
            EVEN_E=even_e, HAS_CACHE=p.has_cache, SEGMENTED=segmented, DOT_BF16=dot_bf16,
            DOT_PRECISION=c.dot_precision, OFFS_64=not p.offs_32,
            P1_T=2 * c.block_t if dot_bf16 else c.block_t, P1_STAGES=2,
            # as the prefill: the state product from bf16 hi/lo pairs for fp32/fp16
            # whole tiles on the GPU (never under the interpreter, whose bf16 dot is broken)
            SPLIT_STATE=(not dot_bf16 and even_d and even_e and c.dot_precision == "tf32"
                         and not target.interpret),
            HIST_BY_SEQ=history, REVERSE=reverse, HIST_SHIFT=hist_shift),
        num_warps=c.num_warps, num_stages=c.num_stages)
    return Plan(p.buffers(items, per_item, segmented), (launch,), p.results)


# ---------------------------------------------------------------- Gluon varlen kernels
# NOTE (2026-11-24, not yet measured when written; see benchmarks/RESULTS.md for
# the measurement): the Triton varlen kernel runs the Triton prefill's chunk
# step, which is latency-bound on Hopper (prefill_plan.py's Gluon NOTE: 108.9 vs 87.0 us
# for the single-sequence bf16 prefill, 421.7 vs 194.9 us fp32). The Gluon
# varlen kernels run the Gluon prefill's chunk loops per sequence; only the
# last chunk of a sequence may be partial (masked loads and stores, its own
# decays). They do not cut sequences: where cuts are wanted (few sequences and
# heads) the Triton kernel's chained scan runs.
# Longest first: one sequence's programs (H x E-tiles, 128 at H 64) spread
# over the whole GPU, so a long sequence whose programs start last ends last.
# In the issue-22 batch (16 sequences of 256-8192 tokens) the second 8192-token
# sequence is the 15th: in index order its programs start after ~78% of the
# work and end ~10% after the rest. Programs taking sequences longest first
# start the long ones at once and end on short ones.
LONGEST_FIRST_MAX = 64


def _gluon_unfit(target: Target, p: _Varlen) -> str | None:
    """Why the Gluon varlen kernels do not apply to ``p`` on ``target`` (None: they do)."""
    rows = [x.strides[i] for x in (p.q, p.k, p.v) for i in (0, 1)]  # token and head rows
    unfit = gluon_scope_unfit(target, p.dtype, p.d, p.e, rows)
    if unfit:
        return unfit
    if not p.offs_32:
        return "token offsets beyond int32"
    return None


def _use_gluon(target: Target, p: _Varlen, config, invariant: bool = False) -> bool:
    """The Gluon kernels where they apply and no sequence needs cutting (or
    ``invariant``: wherever they apply), unless ``config`` picks the kernel."""
    if isinstance(config, LightningVarlenConfig):
        return False
    unfit = _gluon_unfit(target, p)
    if isinstance(config, LightningVarlenGluonConfig):
        if unfit:
            raise ValueError(f"config: LightningVarlenGluonConfig does not apply here: {unfit}")
        return True
    return unfit is None and (invariant or _segment_len(target, p, p.h * (p.e // GLUON_BE), GLUON_T) == 0)


def _gluon_config(target: Target, p: _Varlen, override) -> LightningVarlenGluonConfig:
    o = override or LightningVarlenGluonConfig()
    programs = p.b * p.h * (p.e // GLUON_BE)
    stages = o.stages or (GLUON_STAGES_MANY if programs > target.num_sms else GLUON_STAGES)[p.dtype]
    if p.dtype == "float32" and stages != 2:
        raise ValueError(f"config: stages={stages}; the fp32 Gluon kernel keeps a 2-deep load ring")
    if stages < 2:
        raise ValueError(f"config: stages={stages}; at least 2")
    longest = o.longest_first if o.longest_first is not None else 1 < p.b <= LONGEST_FIRST_MAX
    if longest and p.b > LONGEST_FIRST_MAX:
        raise ValueError(f"config: longest_first for {p.b} sequences (at most {LONGEST_FIRST_MAX})")
    return LightningVarlenGluonConfig(stages, bool(longest))


def _gluon_launch(p: _Varlen, c: LightningVarlenGluonConfig, history: bool = False, reverse: bool = False,
                  hist_shift: bool = False) -> Plan:
    """The Gluon kernels' plan; ``history``, ``reverse``, ``hist_shift``: as _launch's."""
    from .gluon_kernels import _gluon_varlen_kernel, _gluon_varlen_tf32_kernel
    fp32 = p.dtype == "float32"
    per_seq = p.h * (p.e // GLUON_BE)
    state = p.kv_cache.strides[:3] if p.has_cache else (0, 0, p.e)
    launch = Launch(
        kernel=_gluon_varlen_tf32_kernel if fp32 else _gluon_varlen_kernel, grid=(p.b * per_seq,),
        params=dict(
            **_sequence_params(p, "kv_history" if history else None),
            stride_decay=Scalar(p.ed.strides[0]),
            **_aligned("stride_qh stride_kh stride_vh", (p.q.strides[1], p.k.strides[1], p.v.strides[1])),
            **_aligned("stride_cs stride_ch", state[:2]),
            o_ptr="output", state_ptr="kv_cache" if p.has_cache else "states"),
        writes=("o_ptr", "state_ptr"),
        constexprs=dict(T=GLUON_T, D=p.d, E=p.e, BE=GLUON_BE, STAGES=c.stages, HAS_CACHE=p.has_cache,
                        ORDER_B=next_pow2(p.b) if c.longest_first else 0,
                        STRIDE_QT=p.q.strides[0], STRIDE_KT=p.k.strides[0], STRIDE_VT=p.v.strides[0],
                        STRIDE_OT=p.h * p.e, STRIDE_CD=state[2], HIST_BY_SEQ=history, REVERSE=reverse,
                        HIST_SHIFT=hist_shift, **(dict(WS_REGS=GLUON_TF32_WS_REGS) if fp32 else {})),
        # fp32: 4 warps compile the kernel; its worker partition adds 4 more at launch
        num_warps=4, num_stages=1)
    return Plan(p.buffers(launched=True), (launch,), p.results)


def varlen_work_items(plan: Plan) -> int:
    """The number of work items of a varlen plan (its grid over programs per item)."""
    if not plan.launches:
        return 0
    launch = plan.launches[0]
    if "N_E" not in launch.constexprs:  # the Gluon kernels: one item per sequence
        return launch.params["num_seqs"].value
    return launch.grid[0] // (launch.params["num_heads"].value * launch.constexprs["N_E"])


def check_varlen_host_data(cu_seqlens, num_tokens: int, slot_idx=None, num_slots: int = 0) -> None:
    """Checks of index data that is already on the host (costs no device sync;
    None: not host data, unchecked): cu_seqlens starts at 0, never decreases and
    ends at ``num_tokens`` (q's T); slot ids are -1 or in [0, num_slots), and no non-negative id appears twice
    (two sequences would write one slot). On the device none of this is checked:
    invalid cu_seqlens or duplicate slots are undefined behaviour; an id outside
    [-1, num_slots) gives that sequence NaN outputs and touches no slot."""
    cu = np.asarray(cu_seqlens if cu_seqlens is not None else [0, num_tokens]).astype(np.int64)
    if cu.size and cu[0] != 0:
        raise ValueError(f"cu_seqlens: cu_seqlens[0] must be 0, got {int(cu[0])}")
    steps = np.diff(cu)
    if (steps < 0).any():
        i = int(np.argmax(steps < 0))
        raise ValueError(f"cu_seqlens: must be non-decreasing, got {int(cu[i])} then {int(cu[i + 1])} "
                         f"at index {i}")
    if cu.size and cu[-1] != num_tokens:
        raise ValueError(f"cu_seqlens: cu_seqlens[-1] = {int(cu[-1])} does not match the T = "
                         f"{num_tokens} tokens of q")
    if slot_idx is None:
        return
    ids = np.asarray(slot_idx).astype(np.int64)
    bad = ids[(ids < -1) | (ids >= num_slots)]
    if bad.size:
        raise ValueError(f"slot_idx: ids must be -1 or in [0, {num_slots}), got {bad[:4].tolist()}")
    used = ids[ids >= 0]
    uniq, counts = np.unique(used, return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"slot_idx: duplicate slot ids {uniq[counts > 1][:4].tolist()} "
                         "(two sequences would write one slot)")
