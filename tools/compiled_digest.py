"""Digest of the sm_90 code every representative plan compiles to, without a GPU.

    PYTHONPATH=. .venv/bin/python tools/compiled_digest.py [--out FILE] [op ...]

For each case below (default plans of each op at benchmark-like shapes), every
launch is compiled for sm_90 (tools/offline_compile.py: ints unspecialised, as
both launchers compile them) and its PTX is digested after stripping debug
records (``.loc``/``.file`` lines, debug sections, comments), which move with
source line numbers. Two trees whose digests match compile to the same code,
so a refactor that keeps every digest cannot change speed or numerics. Works
on trees whose planners take a ``target`` first argument and on older ones.
"""
from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import re
import sys

os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, os.getcwd())

from tools.offline_compile import compile_launch  # noqa: E402

from core_kernels._plan import ArrayInfo  # noqa: E402


def _ai(shape, dtype, strides=None):
    info = ArrayInfo.contiguous(shape, dtype)
    return info if strides is None else ArrayInfo(tuple(shape), dtype, tuple(strides))


# device arrays that are not planner parameters (runtime values passed as data)
_EXTRA_DTYPES = {"prefill_tokens_with_context": "int32", "output_scale": "float32"}


def _call(planner, *infos, **options):
    """(plan, pointer dtypes by buffer name) for the planner's default choices."""
    sig = inspect.signature(planner)
    if next(iter(sig.parameters)) == "target":
        from core_kernels._target import Target
        infos = (Target("cuda", 90, 132, gluon=True), *infos)
    plan = planner(*infos, **options)
    bound = sig.bind(*infos, **options).arguments
    dtypes = dict(_EXTRA_DTYPES)
    dtypes.update({k: v.dtype for k, v in bound.items() if isinstance(v, ArrayInfo)})
    return plan, dtypes


def merge_cases():
    from core_kernels.merge_attn_states import plan_merge_attn_states as p
    for dt, n, h, d in (("bfloat16", 16384, 32, 128), ("float32", 4096, 32, 128),
                        ("float16", 64, 32, 128), ("float32", 33, 3, 80)):
        o, lse = _ai((n, h, d), dt), _ai((h, n), "float32")
        yield f"merge {dt} {n}x{h}x{d}", _call(p, o, lse, o, lse, o, lse)
    o, lse = _ai((512, 8, 128), "bfloat16"), _ai((8, 512), "float32")
    fp8 = dict(output_scale=_ai((1,), "float32"))
    if "has_output_scale" in inspect.signature(p).parameters:  # the planner before 2026-11-24
        fp8 = dict(has_output_scale=True)
    yield "merge fp8 out, scalar ctx", _call(p, o, lse, o, lse, _ai((512, 8, 128), "float8_e4m3fn"),
                                             None, num_ctx="scalar", **fp8)
    yield "merge jax array ctx", _call(p, o, lse, o, lse, num_ctx="array")
    padded = _ai((512, 8, 128), "bfloat16", (11 * 128, 128, 1))
    yield "merge padded heads", _call(p, padded, lse, o, lse, o, lse)


def prefix_cases():
    from core_kernels.prefix_prefill import plan_prefix_prefill as p
    for dt, b, q, ctx, hq, hkv, d in (("bfloat16", 4, 1024, 4096, 32, 8, 128),
                                      ("float16", 16, 256, 1024, 32, 8, 128),
                                      ("float32", 2, 128, 256, 8, 2, 64),
                                      ("float16", 8, 1, 2048, 32, 8, 128)):
        bs, x = 16, 8 if dt != "float32" else 4
        t = b * q
        blocks = b * (ctx + q) // bs + 1
        args = (_ai((t, hq, d), dt), _ai((t, hkv, d), dt), _ai((t, hkv, d), dt),
                _ai((blocks, hkv, d // x, bs, x), dt), _ai((blocks, hkv, d, bs), dt),
                _ai((b, (ctx + q) // bs + 1), "int32"), _ai((b + 1,), "int32"), _ai((b,), "int32"),
                _ai((t, hq, d), dt))
        yield f"prefix {dt} B{b} q{q} ctx{ctx}", _call(p, *args, max_input_len=q)
        yield f"prefix {dt} B{b} q{q} ctx{ctx} alibi+window", _call(
            p, *args, None, None, _ai((hq,), "float32"), max_input_len=q, sliding_window=512)
    t, b = 512, 2
    fp8 = (_ai((t, 32, 128), "bfloat16"), _ai((t, 8, 128), "bfloat16"), _ai((t, 8, 128), "bfloat16"),
           _ai((600, 8, 8, 16, 16), "uint8"), _ai((600, 8, 128, 16), "uint8"),
           _ai((b, 300), "int32"), _ai((b + 1,), "int32"), _ai((b,), "int32"), _ai((t, 32, 128), "bfloat16"),
           _ai((1,), "float32"), _ai((1,), "float32"))
    yield "prefix fp8 cache", _call(p, *fp8, max_input_len=256, kv_cache_dtype="fp8")
    # the paged path at 16-bit D=128 (a block table too wide for the scratch), an
    # int64 table with sinks, skip_decode and an fp8 output
    b, q, width, t = 4, 1024, 2560, 4096
    paged = (_ai((t, 32, 128), "float16"), _ai((t, 8, 128), "float16"), _ai((t, 8, 128), "float16"),
             _ai((b * width, 8, 16, 16, 8), "float16"), _ai((b * width, 8, 128, 16), "float16"),
             _ai((b, width), "int64"), _ai((b + 1,), "int64"), _ai((b,), "int64"))
    yield "prefix float16 paged (wide table)", _call(p, *paged, _ai((t, 32, 128), "float16"),
                                                     max_input_len=q)
    yield "prefix float16 paged sinks+skip_decode+fp8 out", _call(
        p, *paged, _ai((t, 32, 128), "float8_e4m3fn"), None, None, None, _ai((32,), "float32"),
        _ai((1,), "float32"), max_input_len=q, skip_decode=True)
    # vLLM 0.33's options (2026-11-24): interleaved V, K/V of the new tokens from
    # the cache (k = v = None), causal=False, block addresses; gathered and paged
    # (only on planners that take them)
    if "interleaved_v_pack_factor" not in inspect.signature(p).parameters:
        return
    b, q, ctx, t = 4, 1024, 4096, 4096
    blocks = b * (ctx + q) // 16 + 1
    std = (_ai((t, 32, 128), "bfloat16"), _ai((t, 8, 128), "bfloat16"), _ai((t, 8, 128), "bfloat16"),
           _ai((blocks, 8, 16, 16, 8), "bfloat16"), _ai((blocks, 8, 128, 16), "bfloat16"))
    table = lambda dt: (_ai((b, (ctx + q) // 16 + 1), dt), _ai((b + 1,), "int32"),  # noqa: E731
                        _ai((b,), "int32"), _ai((t, 32, 128), "bfloat16"))
    yield "prefix bfloat16 B4 q1024 ctx4096 interleaved V", _call(
        p, *std, *table("int32"), max_input_len=q, interleaved_v_pack_factor=8)
    yield "prefix bfloat16 B4 q1024 ctx4096 cached K/V", _call(
        p, std[0], None, None, *std[3:], *table("int32"), max_input_len=q)
    yield "prefix bfloat16 B4 q1024 ctx4096 non-causal", _call(
        p, *std, *table("int32"), max_input_len=q, causal=False)
    yield "prefix bfloat16 B4 q1024 ctx4096 block addresses", _call(
        p, *std, *table("int64"), max_input_len=q, is_block_table_ptr=True)
    yield "prefix float16 paged cached K/V+interleaved V+addresses+non-causal", _call(
        p, paged[0], None, None, paged[3], paged[4], *paged[5:], _ai((t, 32, 128), "float16"),
        max_input_len=q, interleaved_v_pack_factor=8, is_block_table_ptr=True, causal=False)


def lightning_cases():
    from core_kernels.lightning_attention import plan_lightning_attention as p
    from core_kernels.lightning_attention import plan_linear_decode as pd
    for dt, b, h, n in (("bfloat16", 1, 64, 4096), ("float32", 1, 64, 4096), ("bfloat16", 4, 64, 1024),
                        ("bfloat16", 1, 8, 65536), ("float32", 1, 8, 65536), ("float16", 1, 64, 4096),
                        ("float32", 2, 4, 1000), ("bfloat16", 1, 4, 96)):
        q, ed = _ai((b, h, n, 128), dt), _ai((h,), "float32")
        for fso in (False, True):
            yield f"lightning {dt} B{b} H{h} N{n} final_only={fso}", _call(
                p, q, q, q, ed, output_final_state_only=fso)
        yield f"lightning {dt} B{b} H{h} N{n} history", _call(
            p, q, q, q, ed, _ai((b, h, 128, 128), "float32"))
    q = _ai((2, 3, 50, 48), "float32")
    yield "lightning odd D/E", _call(p, q, q, _ai((2, 3, 50, 80), "float32"), _ai((3,), "float32"))
    # the [B, N, H, D] layout models keep (transposed views: token stride H * D), block
    # size 128, with history: both Gluon kernels (chained scan, 2-deep fp32 ring over
    # many programs) and the Triton kernel (fp16, and bf16 with a masked D, segmented)
    for dt, b, h, n, d in (("bfloat16", 1, 8, 16384, 128), ("float32", 4, 64, 1024, 128),
                           ("float16", 2, 16, 2048, 128), ("bfloat16", 1, 4, 4096, 96)):
        view = _ai((b, h, n, d), dt, (n * h * d, d, h * d, 1))
        yield f"lightning {dt} B{b} H{h} N{n} D{d} [B,N,H,D] view bs128 history", _call(
            p, view, view, view, _ai((h,), "float32"), _ai((b, h, d, d), "float32"), block_size=128)
    for dt, b in (("bfloat16", 64), ("float32", 64), ("bfloat16", 1)):
        q = _ai((b, 64, 1, 128), dt)
        yield f"decode {dt} B{b}", _call(pd, q, q, q, _ai((b + 8, 64, 128, 128), "float32"),
                                         _ai((64,), "float32"), _ai((b,), "int64"))
    # odd D (masked tiles), q/k/v slices of a fused qkv, a heads-outermost padded cache
    q = _ai((8, 4, 1, 48), "float16", (4 * 144, 144, 144, 1))
    yield "decode float16 D48 fused qkv, strided cache", _call(
        pd, q, q, q, _ai((12, 4, 48, 48), "float32", (48 * 48, 12 * 48 * 48 + 48, 48, 1)),
        _ai((4,), "float32"), _ai((8,), "int32"))


def blocksparse_cases():
    from core_kernels import blocksparse_attention as bsa
    from core_kernels.blocksparse_attention import plan_blocksparse_attention as p
    layout = getattr(bsa, "build_sparse_layout", None) or bsa.get_sparse_attn_mask  # the old tree
    hq, hkv, d, bs = 32, 8, 128, 64
    for dt, b, n, decode in (("bfloat16", 1, 16384, False), ("bfloat16", 4, 4096, False),
                             ("bfloat16", 1, 16384, True), ("bfloat16", 64, 4096, True),
                             ("float32", 2, 512, False), ("float16", 2, 512, True)):
        (crow, col), _ = layout(hq, n, bs, 16, 8, False, None)
        tk = b * n
        tq = b if decode else tk
        yield f"blocksparse {dt} {b}x{n} decode={decode}", _call(
            p, _ai((tq, hq, d), dt), _ai((tk, hkv, d), dt), _ai((tk, hkv, d), dt), _ai((b + 1,), "int32"),
            None, _ai(crow.shape, "int32"), _ai(col.shape, "int32"), block_size=bs, max_seqlen=n)
    # the other paths: q blocks of two layout rows over cu_seqlens_q (mixed batch), odd and
    # large head sizes (masked D, 8 warps), block 16, fp32 packed decode (stages cut to fit)
    for dt, hq, hkv, d, bs, b, n, q_len, qbs in (
            ("bfloat16", 32, 8, 128, 64, 4, 2048, 512, 128), ("float16", 8, 2, 96, 16, 3, 1024, 300, None),
            ("bfloat16", 16, 4, 256, 64, 2, 2048, 2048, None), ("float32", 32, 8, 256, 64, 32, 1024, None, None)):
        (crow, col), _ = layout(hq, n, bs, 16, 8, False, None)
        tk, tq = b * n, b if q_len is None else b * q_len
        cu_q = None if q_len is None else _ai((b + 1,), "int32")
        yield f"blocksparse {dt} {b}x{n} q{q_len} D{d} bs{bs} q_block_size={qbs}", _call(
            p, _ai((tq, hq, d), dt), _ai((tk, hkv, d), dt), _ai((tk, hkv, d), dt), _ai((b + 1,), "int32"),
            cu_q, _ai(crow.shape, "int32"), _ai(col.shape, "int32"), block_size=bs, q_block_size=qbs,
            max_seqlen=n)
    if "build_sparse_layout" not in vars(bsa):
        return  # trees before int64 index arrays
    # int64 index arrays (vLLM's layouts; each array loaded as given): prefill with
    # cu_seqlens_q and q blocks of two rows, per-head and GQA-packed decode
    hq, hkv, d, bs = 32, 8, 128, 64
    for b, n, q_len, qbs in ((4, 2048, 512, 128), (1, 16384, None, None), (64, 4096, None, None)):
        (crow, col), _ = layout(hq, n, bs, 16, 8, False, None)
        tk, tq = b * n, b if q_len is None else b * q_len
        cu_q = None if q_len is None else _ai((b + 1,), "int64")
        yield f"blocksparse bfloat16 {b}x{n} q{q_len} q_block_size={qbs} int64 indices", _call(
            p, _ai((tq, hq, d), "bfloat16"), _ai((tk, hkv, d), "bfloat16"), _ai((tk, hkv, d), "bfloat16"),
            _ai((b + 1,), "int64"), cu_q, _ai(crow.shape, "int64"), _ai(col.shape, "int64"),
            block_size=bs, q_block_size=qbs, max_seqlen=n)


CASES = {"merge_attn_states": merge_cases, "prefix_prefill": prefix_cases,
         "lightning_attention": lightning_cases, "blocksparse_attention": blocksparse_cases}


def _strip(ptx: str) -> str:
    out, skip = [], False
    for line in ptx.splitlines():
        s = line.strip()
        if s.startswith(".section") and ".debug" in s:
            skip = True
        if skip:
            if s == "}":
                skip = False
            continue
        if s.startswith((".loc", ".file", "//", "$L__")) or not s:
            continue
        out.append(re.sub(r"//.*", "", line).rstrip())
    return "\n".join(out)


def digest(plan, dtypes) -> list:
    dtypes = dict(dtypes)
    for name, buf in plan.buffers.items():
        dtypes.setdefault(name, buf.dtype)
    rows = []
    for launch in plan.launches:
        c = compile_launch(launch, dtypes)
        ptx = _strip(c.asm["ptx"])
        rows.append(f"{launch.kernel.fn.__name__} grid={tuple(launch.grid)} w{launch.num_warps} "
                    f"s{launch.num_stages} smem={c.metadata.shared} "
                    f"ptx={hashlib.sha256(ptx.encode()).hexdigest()[:16]}")
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ops", nargs="*", default=list(CASES))
    ap.add_argument("--out")
    ap.add_argument("--dump", help="folder for the stripped PTX of every launch")
    args = ap.parse_args()
    result = {}
    for op in args.ops:
        for name, (plan, dtypes) in CASES[op]():
            result[name] = digest(plan, dtypes)
            print(name, *result[name], sep="\n  ", flush=True)
            if args.dump:
                os.makedirs(args.dump, exist_ok=True)
                for i, launch in enumerate(plan.launches):
                    dt = dict(dtypes, **{k: b.dtype for k, b in plan.buffers.items()})
                    ptx = _strip(compile_launch(launch, dt).asm["ptx"])
                    fname = re.sub(r"[^A-Za-z0-9]+", "_", name) + f"_{i}.ptx"
                    open(os.path.join(args.dump, fname), "w").write(ptx)
    if args.out:
        json.dump(result, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
