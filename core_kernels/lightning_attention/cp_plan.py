"""Plans of context-parallel lightning attention (framework-free): the two
steps around the adapters' collective (cp_kernels.py has the math).

With q, k, v split along the sequence into R shards of L tokens, device r:

1. ``plan_lightning_cp_state``: its shard's end state from zero,
   C(r) = sum_i lambda^(L-1-i) k_i^T v_i [B, H, D, E] (reads k and v once);
2. all-gathers C over the R devices (the adapter: XLA's all_gather, or
   torch.distributed.all_gather_into_tensor), [R, B, H, D, E];
3. ``plan_lightning_cp_compose``: its starting state S_in(r) (the scan of the
   C(j < r) from kv_history) and the final state S_in(R) (the same on every
   device);
4. the ordinary prefill of its shard from S_in(r) (plan_lightning_attention
   with kv_history = S_in(r), output_final_state_only): its outputs are those
   of the whole sequence.

The backward mirrors it: step 1 with ``reverse=True`` on (q, dO) gives the
gradient that shard r's outputs send to S_in(r), G_own(r) =
sum_i lambda^(i+1) q_i^T dO_i; step 3 with ``reverse=True`` scans the gathered
G_own from the final state's gradient down to the gradient of shard r's end
state (``prefix``) and of kv_history (``total``); the ordinary backward of the
shard from S_in(r), with that end-state gradient, gives dq, dk, dv and the
shard's part of d ed (summed over the devices by the adapter).

NOTE: why these two passes and not "prefill from zero, then correct the
outputs" (o_t += lambda^(i+1) q_t S_in(r)): that correction reads q and o and
writes o again (3 arrays of the shard), where step 1 reads k and v (2); and
the prefill from S_in(r) gives outputs and end state in the kernels' own
rounding, with no extra pass in the backward either.

NOTE: measured on two H200s (nvidia-h200-x2), 2026-11-28, kernels of 545e0aa, B=1,
H=64, D=E=128, final state, one-GPU call vs the two-GPU split in the same process
(benchmarks/results/2026-11-28-lightning-cp/; JAX jit over a NamedSharding of N,
torch lightning_attention_cp over NCCL), speed-up and max error relative to the
one-GPU output's largest value:
- N=65536 forward: fp32 3156 -> 2859 us (1.10x JAX, 1.10x torch), bf16 1284 -> 1102 us
  (1.17x JAX; torch 1.29x); forward + backward: fp32 12637 -> 9003 us (1.40x JAX,
  1.45x torch), bf16 5922 -> 3761 us (1.57x JAX, 1.48x torch). Error 9e-4 (fp32: the
  GPU's fp32 products are tf32), 5e-3 (bf16 gradients); every result bit-identical
  run to run; the output stays sharded.
- N=4096: slower on two GPUs (forward 0.28-0.74x, forward + backward 0.44-1.0x): each
  shard's 2048 tokens are ~100 us of kernels, below the collective's and the extra
  launches' latency.
The bound: per device the shard-state pass (bf16 285 us, fp32 1105 us at N=32768)
plus the shard's prefill (727 / 1554 us) against the one-GPU prefill (1284 / 3156 us):
at most 1.27x / 1.19x for the forward with this scheme (any scheme that must know
S_in(r) before its outputs reads the earlier shards' k and v once more, or corrects
the outputs at 3 arrays' traffic), while forward + backward (the backward is about
three prefills) reaches 1.4-1.6x. The jit path's backward computes the shard states
again (~ one more shard-state pass); lightning_attention_cp inside shard_map keeps them.
"""
from __future__ import annotations

import dataclasses

from .._plan import (FLOAT_DTYPES, ArrayInfo, Buffer, Launch, Plan, Scalar, as_int, cdiv, check_config,
                     check_dtype, check_inner_contiguous, check_ndim, check_shape, config_class, memoize,
                     next_pow2, row_major_strides)
from .._target import Target
from .cp_kernels import _lightning_cp_partial_kernel, _lightning_cp_scan_kernel
from .prefill_plan import DEFAULT_DOT_PRECISION, DOT_PRECISIONS, MAX_HEAD_SIZE, _aligned, _check_decay


@config_class
class LightningCPConfig:
    """The shard-state kernel (cp_kernels._lightning_cp_partial_kernel); None
    fields are the planner's choice. block_t: tokens per step; block_e: E-tile;
    num_splits: programs along the sequence per (b, h, E-tile), whose partial
    states a second launch sums in order; dot_precision as LightningTritonConfig's;
    split_state: fp32/fp16 inputs with "tf32" on the GPU multiply k^T v as bf16
    hi/lo pairs (as the prefill kernel) instead of one tf32 product."""
    block_t: int | None = None
    block_e: int | None = None
    num_splits: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    dot_precision: str = DEFAULT_DOT_PRECISION
    split_state: bool = True

    def __post_init__(self):
        if self.dot_precision not in DOT_PRECISIONS:
            raise ValueError(f"dot_precision: expected one of {DOT_PRECISIONS}, got {self.dot_precision!r}")
        for name in ("block_t", "block_e"):
            value = getattr(self, name)
            if value is not None and (value < 16 or value & (value - 1)):
                raise ValueError(f"config: {name} must be a power of two >= 16, got {value}")


# NOTE: the shard-state kernel alone, H200 (nvidia-h200-x2), 2026-11-28, kernels of
# 545e0aa, B=1, H=64, N=32768 (one shard of N=65536 on two GPUs), D=E=128, 8 warps,
# splits for ~4 programs per SM (benchmarks/experiments/exp_lightning_cp.py sweep;
# benchmarks/results/2026-11-28-lightning-cp/sweep.json), (block_t, block_e, stages):
# bf16 (32, 64, 3) 333 us, (64, 64, 3) 285 us (3.77 TB/s of k and v), (64, 128, 2)
# 352 us, (128, 64, 2) 329 us; fp32 (bf16 hi/lo state product) (32, 64, 3) 1231 us,
# (64, 64, 3) 1195 us, (64, 128, 2) 1105 us (1.94 TB/s: bound by the split products'
# conversions, not by memory). The prefill of the same shard from a starting state: bf16
# 727 us, fp32 1554 us. fp16 (the fp32 path's products) was not measured: fp32's choice.
BLOCK_T = {"bfloat16": 64, "float16": 64, "float32": 64}
BLOCK_E = {"bfloat16": 64, "float16": 128, "float32": 128}
NUM_WARPS = 8
NUM_STAGES = {"bfloat16": 3, "float16": 2, "float32": 2}
# programs per SM the splits aim at (several: each program is one stream of loads)
PROGRAMS_PER_SM = 4
SCAN_BLOCK = 1024  # elements of the [D, E] states per scan program


@dataclasses.dataclass(frozen=True)
class _State:
    k: ArrayInfo
    v: ArrayInfo
    ed: ArrayInfo
    b: int
    h: int
    n: int
    d: int
    e: int
    dtype: str


def _validate_state(k, v, ed) -> _State:
    check_ndim("k", k, 4, "[B, H, N, D]")
    check_dtype("k", k, FLOAT_DTYPES)
    b, h, n, d = k.shape
    check_ndim("v", v, 4, "[B, H, N, E]")
    check_shape("v", v, (b, h, n, v.shape[3]), "[B, H, N, E] with k's B, H, N")
    if v.dtype != k.dtype:
        raise TypeError(f"v: dtype {v.dtype} differs from k's {k.dtype}")
    e = v.shape[3]
    for name, size in (("k", d), ("v", e)):
        if not 1 <= size <= MAX_HEAD_SIZE:
            raise ValueError(f"{name}: head size {size} is not in [1, {MAX_HEAD_SIZE}]")
    if n < 1:
        raise ValueError(f"k: the sequence length N must be >= 1, got shape {tuple(k.shape)}")
    check_inner_contiguous("k", k)
    check_inner_contiguous("v", v)
    return _State(k, v, _check_decay("ed", ed, h), b, h, n, d, e, k.dtype)


def _state_config(target: Target, p: _State, override) -> LightningCPConfig:
    o = override or LightningCPConfig()
    block_t = o.block_t or min(BLOCK_T[p.dtype], max(16, next_pow2(p.n)))
    block_e = o.block_e or min(BLOCK_E[p.dtype], max(16, next_pow2(p.e)))
    programs = p.b * p.h * cdiv(p.e, block_e)
    splits = o.num_splits or cdiv(PROGRAMS_PER_SM * target.num_sms, max(1, programs))
    splits = max(1, min(splits, cdiv(p.n, block_t)))
    return LightningCPConfig(block_t, block_e, splits, o.num_warps or NUM_WARPS,
                             o.num_stages or NUM_STAGES[p.dtype], o.dot_precision, o.split_state)


STATE_RESULTS = ("state",)


@memoize
def plan_lightning_cp_state(target: Target, k: ArrayInfo, v: ArrayInfo, ed: ArrayInfo, *,
                            reverse: bool = False, config: LightningCPConfig | None = None) -> Plan:
    """A shard's state sum. k [B, H, N, D], v [B, H, N, E] (one float dtype,
    innermost dim contiguous), ed [H], [H, 1, 1] or [1, H, 1, 1] fp32. Result
    "state" [B, H, D, E] fp32: sum_i lambda^(N-1-i) k_i^T v_i (the end state of
    the shard from zero), or with ``reverse`` sum_i lambda^(i+1) k_i^T v_i (with
    k = q and v = dO: the gradient of the shard's starting state from its outputs).
    Deterministic: the splits' partial sums are added in order."""
    check_config(config, (LightningCPConfig,))
    p = _validate_state(k, v, ed)
    reverse = bool(reverse)
    state = Buffer((p.b, p.h, p.d, p.e), "float32")
    if p.b == 0 or p.h == 0:
        return Plan({"state": Buffer(state.shape, "float32", zero_init=True)}, (), STATE_RESULTS)
    c = _state_config(target, p, config)
    split_len = cdiv(cdiv(p.n, c.num_splits), c.block_t) * c.block_t
    splits = cdiv(p.n, split_len)
    block_d = max(16, next_pow2(p.d))
    n_e = cdiv(p.e, c.block_e)
    even_d, even_e = p.d == block_d, p.e % c.block_e == 0
    dot_bf16 = p.dtype == "bfloat16" and even_d and even_e
    part_shape = (p.b, p.h, splits, p.d, p.e)
    offs_32 = max((p.n - 1) * p.k.strides[2] + p.d, (p.n - 1) * p.v.strides[2] + p.e) < 2 ** 31
    partial = Launch(
        kernel=_lightning_cp_partial_kernel, grid=(splits * p.b * p.h * n_e,),
        params=dict(
            k_ptr="k", v_ptr="v", decay_ptr="ed",
            num_heads=Scalar(p.h), num_rows=Scalar(p.b), seq_len=Scalar(p.n), head_k=Scalar(p.d),
            head_v=Scalar(p.e), split_len=Scalar(split_len), stride_decay=Scalar(p.ed.strides[0]),
            **_aligned("stride_kb stride_kh stride_kt", p.k.strides[:3]),
            **_aligned("stride_vb stride_vh stride_vt", p.v.strides[:3]),
            **_aligned("stride_pb stride_ph stride_pp stride_pd", row_major_strides(part_shape)[:4]),
            part_ptr="part"),
        writes=("part_ptr",),
        constexprs=dict(BLOCK_D=block_d, BLOCK_E=c.block_e, N_E=n_e, BLOCK_T=c.block_t, STAGES=c.num_stages,
                        EVEN_D=even_d, EVEN_E=even_e, DOT_BF16=dot_bf16,
                        # the prefill kernel's state product (prefill_plan.py's SPLIT_STATE)
                        SPLIT_STATE=(not dot_bf16 and even_d and even_e and c.dot_precision == "tf32"
                                     and c.split_state and not target.interpret),
                        DOT_PRECISION=c.dot_precision, OFFS_64=not offs_32, REVERSE=reverse),
        num_warps=c.num_warps, num_stages=1)
    size = p.d * p.e
    combine = _scan_launch(target, "part", "ed", None, None, p.ed.strides[0], rows=p.b * p.h, heads=p.h,
                           steps=splits, step_len=split_len, last_len=p.n - (splits - 1) * split_len,
                           tail_len=1 if reverse else 0, size=size, stride_step=size,
                           stride_row=splits * size, reverse=False, prefix="part")
    buffers = {"part": Buffer(part_shape, "float32"), "state": state}
    return Plan(buffers, (partial, combine), STATE_RESULTS)


def _scan_launch(target, states, decay, init, stop, stride_decay, *, rows, heads, steps, step_len, last_len,
                 tail_len, size, stride_step, stride_row, reverse, prefix, total="state"):
    """A launch of _lightning_cp_scan_kernel (``init`` / ``stop``: buffer names or None)."""
    block = min(SCAN_BLOCK, next_pow2(size))
    return Launch(
        kernel=_lightning_cp_scan_kernel, grid=(rows, cdiv(size, block)),
        params=dict(states_ptr=states, decay_ptr=decay, init_ptr=init or decay, stop_ptr=stop or decay,
                    num_heads=Scalar(heads), num_steps=Scalar(steps), step_len=Scalar(step_len),
                    last_len=Scalar(last_len), tail_len=Scalar(tail_len), size_de=Scalar(size),
                    stride_step=Scalar(stride_step, "i64"), stride_row=Scalar(stride_row, "i64"),
                    stride_decay=Scalar(stride_decay),
                    # without a prefix, any buffer stands in (never written)
                    prefix_ptr=prefix, total_ptr=total),
        writes=("prefix_ptr", "total_ptr"),
        constexprs=dict(BLOCK=block, HAS_INIT=init is not None, HAS_PREFIX=stop is not None, REVERSE=reverse),
        num_warps=4, num_stages=1)


COMPOSE_RESULTS = ("prefix", "total")


@memoize
def plan_lightning_cp_compose(target: Target, states: ArrayInfo, ed: ArrayInfo, rank: ArrayInfo,
                              init: ArrayInfo | None = None, *, shard_len: int,
                              reverse: bool = False) -> Plan:
    """The scan over gathered shard states. states [R, B, H, D, E] fp32 (shard
    j's state sum, j = 0..R-1, each shard ``shard_len`` tokens), ed as
    plan_lightning_cp_state's, rank [1] int32 (this device's shard r, device
    data), init [B, H, D, E] (fp32, bf16 or fp16, read into fp32) or None (0).
    Results [B, H, D, E] fp32: forward, "prefix" = S_in(r) (the state before
    shard r) and "total" = S_in(R) (the final state), scanning from init =
    kv_history; ``reverse``, with states = the shards' G_own and init = the
    final state's gradient: "prefix" = the gradient of shard r's end state and
    "total" = the gradient of kv_history."""
    check_ndim("states", states, 5, "[R, B, H, D, E]")
    check_dtype("states", states, ("float32",))
    r, b, h, d, e = states.shape
    if r < 1:
        raise ValueError(f"states: expected at least one shard, got shape {tuple(states.shape)}")
    ed = _check_decay("ed", ed, h)
    check_shape("rank", rank, (1,), "[1]")
    check_dtype("rank", rank, ("int32",))
    if init is not None:
        check_shape("init", init, (b, h, d, e), "[B, H, D, E]")
        check_dtype("init", init, FLOAT_DTYPES)
    for name, info in (("states", states), ("init", init)):
        if info is not None and info.strides != row_major_strides(info.shape):
            raise ValueError(f"{name}: expected a contiguous array, got strides {info.strides}")
    shard_len = as_int("shard_len", shard_len, 1, 2 ** 31 - 1)
    buffers = {"prefix": Buffer((b, h, d, e), "float32"), "total": Buffer((b, h, d, e), "float32")}
    if b == 0 or h == 0 or d == 0 or e == 0:
        return Plan({n: Buffer(x.shape, x.dtype, zero_init=True) for n, x in buffers.items()}, (),
                     COMPOSE_RESULTS)
    size = d * e
    launch = _scan_launch(target, "states", "ed", "init" if init is not None else None, "rank",
                          ed.strides[0], rows=b * h, heads=h, steps=r, step_len=shard_len,
                          last_len=shard_len, tail_len=0, size=size, stride_step=b * h * size,
                          stride_row=size, reverse=bool(reverse), prefix="prefix", total="total")
    return Plan(buffers, (launch,), COMPOSE_RESULTS)
