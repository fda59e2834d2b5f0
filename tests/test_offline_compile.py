"""Every kernel the planners launch compiles for sm_90, on a machine without a GPU.

The CPU suite runs the kernels under Triton's interpreter, which accepts code
that the compiler rejects (seen: a string default of a constexpr parameter of
a @triton.jit helper ran interpreted and failed to compile). This test plans
each op for an sm_90 GPU (Target("cuda", 90, 132), with Gluon and without:
the Gluon kernels where a planner picks them and the Triton fallbacks) and
compiles every launch of every plan to PTX with tools/offline_compile.py, as
both launchers compile it (pointers 16-byte aligned, integers equal to 1 as
constants). The cases are small inputs chosen to reach every kernel and every
major constexpr branch at least once (each case's label says which); sizes
only matter where they pick a branch (tiling, segments, splits, Gluon scope).

Each op compiles in a subprocess of its own, because Triton decides when a
kernel is defined whether it is interpreted. A launch passes when its PTX
holds the kernel's entry; COMPILED, the launches and kernels each op must
compile, catches a case or an op that stops producing launches. To see one
op's launches and compile times:

    PYTHONPATH=. .venv/bin/python tests/test_offline_compile.py prefix_prefill
"""
import ast
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# op -> (launches compiled: every launch of every case's plan, the kernels among them)
COMPILED = {
    "merge_attn_states": (15, {"_merge_attn_states_kernel", "_merge_attn_states_bwd_kernel",
                               "_mask_empty_context_lse_kernel"}),
    "prefix_prefill": (10, {"_prefix_prefill_kernel", "_prefix_prefill_gather_kernel"}),
    "lightning_attention": (44, {"_lightning_prefill_kernel", "_gluon_prefill_kernel", "_gluon_prefill_tf32_kernel",
                                 "_lightning_decode_kernel", "_lightning_bwd_dq_kernel", "_lightning_bwd_dkv_kernel",
                                 "_lightning_bwd_decay_kernel", "_state_map_kernel",
                                 "_lightning_cp_partial_kernel", "_lightning_cp_scan_kernel"}),
    "lightning_attention_varlen": (27, {"_lightning_varlen_kernel", "_gluon_varlen_kernel",
                                        "_gluon_varlen_tf32_kernel", "_lightning_bwd_dq_kernel",
                                        "_lightning_bwd_dkv_kernel", "_lightning_bwd_decay_kernel",
                                        "_state_map_kernel"}),
    "blocksparse_attention": (19, {"_bsattn_fwd_kernel", "_bsattn_fwd_lse_kernel", "_bsattn_decode_kernel",
                                   "_bsattn_decode_group_kernel", "_bsattn_bwd_colmask_kernel",
                                   "_bsattn_bwd_dq_kernel", "_bsattn_bwd_dkdv_kernel",
                                   "_bsattn_bwd_dq_gluon_kernel", "_bsattn_bwd_dkdv_gluon_kernel"}),
    "example_scale": (2, {"_example_scale_kernel"}),
    "reshape_and_cache_flash": (4, {"_reshape_and_cache_flash_kernel"}),
    "unified_attention_decode": (8, {"_unified_decode_kernel", "_unified_decode_combine_kernel"}),
    "unified_attention_prefill": (8, {"_prefix_prefill_kernel", "_prefix_prefill_gather_kernel"}),
}


# ---------------------------------------------------------------- cases
# Each op's cases: (label, target, planner, array arguments by name (None:
# absent), options); the planner is called as the adapters call it. core_kernels
# is imported inside the functions: only the subprocess (main) runs them.
def _ai(shape, dtype, strides=None):
    from core_kernels._plan import ArrayInfo
    return ArrayInfo.contiguous(shape, dtype) if strides is None else ArrayInfo(tuple(shape), dtype, tuple(strides))


def _targets():
    """(sm_90 with Gluon, sm_90 without: the Triton fallbacks)."""
    from core_kernels._target import Target
    return Target("cuda", 90, 132, gluon=True), Target("cuda", 90, 132)


def example_scale_cases():
    from core_kernels.example_scale import plan_example_scale
    hopper, _ = _targets()
    for dtype in ("bfloat16", "float32"):
        yield (f"example_scale {dtype}", hopper, plan_example_scale,
               dict(x=_ai((4096, 32, 128), dtype), scale=_ai((1,), "float32")), {})


def reshape_and_cache_flash_cases():
    from core_kernels.reshape_and_cache_flash import plan_reshape_and_cache_flash
    hopper, _ = _targets()  # no Gluon kernels

    def arrays(n, h, d, nb, bs, dtype, cache_dtype, cache_strides=None, scales=True):
        cache = _ai((nb, bs, h, d), cache_dtype, cache_strides)
        return dict(key=_ai((n, h, d), dtype), value=_ai((n, h, d), dtype), key_cache=cache, value_cache=cache,
                    slot_mapping=_ai((n,), "int64"), k_scale=_ai((1,), "float32") if scales else None,
                    v_scale=_ai((1,), "float32") if scales else None)

    yield ("auto bf16 D128 block 16", hopper, plan_reshape_and_cache_flash,
           arrays(8192, 8, 128, 1024, 16, "bfloat16", "bfloat16", scales=False), {})
    yield ("fp8 e4m3 cache from bf16", hopper, plan_reshape_and_cache_flash,
           arrays(8192, 8, 128, 1024, 16, "bfloat16", "float8_e4m3fn"), dict(kv_cache_dtype="fp8"))
    yield ("fp8 e5m2 as uint8 from fp16, D80, 3 heads, block 544", hopper, plan_reshape_and_cache_flash,
           arrays(100, 3, 80, 4, 544, "float16", "uint8"), dict(kv_cache_dtype="fp8_e5m2"))
    yield ("auto fp32 D256, K of a [blocks, 2, 16, H, D] pair", hopper, plan_reshape_and_cache_flash,
           arrays(64, 2, 256, 32, 16, "float32", "float32", (2 * 16 * 2 * 256, 2 * 256, 256, 1)), {})


def merge_attn_states_cases():
    from core_kernels.merge_attn_states import (MergeConfig, plan_mask_empty_context_lse, plan_merge_attn_states,
                                                plan_merge_attn_states_backward)
    hopper, _ = _targets()  # no Gluon kernels

    def states(n, h, d, dtype, strides=None):
        o, lse = _ai((n, h, d), dtype, strides), _ai((h, n), "float32")
        return dict(prefix_output=o, prefix_lse=lse, suffix_output=o, suffix_lse=lse)

    # the tilings of TILINGS (2- and 4-byte inputs: one-row tiles, 512-element tiles with
    # and without load_first, 16-bit head-major 2048-element tiles), caller-given outputs
    # (the torch API)
    for dtype, n in (("bfloat16", 1), ("bfloat16", 256), ("bfloat16", 16384),
                     ("float32", 1), ("float32", 256), ("float32", 16384), ("float16", 256)):
        s = states(n, 32, 128, dtype)
        yield (f"forward {dtype} N{n}", hopper, plan_merge_attn_states,
               dict(s, output=s["prefix_output"], output_lse=s["prefix_lse"]), {})
    s = states(64, 8, 128, "bfloat16")
    yield ("forward fp8 output, scalar token count, no output LSE", hopper, plan_merge_attn_states,
           dict(s, output_scale=_ai((1,), "float32")), dict(num_ctx="scalar", want_output_lse=False))
    s = states(64, 8, 80, "float32", (8 * 84, 84, 1))
    yield ("forward D80 in rows of 84 (4-element row alignment), token count array, allocated outputs", hopper,
           plan_merge_attn_states,
           dict(s, prefill_tokens_with_context=_ai((1,), "int32")), dict(num_ctx="array"))
    for dtype in ("bfloat16", "float32"):
        s = states(256, 32, 128, dtype)
        yield (f"backward {dtype} with output LSE gradient", hopper, plan_merge_attn_states_backward,
               dict(s, grad_output=s["prefix_output"], grad_output_lse=s["prefix_lse"]), {})
    s = states(16384, 32, 128, "bfloat16")
    yield ("backward bfloat16 with the forward's head-major tiles (its config= reaches the backward)", hopper,
           plan_merge_attn_states_backward, dict(s, grad_output=s["prefix_output"]),
           dict(config=MergeConfig(2048, 2, head_major=True)))
    s = states(64, 8, 80, "float16")
    yield ("backward float16 D80, token count array, no output LSE gradient", hopper,
           plan_merge_attn_states_backward,
           dict(s, grad_output=s["prefix_output"], prefill_tokens_with_context=_ai((1,), "int64")),
           dict(num_ctx="array"))
    for index in ("int32", "int64"):
        yield (f"mask_empty_context_lse {index}", hopper, plan_mask_empty_context_lse,
               dict(lse=_ai((8, 300), "float32"), query_start_loc=_ai((5,), index),
                    context_start_loc=_ai((5,), index)), {})


def prefix_prefill_cases():
    from core_kernels.prefix_prefill import PrefixPrefillConfig, plan_prefix_prefill
    hopper, _ = _targets()  # no Gluon kernels

    def arrays(dtype, hq, hkv, d, *, b=4, q_len=64, ctx=256, bs=16, x=8, cache=None, table="int32",
               blocks=None, new_kv=True, **extra):
        t, width = b * q_len, (ctx + q_len) // bs + 1
        blocks = blocks or b * width
        cache = cache or dtype
        return dict(q=_ai((t, hq, d), dtype), k=_ai((t, hkv, d), dtype) if new_kv else None,
                    v=_ai((t, hkv, d), dtype) if new_kv else None,
                    k_cache=_ai((blocks, hkv, d // x, bs, x), cache), v_cache=_ai((blocks, hkv, d, bs), cache),
                    b_loc=_ai((b, width), table), b_start_loc=_ai((b + 1,), table), b_seq_len=_ai((b,), table),
                    **extra)

    scale = _ai((1,), "float32")
    # 16-bit D 128: the context gathered into dense scratch (gather kernel + dense loop)
    yield ("bfloat16 D128 gathered: window, sinks, skip_decode, fp8 output", hopper, plan_prefix_prefill,
           arrays("bfloat16", 8, 2, 128, sinks=_ai((8,), "float32"), fp8_out_scale=scale),
           dict(max_input_len=64, sliding_window=100, skip_decode=True))
    yield ("bfloat16 D128 gathered: fp8 (uint8) cache, cached new K/V, interleaved V, block addresses, "
           "non-causal", hopper, plan_prefix_prefill,
           arrays("bfloat16", 8, 2, 128, cache="uint8", table="int64", new_kv=False, k_scale=scale,
                  v_scale=scale),
           dict(max_input_len=64, kv_cache_dtype="fp8", interleaved_v_pack_factor=8,
                is_block_table_ptr=True, causal=False))
    # the paged loop (block ids prefetched one tile ahead)
    yield ("float16 D64 paged: ALiBi, int64 table, given output", hopper, plan_prefix_prefill,
           arrays("float16", 8, 2, 64, table="int64", alibi_slopes=_ai((8,), "float32"),
                  output=_ai((256, 8, 64), "float16")), dict(max_input_len=64))
    yield ("float16 D64 paged: fp8_e5m2 cache, cached new K/V, interleaved V, block addresses, "
           "non-causal, int64 offsets", hopper, plan_prefix_prefill,
           arrays("float16", 8, 2, 64, cache="float8_e5m2", table="int64", new_kv=False, blocks=1 << 21,
                  k_scale=scale, v_scale=scale),
           dict(max_input_len=64, interleaved_v_pack_factor=4, is_block_table_ptr=True, causal=False))
    yield ("float32 D80 paged (masked D, tf32 products): window, sinks", hopper, plan_prefix_prefill,
           arrays("float32", 4, 4, 80, x=4, sinks=_ai((4,), "float32")), dict(max_input_len=64, sliding_window=50))
    yield ("float32 D80 paged: ALiBi (exact fp32 products)", hopper, plan_prefix_prefill,
           arrays("float32", 4, 4, 80, x=4, alibi_slopes=_ai((4,), "float32")), dict(max_input_len=64))
    # block ids loaded two tiles ahead, or in the tile's own iteration: config only
    for prefetch in (2, 0):
        yield (f"bfloat16 D128 config: paged, block ids prefetched {prefetch} tiles ahead", hopper,
               plan_prefix_prefill, arrays("bfloat16", 8, 2, 128),
               dict(max_input_len=64, config=PrefixPrefillConfig(64, 64, 4, 2, True, prefetch, gather=False)))


def lightning_attention_cases():
    from core_kernels.lightning_attention import (LightningTritonConfig, plan_lightning_attention,
                                                  plan_lightning_attention_backward, plan_linear_decode)
    hopper, triton_only = _targets()

    def prefill(b, h, n, d, e, dtype, history=None, strides=None):
        q = _ai((b, h, n, d), dtype, strides)
        return dict(q=q, k=q, v=_ai((b, h, n, e), dtype), ed=_ai((h,), "float32"),
                    kv_history=None if history is None else _ai((b, h, d, e), history))

    # Gluon prefills (bf16, fp32 with tf32 products): few heads, so chained-scan segments
    yield ("Gluon bf16: per-block states, history, segmented", hopper, plan_lightning_attention,
           prefill(1, 8, 4096, 128, 128, "bfloat16", "float32"), {})
    yield ("Gluon fp32: final state only, bf16 history, segmented", hopper, plan_lightning_attention,
           prefill(1, 8, 4096, 128, 128, "float32", "bfloat16"), dict(output_final_state_only=True))
    yield ("Gluon bf16: final state only, one segment", hopper, plan_lightning_attention,
           prefill(4, 64, 256, 128, 128, "bfloat16"), dict(output_final_state_only=True))
    # the Triton prefill
    yield ("Triton bf16 (bf16 products): per-block states published in kv, history", triton_only,
           plan_lightning_attention, prefill(1, 8, 2048, 128, 128, "bfloat16", "float16"), {})
    yield ("Triton fp32 (bf16-split state product): final state only, segments in scratch", triton_only,
           plan_lightning_attention, prefill(1, 8, 2048, 128, 128, "float32"), dict(output_final_state_only=True))
    yield ("Triton fp16 D48 E80 (masked tiles), one segment, int64 token offsets", hopper,
           plan_lightning_attention, prefill(2, 64, 64, 48, 80, "float16", strides=(64 * 48, 48, 1 << 26, 1)), {})
    yield ("Triton fp32 config: exact fp32 products", triton_only, plan_lightning_attention,
           prefill(2, 64, 128, 128, 128, "float32"), dict(config=LightningTritonConfig(dot_precision="ieee")))
    # decode
    for dtype, d, cache in (("bfloat16", 128, "float32"), ("float16", 48, "float16")):
        q = _ai((8, 16, 1, d), dtype)
        yield (f"decode {dtype} D{d}, {cache} state", hopper, plan_linear_decode,
               dict(q=q, k=q, v=q, kv_caches=_ai((12, 16, d, d), cache), slope_rate=_ai((16,), "float32"),
                    slot_idx=_ai((8,), "int64")), {})
    q = _ai((4, 16, 1, 64), "float32")
    yield ("decode float32, [H, 1, 1] decay, int64 state offsets (state columns 2**25 apart)", hopper,
           plan_linear_decode,
           dict(q=q, k=q, v=q, kv_caches=_ai((4, 16, 64, 64), "float32", (16 * 64, 64, 1, 1 << 25)),
                slope_rate=_ai((16, 1, 1), "float32"), slot_idx=_ai((4,), "int32")), {})

    # backward: the forward's kernels reversed and shifted (ed constant) ...
    def backward(b, h, n, dtype, final_only, history=True, grad_kv=True):
        a = prefill(b, h, n, 128, 128, dtype, "float32" if history else None)
        kv = _ai((b, h, 128, 128) if final_only else (b, h, n // 256 + 1, 128, 128), "float32")
        return dict(a, kv=kv, grad_output=a["v"], grad_kv=kv if grad_kv else None)

    for target, dtype in ((hopper, "bfloat16"), (hopper, "float32"), (triton_only, "bfloat16")):
        yield (f"backward passes {dtype} on {'Gluon' if target.gluon else 'Triton'}: history, final-state "
               "gradient", target, plan_lightning_attention_backward, backward(1, 8, 1024, dtype, True),
               dict(output_final_state_only=True, need_grad_ed=False))
    # ... and the scan kernels (the decay's gradient, per-block states' gradients)
    yield ("backward scans bf16: per-block states, history, their gradient, decay gradient", hopper,
           plan_lightning_attention_backward, backward(1, 4, 512, "bfloat16", False), {})
    yield ("backward scans fp32: final state only, no history or state gradient", hopper,
           plan_lightning_attention_backward, backward(1, 4, 512, "float32", True, False, False),
           dict(output_final_state_only=True))
    # context parallelism (cp_plan.py): shard states (split, summed in order) and their scan
    from core_kernels.lightning_attention.cp_plan import plan_lightning_cp_compose, plan_lightning_cp_state
    for dtype, d, e, reverse in (("float32", 128, 128, False), ("bfloat16", 128, 128, True),
                                 ("float16", 48, 80, False)):
        a = prefill(1, 64, 4096, d, e, dtype)
        yield (f"context-parallel shard state {dtype} D{d} E{e}{', reverse' if reverse else ''}", hopper,
               plan_lightning_cp_state, dict(k=a["k"], v=a["v"], ed=a["ed"]), dict(reverse=reverse))
    for init, reverse in ((_ai((1, 64, 128, 128), "bfloat16"), False), (None, True)):
        yield (f"context-parallel scan{', init' if init else ''}{', reverse' if reverse else ''}", hopper,
               plan_lightning_cp_compose, dict(states=_ai((4, 1, 64, 128, 128), "float32"),
                                               ed=_ai((64,), "float32"), rank=_ai((1,), "int32"), init=init),
               dict(shard_len=1024, reverse=reverse))


def lightning_attention_varlen_cases():
    from core_kernels.lightning_attention import (plan_lightning_attention_varlen,
                                                  plan_lightning_attention_varlen_backward)
    hopper, triton_only = _targets()

    def packed(b, h, t, d, e, dtype, cache=False, q_strides=None):
        q = _ai((t, h, d), dtype, q_strides)
        a = dict(q=q, k=q, v=_ai((t, h, e), dtype), ed=_ai((h,), "float32"), cu_seqlens=_ai((b + 1,), "int32"))
        return dict(a, kv_cache=_ai((b + 2, h, d, e), "float32"), slot_idx=_ai((b,), "int64")) if cache else a

    # Gluon varlen kernels (the sequences fill the GPU uncut)
    yield ("Gluon bf16: slot cache, longest first", hopper, plan_lightning_attention_varlen,
           packed(4, 64, 4096, 128, 128, "bfloat16", True), {})
    yield ("Gluon fp32: final states, index order", hopper, plan_lightning_attention_varlen,
           packed(128, 64, 8192, 128, 128, "float32"), {})
    # the Triton varlen kernel
    yield ("Triton bf16: slot cache, sequences cut into items", triton_only, plan_lightning_attention_varlen,
           packed(2, 4, 2048, 128, 128, "bfloat16", True), {})
    yield ("Triton fp32 (bf16-split state product): final states, uncut", triton_only,
           plan_lightning_attention_varlen, packed(4, 64, 1024, 128, 128, "float32"), {})
    yield ("Triton fp16 D48 E80 (masked tiles), int64 token offsets", hopper, plan_lightning_attention_varlen,
           packed(3, 8, 600, 48, 80, "float16", q_strides=(1 << 22, 48, 1)), {})

    def backward(b, h, t, dtype):
        a = packed(b, h, t, 128, 128, dtype)
        states = _ai((b, h, 128, 128), "float32")
        return dict(a, kv=states, grad_output=a["v"], grad_kv=states, kv_history=states)

    # backward: the forward's kernels with per-sequence histories, reversed and shifted ...
    for target, dtype in ((hopper, "bfloat16"), (hopper, "float32"), (triton_only, "bfloat16")):
        yield (f"backward passes {dtype} on {'Gluon' if target.gluon else 'Triton'}: history, final-state "
               "gradient", target, plan_lightning_attention_varlen_backward,
               backward(4, 64, 4096, dtype), dict(need_grad_ed=False))
    # ... and the scan kernels over packed sequences
    yield ("backward scans bf16 with the decay gradient", hopper, plan_lightning_attention_varlen_backward,
           backward(2, 4, 512, "bfloat16"), {})


def blocksparse_attention_cases():
    from core_kernels.blocksparse_attention import (plan_blocksparse_attention, plan_blocksparse_attention_backward,
                                                    plan_blocksparse_attention_lse)
    hopper, triton_only = _targets()

    def batch(b, n, hq, hkv, d, dtype, *, decode=False, q_len=None, bs=64, index="int32"):
        """b sequences of n keys; decode: one query each; q_len: that many queries each."""
        tk = b * n
        tq = b if decode else tk if q_len is None else b * q_len
        nb = n // bs
        return dict(q=_ai((tq, hq, d), dtype), k=_ai((tk, hkv, d), dtype), v=_ai((tk, hkv, d), dtype),
                    cu_seqlens_k=_ai((b + 1,), index),
                    cu_seqlens_q=None if q_len is None else _ai((b + 1,), index),
                    crow=_ai((hq, nb + 1), index), col=_ai((hq, nb * (nb + 1) // 2), index))

    yield ("prefill bf16 D128", hopper, plan_blocksparse_attention, batch(2, 1024, 8, 2, 128, "bfloat16"),
           dict(max_seqlen=1024))
    yield ("prefill fp32 D96 (masked D), q blocks of two layout rows, int64 indices", hopper,
           plan_blocksparse_attention, batch(2, 1024, 8, 2, 96, "float32", q_len=300, index="int64"),
           dict(q_block_size=128))
    yield ("decode per head bf16, split", hopper, plan_blocksparse_attention,
           batch(1, 4096, 8, 2, 128, "bfloat16", decode=True), {})
    yield ("decode per head fp16 D80 block 16, one split", hopper, plan_blocksparse_attention,
           batch(64, 128, 16, 16, 80, "float16", decode=True, bs=16), dict(block_size=16))
    yield ("decode GQA-packed fp32, split", hopper, plan_blocksparse_attention,
           batch(16, 1024, 32, 8, 128, "float32", decode=True), {})
    yield ("decode GQA-packed bf16 D80, one split", hopper, plan_blocksparse_attention,
           batch(256, 256, 32, 8, 80, "bfloat16", decode=True), {})
    yield ("forward with LSE bf16, decode batch", hopper, plan_blocksparse_attention_lse,
           batch(4, 1024, 8, 2, 128, "bfloat16", decode=True), {})

    def backward(*args, **kwargs):
        a = batch(*args, **kwargs)
        return dict(a, output=a["q"], lse=_ai(a["q"].shape[:2], "float32"), grad_output=a["q"])

    for target, decode in ((hopper, False), (hopper, True), (triton_only, True)):
        yield (f"backward bf16 D128 {'decode' if decode else 'prefill'} batch on "
               f"{'Gluon' if target.gluon else 'Triton'}", target, plan_blocksparse_attention_backward,
               backward(2, 1024, 8, 2, 128, "bfloat16", decode=decode), {})
    yield ("backward fp32 D80 (masked D), q blocks of two layout rows", hopper,
           plan_blocksparse_attention_backward, backward(2, 1024, 8, 2, 80, "float32", q_len=200),
           dict(q_block_size=128))


def unified_attention_decode_cases():
    """unified_attention's decode path (max_seqlen_q <= DECODE_MAX_Q: no prefill launch)."""
    from core_kernels.unified_attention import plan_unified_attention
    from core_kernels.unified_attention.decode_plan import UnifiedDecodeConfig
    hopper, _ = _targets()  # no Gluon kernels

    def arrays(dtype, hq, hkv, d, *, b=8, q_len=1, bs=16, width=1024, cache=None, blocks=None,
               table="int32", **extra):
        t = b * q_len
        return dict(q=_ai((t, hq, d), dtype), k=_ai((blocks or b * width, bs, hkv, d), cache or dtype),
                    v=_ai((blocks or b * width, bs, hkv, d), cache or dtype),
                    cu_seqlens_q=_ai((b + 1,), "int32"), seqused_k=_ai((b,), "int32"),
                    block_table=_ai((b, width), table), **extra)

    one = _ai((1,), "float32")
    yield ("bf16 D128 GQA 4, split (decode + combine)", hopper, plan_unified_attention,
           arrays("bfloat16", 32, 8, 128), dict(max_seqlen_q=1, max_seqlen_k=16384, softmax_scale=0.088))
    yield ("bf16 D128 float8 cache (fp16 dots), [B, Hkv] descales, softcap, sinks, window, split",
           hopper, plan_unified_attention,
           arrays("bfloat16", 32, 8, 128, q_len=4, cache="float8_e4m3fn", k_descale=_ai((8, 8), "float32"),
                  v_descale=_ai((8, 8), "float32", (0, 0)), sinks=_ai((32,), "float32")),
           dict(max_seqlen_q=4, max_seqlen_k=16384, softmax_scale=0.088, kv_quant_mode=1, softcap=30.0,
                window_left=511, window_right=0))
    yield ("fp8 q, uint8 cache (bf16 dots: fp8_mode 0), fp8 output, ALiBi sqrt, causal flags, "
           "int64 table, split", hopper,
           plan_unified_attention,
           arrays("float8_e4m3fn", 16, 2, 64, q_len=2, cache="uint8", table="int64", q_descale=one,
                  k_descale=one, v_descale=one, output_scale=one, alibi_slopes=_ai((16,), "float32"),
                  causal_flags=_ai((8,), "bool"), out=_ai((16, 16, 64), "float8_e4m3fn")),
           dict(max_seqlen_q=2, max_seqlen_k=16384, softmax_scale=0.125, kv_quant_mode=1, use_alibi_sqrt=True,
                config=UnifiedDecodeConfig(fp8_mode=0)))
    yield ("fp16 D80 GQA 5 block 544, ALiBi, one chunk", hopper, plan_unified_attention,
           arrays("float16", 10, 2, 80, q_len=8, bs=544, width=2, alibi_slopes=_ai((10,), "float32")),
           dict(max_seqlen_q=8, max_seqlen_k=1000, softmax_scale=0.11))
    yield ("fp32 D256 GQA 16 (two passes of 8-token queries), int64 offsets, non-causal window",
           hopper, plan_unified_attention,
           arrays("float32", 32, 2, 256, q_len=8, width=8, blocks=1 << 17),
           dict(max_seqlen_q=8, max_seqlen_k=8192, softmax_scale=0.06, causal=False, window_left=100))


def unified_attention_prefill_cases():
    """unified_attention's prefill path alone (prefill_launches on context_attention_fwd's
    kernels, the flash cache layout; the decode path's launches are its own cases)."""
    from core_kernels._plan import Plan
    from core_kernels.unified_attention.prefill_plan import UnifiedPrefillConfig, prefill_launches
    from core_kernels.unified_attention.problem import validate
    hopper, _ = _targets()

    def prefill_only(target, config=None, **arrays_and_options):
        p = validate(**arrays_and_options)
        buffers, launches = prefill_launches(target, p, config)
        return Plan({**p.buffers, **buffers}, tuple(launches), ("out",))

    def arrays(dtype, hq, hkv, d, *, t, b, width, bs=16, cache=None, table="int32", **extra):
        blocks = b * width + 1
        return dict(q=_ai((t, hq, d), dtype), k=_ai((blocks, bs, hkv, d), cache or dtype),
                    v=_ai((blocks, bs, hkv, d), cache or dtype), cu_seqlens_q=_ai((b + 1,), "int32"),
                    seqused_k=_ai((b,), "int32"), block_table=_ai((b, width), table), **extra)

    one = _ai((1,), "float32")
    yield ("bf16 D128 B4 x 1024 over 4096: gathered, flat grid", hopper, prefill_only,
           arrays("bfloat16", 32, 8, 128, t=4096, b=4, width=320),
           dict(max_seqlen_q=1024, max_seqlen_k=5120, softmax_scale=0.088))
    yield ("bf16 D128 mixed batch (a 2048 chunk, 127 decodes): paged, flat grid", hopper, prefill_only,
           arrays("bfloat16", 32, 8, 128, t=2175, b=128, width=640),
           dict(max_seqlen_q=2048, max_seqlen_k=10240, softmax_scale=0.088))
    fp8 = arrays("float8_e4m3fn", 16, 4, 64, t=600, b=4, width=64, cache="uint8", table="int64",
                 q_descale=one, k_descale=_ai((4, 4), "float32"), v_descale=_ai((4, 4), "float32", (0, 0)),
                 output_scale=one, out=_ai((600, 16, 64), "float8_e4m3fn"), sinks=_ai((16,), "float32"),
                 alibi_slopes=_ai((16,), "float32"), causal_flags=_ai((4,), "bool"))
    fp8_options = dict(max_seqlen_q=300, max_seqlen_k=1000, softmax_scale=0.125, kv_quant_mode=1,
                       softcap=30.0, use_alibi_sqrt=True, window_left=255, window_right=0)
    yield ("fp8 q (bf16 dots), uint8 cache, [B, Hkv] descales, fp8 out, softcap, sinks, ALiBi sqrt, "
           "causal flags (symmetric window), int64 table: paged", hopper, prefill_only, fp8,
           dict(fp8_options, config=UnifiedPrefillConfig(128, 64, gather=False)))
    yield ("the same, gathered (the cache widened to bf16)", hopper, prefill_only, fp8,
           dict(fp8_options, config=UnifiedPrefillConfig(128, 64, gather=True)))
    yield ("fp8 q with an fp16 output (fp16 dots), float8 cache, D80 GQA 5, block 544, ALiBi: "
           "paged, per-sequence grid", hopper, prefill_only,
           arrays("float8_e4m3fn", 10, 2, 80, t=400, b=2, width=2, bs=544, cache="float8_e4m3fn",
                  q_descale=one, k_descale=one, v_descale=one, alibi_slopes=_ai((10,), "float32"),
                  out=_ai((400, 10, 80), "float16")),
           dict(max_seqlen_q=200, max_seqlen_k=1000, softmax_scale=0.11, kv_quant_mode=1,
                config=UnifiedPrefillConfig(64, 32, 4, 2, gather=False, flat_grid=False)))
    yield ("fp32 D256 GQA 16, int64 offsets, non-causal window", hopper, prefill_only,
           arrays("float32", 32, 2, 256, t=512, b=2, width=1 << 16),
           dict(max_seqlen_q=256, max_seqlen_k=4096, softmax_scale=0.06, causal=False, window_left=100))


# ---------------------------------------------------------------- the compile run (subprocess)
def _innermost(error: Exception) -> str:
    """Where a compile error starts: the innermost CompilationError's last lines
    (the source line in the kernel or helper, a caret, the cause), else the
    innermost exception."""
    from triton.compiler.errors import CompilationError
    chain = [error]
    while chain[-1].__cause__ or chain[-1].__context__:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)
    located = [e for e in chain if isinstance(e, CompilationError)]
    if located:
        return "\n".join(str(located[-1]).splitlines()[-3:])
    return f"{type(chain[-1]).__name__}: {chain[-1]}"


def main(op: str) -> int:
    """Compile every launch of ``op``'s cases; prints one line per launch, then
    'compiled N: kernel, ...'. Returns 1 if any launch failed to compile."""
    # first: tools.offline_compile switches the interpreter off before core_kernels is imported
    from tools.offline_compile import compile_launch, plan_dtypes
    compiled, kernels, failed = 0, set(), []
    for label, target, planner, arrays, options in globals()[f"{op}_cases"]():
        plan = planner(target, **arrays, **options)
        dtypes = plan_dtypes(plan, arrays)
        for launch in plan.launches:
            name = launch.kernel.__name__
            start = time.perf_counter()
            try:
                ptx = compile_launch(launch, dtypes, specialize_ones=True).asm["ptx"]
                assert f".entry {name}(" in ptx, f"no .entry {name} in the PTX"
            except Exception as e:  # noqa: BLE001  report every launch, then fail
                failed.append(f"{label}: {name}:\n{_innermost(e)}")
                continue
            compiled += 1
            kernels.add(name)
            print(f"{time.perf_counter() - start:6.2f} s  {label}: {name}", flush=True)
    for failure in failed:
        print("FAILED", failure)
    print(f"compiled {compiled}: {', '.join(sorted(kernels))}")
    return 1 if failed else 0


@pytest.mark.parametrize("op", list(COMPILED))
def test_kernels_compile_for_sm90(op, tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path),
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run([sys.executable, __file__, op], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    count, kernels = COMPILED[op]
    assert run.stdout.splitlines()[-1] == f"compiled {count}: {', '.join(sorted(kernels))}", run.stdout


def test_every_kernel_is_compiled():
    """Every kernel (a ``*_kernel`` function) under core_kernels/ is in COMPILED."""
    defined = {node.name for path in (ROOT / "core_kernels").rglob("*.py")
               for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel") and node.decorator_list}
    assert defined == set().union(*(kernels for _, kernels in COMPILED.values()))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
