"""blocksparse_attention: both adapters against the float64 reference (spec: blocksparse_attention.md).

The reference applies the exact token-level mask built from the spec's layout
formula (reference.formula_block_mask), never the builder's output, so the
layout builder and the kernels are checked independently.
"""
import contextlib
import functools
import re

import numpy as np
import pytest
import torch

from core_kernels._plan import ArrayInfo
from core_kernels._target import Target
from core_kernels.blocksparse_attention import (BlocksparseDecodeConfig, BlocksparseGroupDecodeConfig,
                                                BlocksparsePrefillConfig, blocksparse_attention_reference,
                                                choose_config, crow_col_to_dense, formula_block_mask,
                                                build_sparse_layout, plan_blocksparse_attention)
from harness import (DEVICE, FLOAT_DTYPES, GPU, JaxAdapter, TorchAdapter, assert_bitwise_equal,
                     assert_close, cast, requires_gpu, rng, to_jax, to_torch, torch_to_numpy)
import adapters.torch as at

H200 = Target("cuda", 90, 132, gluon=True)   # the plans the GPU tests run


# ------------------------------------------------------------------ helpers
def make_batch(lens_k, lens_q, hq, hkv, d, dtype, seed=None):
    g = rng(seed)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    cu_q = None if lens_q is None else np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    tq = len(lens_k) if lens_q is None else int(cu_q[-1])
    q = cast(g.standard_normal((tq, hq, d)), dtype)
    k = cast(g.standard_normal((int(cu_k[-1]), hkv, d)), dtype)
    v = cast(g.standard_normal((int(cu_k[-1]), hkv, d)), dtype)
    return q, k, v, cu_k, cu_q


def reference(q, k, v, cu_k, cu_q, block_mask, block_size, q_block_size=None, sm_scale=None):
    return blocksparse_attention_reference(q, k, v, cu_k, cu_q, block_mask, block_size=block_size,
                                           sm_scale=sm_scale, q_block_size=q_block_size)


def infos(q, k, v, cu_k, cu_q, crow, col):
    """ArrayInfos of numpy arrays (contiguous), in the planner's order."""
    return tuple(None if x is None else ArrayInfo.contiguous(np.shape(x), np.asarray(x).dtype.name)
                 for x in (q, k, v, cu_k, cu_q, crow, col))


def kernel_names(plan):
    return [launch.kernel.fn.__name__ for launch in plan.launches]


# (lens_k, lens_q): full prefill, prefill over a cached prefix, decode, mixed
MIXED = ([70, 33, 5, 100, 17], [70, 1, 3, 40, 17])

# name: (hq, hkv, d, block_size, local, stride, homo, head_range, q_block_size, lens)
CASES = {
    "prefill-homo": (4, 4, 32, 16, 2, 3, True, None, None, ([90, 50], None)),
    "perhead-gqa": (4, 2, 32, 16, 2, 3, False, None, None, ([90, 50], None)),
    "mixed-perhead": (4, 2, 32, 16, 2, 3, False, None, None, MIXED),
    "d40-nonpow2": (2, 1, 40, 16, 3, 2, False, None, None, MIXED),
    "d5-tiny": (2, 2, 5, 16, 1, 2, False, None, None, ([40, 9], [21, 9])),
    "qblock2x": (4, 2, 16, 16, 2, 3, False, None, 32, MIXED),
    "qblock4x": (2, 1, 16, 16, 1, 4, False, None, 64, ([100, 37], [60, 37])),
    "head-range": (3, 1, 16, 16, 2, 4, False, (2, 5), None, MIXED),
    "block32": (2, 2, 16, 32, 1, 2, False, None, None, ([150, 40], [150, 7])),
}


def case_inputs(name, dtype, seed=None):
    hq, hkv, d, bs, local, stride, homo, head_range, qbs, (lens_k, lens_q) = CASES[name]
    global_heads = hq if head_range is None else 8
    max_seqlen = max(lens_k)
    (crow, col), _ = build_sparse_layout(global_heads, max_seqlen, bs, local, stride, homo, head_range)
    heads = range(*(head_range or (0, hq)))
    nb = -(-max_seqlen // bs)
    block_mask = formula_block_mask(global_heads, nb, local, stride, homo, heads)
    q, k, v, cu_k, cu_q = make_batch(lens_k, lens_q, hq, hkv, d, dtype, seed)
    return (q, k, v, cu_k, cu_q), (crow, col), block_mask, dict(block_size=bs, q_block_size=qbs)


def random_user_layout(g, n_heads, nb):
    """Random per-head CSR: the diagonal, random lower blocks, a few (masked) upper blocks."""
    mask = g.random((n_heads, nb, nb)) < 0.35
    mask |= np.eye(nb, dtype=bool)[None]
    from core_kernels.blocksparse_attention import dense_to_crow_col
    return dense_to_crow_col(mask), mask


def decode_batch(batch, dtype, hq=4, hkv=2, d=24, seed=None, max_len=120):
    """A decode-only batch (one query per sequence, contexts of 1 .. max_len - 1
    tokens) over a 4-head 128-token layout."""
    g = rng(seed)
    lens = list(g.integers(1, max_len, batch))
    lens[0] = 1
    (crow, col), _ = build_sparse_layout(hq, 128, 16, 2, 3, False)
    q, k, v, cu_k, _ = make_batch(lens, None, hq, hkv, d, dtype, seed)
    return (q, k, v, cu_k, None), (crow, col), formula_block_mask(hq, 8, 2, 3, False)


def run_plan_torch(q, k, v, cu_k, crow, col, block_size, cu_q=None, **options):
    """Plan (for the test device's target, ``options`` such as config=) and run a
    plan through the torch executor; returns (numpy output, kernel names)."""
    from adapters.torch._executor import info, run_plan, target_for
    t = dict(q=to_torch(q), k=to_torch(k), v=to_torch(v), cu_seqlens_k=to_torch(cu_k),
             crow=to_torch(np.ascontiguousarray(crow)), col=to_torch(np.ascontiguousarray(col)))
    if cu_q is not None:
        t["cu_seqlens_q"] = to_torch(cu_q)
    plan = plan_blocksparse_attention(
        target_for(t["q"].device), *(info(t[n]) for n in ("q", "k", "v", "cu_seqlens_k")),
        None if cu_q is None else info(t["cu_seqlens_q"]), info(t["crow"]), info(t["col"]),
        block_size=block_size, **options)
    out = run_plan(plan, t, None, t["q"].device)["output"]
    return torch_to_numpy(out), kernel_names(plan)


def as_int64(*arrays):
    return tuple(None if a is None else np.asarray(a).astype(np.int64) for a in arrays)


def vllm_mask_expected(n_heads, q_len, max_seqlen, bs, local, stride, homo):
    """Independent numpy: (block mask [H or -, NB, NB], CSR rows as dense [H, nbq, NB],
    token mask [H, q_len, max_seqlen]) from the spec's formula, query i at
    absolute position max_seqlen - q_len + i."""
    nb = -(-max_seqlen // bs)
    formula = formula_block_mask(n_heads, nb, local, stride, homo)
    nbq = -(-q_len // bs)
    dense = np.zeros((n_heads, q_len, max_seqlen), bool)
    for i in range(q_len):
        p = max_seqlen - q_len + i
        for j in range(p + 1):
            dense[:, i, j] = formula[:, p // bs, j // bs]
    return (formula[0] if homo else formula), formula[:, nb - nbq:], dense


# ------------------------------------------------------------------ layout builder
@pytest.mark.parametrize("n_heads,max_seqlen,bs,local,stride,homo,head_range", [
    (4, 300, 16, 2, 3, True, None), (4, 300, 16, 2, 3, False, None), (32, 1000, 64, 16, 8, False, None),
    (6, 129, 32, 1, 5, False, (2, 5)), (3, 64, 64, 4, 4, False, None), (2, 1000, 16, 100, 7, False, None),
    (40, 2048, 64, 16, 8, False, (8, 16)),
], ids=str)
def test_layout_matches_formula(n_heads, max_seqlen, bs, local, stride, homo, head_range):
    (crow, col), block_mask = build_sparse_layout(n_heads, max_seqlen, bs, local, stride, homo,
                                                   head_range)
    nb = -(-max_seqlen // bs)
    heads = range(*(head_range or (0, n_heads)))
    np.testing.assert_array_equal(block_mask, formula_block_mask(n_heads, nb, local, stride, homo, heads))
    assert crow.shape == (len(heads), nb + 1) and crow.dtype == np.int32 and col.dtype == np.int32
    np.testing.assert_array_equal(crow_col_to_dense(crow, col), block_mask)
    for h in range(len(heads)):
        n = crow[h, -1]
        assert np.all(col[h, n:] == -1), "padding must be -1"
        for r in range(nb):
            row = col[h, crow[h, r]:crow[h, r + 1]]
            assert np.all(np.diff(row) > 0) and r in row, "columns ascending, diagonal present"
    assert col.shape[1] == crow[:, -1].max()
    again = build_sparse_layout(n_heads, max_seqlen, bs, local, stride, homo, head_range)
    assert again[1] is block_mask, "cached"
    with pytest.raises(ValueError):
        block_mask[0, 0, 0] = False  # read-only: the cache cannot be corrupted


def test_layout_fast():
    import time
    t0 = time.perf_counter()
    build_sparse_layout(32, 32768, 64, 16, 8, False, (0, 31))  # uncached: 31 x 512 x 512
    assert time.perf_counter() - t0 < 2.0, "the builder must be vectorised"


@pytest.mark.parametrize("kwargs,name", [
    (dict(n_heads=0), "n_heads"), (dict(block_size=-1), "block_size"), (dict(vert_stride=0), "vert_stride"),
    (dict(active_head_range=(3, 2)), "active_head_range"), (dict(active_head_range=(0, 9)), "active_head_range"),
    (dict(local_blocks=1.5), "local_blocks"),
])
def test_layout_errors(kwargs, name):
    args = dict(n_heads=4, max_seqlen=128, block_size=16, local_blocks=2, vert_stride=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        build_sparse_layout(**args)


def test_vllm_mask_parts_and_sliding_step():
    """The core numpy parts of vLLM's get_sparse_attn_mask; get_head_sliding_step."""
    from core_kernels.blocksparse_attention import get_head_sliding_step, vllm_sparse_attn_mask
    for args in ((4, 100, 100, 16, 2, 3, False), (3, 40, 100, 32, 1, 2, True), (5, 64, 64, 16, 4, 8, False)):
        n, q_len, ms, bs, local, stride, homo = args
        (crow, col), block, dense = vllm_sparse_attn_mask(n, q_len, ms, bs, local, stride, homo, True)
        want_block, want_rows, want_dense = vllm_mask_expected(*args)
        np.testing.assert_array_equal(block, want_block)
        assert crow.dtype == col.dtype == np.int64 and crow.shape[0] == col.shape[0] == n
        np.testing.assert_array_equal(crow_col_to_dense(crow, col, block.shape[-1])[:, :crow.shape[1] - 1],
                                      want_rows)
        np.testing.assert_array_equal(dense, want_dense)
        assert vllm_sparse_attn_mask(n, q_len, ms, bs, local, stride, homo)[2] is None
    for n, stride, homo, step in ((32, 8, False, 1), (4, 8, False, 2), (3, 8, False, 2), (4, 8, True, 0),
                                  (16, 64, False, 4), (1, 1, False, 1)):
        assert get_head_sliding_step(n, stride, homo) == step
        assert at.get_head_sliding_step(n, stride, homo) == step
    assert get_head_sliding_step(4, 8) == 2, "homo_head defaults to False"
    with pytest.raises(ValueError, match="q_len"):
        vllm_sparse_attn_mask(2, 65, 64)


def test_index_dtypes_in_plans():
    """int32 and int64 index arrays plan (each as given); other types name the argument."""
    (q, k, v, cu_k, cu_q), (crow, col), _, opts = case_inputs("mixed-perhead", "float32")
    base = infos(q, k, v, cu_k, cu_q, crow, col)
    for pos in (3, 4, 5, 6):
        for dtype in ("int64", "int32"):
            args = list(base)
            args[pos] = ArrayInfo.contiguous(args[pos].shape, dtype)
            assert plan_blocksparse_attention(Target.interpreter(), *args, **opts).launches
        args = list(base)
        args[pos] = ArrayInfo.contiguous(args[pos].shape, "int16")
        name = ("cu_seqlens_k", "cu_seqlens_q", "sparse_layout (crow)", "sparse_layout (col)")[pos - 3]
        with pytest.raises(TypeError, match=re.escape(name)):
            plan_blocksparse_attention(Target.interpreter(), *args, **opts)


# ------------------------------------------------------------------ plans (no kernels run)
def test_decode_splits_follow_the_sm_count():
    """Split counts aim at a number of programs per SM: another device, another choice."""
    # per-head decode (1 sequence x 8 KV heads: too few programs to pack), rows of at
    # most 100 blocks: splits = min(max(6 * SMs // (B * Hq), 100 / 8), 100 / 2, 64)
    q, k = ArrayInfo.contiguous((1, 32, 128), "bfloat16"), ArrayInfo.contiguous((4096, 8, 128), "bfloat16")
    args = (q, k, k, ArrayInfo.contiguous((2,), "int32"), None,
            ArrayInfo.contiguous((32, 257), "int32"), ArrayInfo.contiguous((32, 100), "int32"))
    for sms, splits in ((132, 24), (66, 13), (264, 49), (8, 13)):
        plan = plan_blocksparse_attention(Target.interpreter(sms), *args, block_size=64)
        assert kernel_names(plan) == ["_bsattn_decode_kernel"]  # the splits merge in the launch
        assert plan.launches[0].constexprs["NUM_SPLITS"] == splits, sms
        assert plan.launches[0].grid == (32 * splits,)
        assert choose_config(Target.interpreter(sms), *args, block_size=64) == BlocksparseDecodeConfig(splits)
    # GQA-packed decode (64 x 8 KV heads, 64 key blocks): splits = 4 * SMs / 512 programs
    q = ArrayInfo.contiguous((64, 32, 128), "bfloat16")
    k = ArrayInfo.contiguous((64 * 4096, 8, 128), "bfloat16")
    (crow, col), _ = build_sparse_layout(32, 4096, 64, 16, 8, False)
    args = (q, k, k, ArrayInfo.contiguous((65,), "int32"), None, ArrayInfo.contiguous(crow.shape, "int32"),
            ArrayInfo.contiguous(col.shape, "int32"))
    for sms, splits in ((132, 2), (33, 1), (528, 4)):
        plan = plan_blocksparse_attention(Target.interpreter(sms), *args, block_size=64)
        assert kernel_names(plan) == ["_bsattn_decode_group_kernel"]
        assert plan.launches[0].constexprs["NUM_SPLITS"] == splits, sms
        assert plan.buffers["counters"].placeholder == (splits == 1)


def test_config_selects_the_variant():
    (q, k, v, cu_k, _), (crow, col), _ = decode_batch(3, "float32")
    args = infos(q, k, v, cu_k, None, crow, col)
    cases = [(None, ["_bsattn_decode_kernel"]),
             (BlocksparsePrefillConfig(16, 16), ["_bsattn_fwd_kernel"]),
             (BlocksparseDecodeConfig(1), ["_bsattn_decode_kernel"]),
             (BlocksparseGroupDecodeConfig(2, 4), ["_bsattn_decode_group_kernel"])]
    for config, names in cases:
        plan = plan_blocksparse_attention(Target.interpreter(), *args, block_size=16, config=config)
        assert kernel_names(plan) == names, config
    plan = plan_blocksparse_attention(Target.interpreter(), *args, block_size=16,
                                      config=BlocksparseDecodeConfig(5, num_warps=8, num_stages=3))
    assert (plan.launches[0].num_warps, plan.launches[0].num_stages) == (8, 3)
    assert plan.launches[0].constexprs["NUM_SPLITS"] == 5
    # the measured rule's config of a variant (a starting point for tuning sweeps)
    group = choose_config(Target.interpreter(), *args, block_size=16, variant=BlocksparseGroupDecodeConfig)
    assert isinstance(group, BlocksparseGroupDecodeConfig)


@pytest.mark.parametrize("config,match", [
    (BlocksparsePrefillConfig(32, 16), "block_m"),          # a query tile beyond the layout row
    (BlocksparsePrefillConfig(16, 8), "block_n"),           # below tl.dot's 16
    (BlocksparseGroupDecodeConfig(2, 3), "chunk"),
    (BlocksparseGroupDecodeConfig(2, 64), "chunk"),
    (BlocksparseDecodeConfig(0), "splits"),
    (BlocksparseDecodeConfig(2, num_warps=3), "num_warps"),
], ids=str)
def test_config_errors(config, match):
    (q, k, v, cu_k, _), (crow, col), _ = decode_batch(3, "float32")
    with pytest.raises(ValueError, match=match):
        plan_blocksparse_attention(Target.interpreter(), *infos(q, k, v, cu_k, None, crow, col),
                                   block_size=16, config=config)


@pytest.mark.parametrize("config", [BlocksparseDecodeConfig(2), BlocksparseGroupDecodeConfig(2, 4)],
                         ids=str)
@pytest.mark.parametrize("inputs", ["prefill", "q_block_size"])
def test_decode_configs_refuse_other_batches(config, inputs):
    if inputs == "prefill":
        (q, k, v, cu_k, cu_q), (crow, col), _, opts = case_inputs("mixed-perhead", "float32")
    else:  # a decode-only batch, but q blocks of two layout rows
        (q, k, v, cu_k, cu_q), (crow, col), _ = decode_batch(3, "float32")
        opts = dict(block_size=16, q_block_size=32)
    with pytest.raises(ValueError, match=f"config: {type(config).__name__} runs decode-only"):
        plan_blocksparse_attention(Target.interpreter(), *infos(q, k, v, cu_k, cu_q, crow, col),
                                   **opts, config=config)
    with pytest.raises(ValueError, match="decode-only"):
        choose_config(Target.interpreter(), *infos(q, k, v, cu_k, cu_q, crow, col), **opts,
                      variant=type(config))
    with pytest.raises(TypeError, match="config"):
        plan_blocksparse_attention(Target.interpreter(), *infos(q, k, v, cu_k, cu_q, crow, col),
                                   **opts, config=("splits", 2))


def test_gpu_test_plans_build():
    """The plans the GPU tests below run, made for the H200 here (no kernels run)."""
    (crow, col), _ = build_sparse_layout(32, 4096, 64, 16, 8, False)
    q, k, v, cu_k, cu_q = make_batch([2048, 1500, 900, 4096], [2048, 1, 333, 1], 32, 8, 128, "float16")
    plan = plan_blocksparse_attention(H200, *infos(q, k, v, cu_k, cu_q, crow, col), block_size=64,
                                      max_seqlen=4096)
    assert kernel_names(plan) == ["_bsattn_fwd_kernel"]
    q, k, v, cu_k, _ = make_batch([4000], None, 32, 8, 128, "float16")
    plan = plan_blocksparse_attention(H200, *infos(q, k, v, cu_k, None, crow, col), block_size=64)
    assert kernel_names(plan) == ["_bsattn_decode_kernel"]
    q, k, v, cu_k, _ = make_batch([4096, 1, 64, 65, 1000, 3000, 4095, 2049], None, 32, 8, 128, "float16")
    plan = plan_blocksparse_attention(H200, *infos(q, k, v, cu_k, None, crow, col), block_size=64)
    assert kernel_names(plan) == ["_bsattn_decode_group_kernel"]
    (crow, col), _ = build_sparse_layout(32, 2048, 64, 16, 8, False)
    for lens_q in (None, [700, 300]):
        q, k, v, cu_k, cu_q = make_batch([700, 1300], lens_q, 32, 8, 128, "float16")
        plan = plan_blocksparse_attention(H200, *infos(q, k, v, cu_k, cu_q, crow, col), block_size=64,
                                          max_seqlen=2048)
        assert plan.launches


# GQA-packed decode: one program per KV head walks the union of its query heads' rows.
# (hq, hkv, d, block_size, layout, config: None = the rule's grouped config)
GROUP_DECODE_CASES = {
    "G4-perhead-default": (8, 2, 24, 16, "perhead", None),
    "G3-user-chunk2-sub": (6, 2, 16, 16, "user", BlocksparseGroupDecodeConfig(3, 2)),
    "G24-two-headblocks": (24, 1, 16, 16, "perhead", BlocksparseGroupDecodeConfig(1, 4)),
    "G1-forced-bs128": (2, 2, 16, 128, "perhead", BlocksparseGroupDecodeConfig(2, 2)),
}


@pytest.mark.parametrize("case", list(GROUP_DECODE_CASES))
def test_decode_group_packed(case):
    hq, hkv, d, bs, kind, config = GROUP_DECODE_CASES[case]
    g = rng()
    nb = 8 if bs == 16 else 3
    lens = [1, nb * bs, 17, int(g.integers(2, nb * bs))]
    if kind == "user":
        (crow, col), mask = random_user_layout(g, hq, nb)
    else:
        (crow, col), _ = build_sparse_layout(hq, nb * bs, bs, 2, 3, False)
        mask = formula_block_mask(hq, nb, 2, 3, False)
    q, k, v, cu_k, _ = make_batch(lens, None, hq, hkv, d, "float32")
    if config is None:
        config = choose_config(Target.interpreter(), *infos(q, k, v, cu_k, None, crow, col),
                               block_size=bs, variant=BlocksparseGroupDecodeConfig)
    out, names = run_plan_torch(q, k, v, cu_k, crow, col, bs, config=config)
    assert "_bsattn_decode_group_kernel" in names
    assert_close(out, reference(q, k, v, cu_k, None, mask, bs), "float32", case, scale=2.0)


@pytest.mark.parametrize("config,hq,hkv,merge_values", [
    (BlocksparseDecodeConfig(4), 4, 2, None),
    (BlocksparseGroupDecodeConfig(3, 2), 4, 2, None),
    # 6 heads in a block of 8, merged 2 per round of loads (the last round empty)
    (BlocksparseGroupDecodeConfig(3, 2), 6, 1, 128),
    (BlocksparseGroupDecodeConfig(2, 4), 6, 1, 1),           # one head per round
], ids=str)
def test_decode_merges_in_its_launch_and_leaves_counters_zero(config, hq, hkv, merge_values, monkeypatch,
                                                              request):
    """Split decode is one launch: the last split of a row (or of a packed
    program's heads) merges the partials, and every ticket counter is zero
    again afterwards (the next call on the stream reuses them, Buffer.per_stream).
    Run twice over fresh inputs into poisoned scratch: nothing one call leaves
    behind but zeros may matter."""
    from adapters.torch._executor import info, run_plan, target_for
    from core_kernels.blocksparse_attention import plan as bs_plan
    if merge_values is not None:  # plans made under the patch leave the cache with it
        monkeypatch.setattr(bs_plan, "MERGE_VALUES", merge_values)
        plan_blocksparse_attention.cache_clear()
        request.addfinalizer(plan_blocksparse_attention.cache_clear)
    for seed in (None, None):
        (q, k, v, cu_k, _), (crow, col), mask = decode_batch(6, "float32", hq=hq, hkv=hkv, d=16, seed=seed)
        t = dict(q=to_torch(q), k=to_torch(k), v=to_torch(v), cu_seqlens_k=to_torch(cu_k),
                 crow=to_torch(np.ascontiguousarray(crow)), col=to_torch(np.ascontiguousarray(col)))
        plan = plan_blocksparse_attention(target_for(t["q"].device), *(info(t[n]) for n in (
            "q", "k", "v", "cu_seqlens_k")), None, info(t["crow"]), info(t["col"]), block_size=16,
            config=config)
        c = plan.launches[0].constexprs
        assert len(plan.launches) == 1 and c["NUM_SPLITS"] > 1
        if merge_values is not None:
            assert c["MERGE_HEADS"] == {128: 2, 1: 1}[merge_values] and c["HEADS"] == 8
        counters, partials = plan.buffers["counters"], plan.buffers["partials"]
        assert counters.zero_init and counters.per_stream and partials.per_stream
        assert not {"counters", "partials"} & set(plan.results)
        env = run_plan(plan, t, None, t["q"].device)
        assert_close(torch_to_numpy(env["output"]), reference(q, k, v, cu_k, None, mask, 16),
                     "float32", str(config), scale=2.0)
        assert not torch.any(env["counters"] != 0), "ticket counters left non-zero"
        env["partials"].fill_(float("nan"))   # what a later call finds there


@requires_gpu
def test_gpu_decode_scratch_per_stream():
    """The torch executor keeps a split decode's scratch per stream: calls on one
    stream share it, another stream gets its own, and a CUDA graph capture
    allocates its own (the graph keeps the address)."""
    from adapters.torch._executor import info, run_plan, target_for
    (q, k, v, cu_k, _), (crow, col), mask = decode_batch(6, "bfloat16", hq=4, hkv=2, d=16)
    t = dict(q=to_torch(q), k=to_torch(k), v=to_torch(v), cu_seqlens_k=to_torch(cu_k),
             crow=to_torch(np.ascontiguousarray(crow)), col=to_torch(np.ascontiguousarray(col)))
    plan = plan_blocksparse_attention(target_for(t["q"].device), *(info(t[n]) for n in (
        "q", "k", "v", "cu_seqlens_k")), None, info(t["crow"]), info(t["col"]), block_size=16,
        config=BlocksparseDecodeConfig(4))
    ptrs = lambda env: (env["partials"].data_ptr(), env["counters"].data_ptr())  # noqa: E731
    first = run_plan(plan, t, None, t["q"].device)
    first["partials"].fill_(float("nan"))
    second = run_plan(plan, t, None, t["q"].device)
    assert ptrs(first) == ptrs(second)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        other = run_plan(plan, t, None, t["q"].device)
    torch.cuda.current_stream().wait_stream(side)
    assert not set(ptrs(other)) & set(ptrs(first))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run_plan(plan, t, None, t["q"].device)
    assert not set(ptrs(captured)) & (set(ptrs(first)) | set(ptrs(other)))
    captured["output"].fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref = reference(q, k, v, cu_k, None, mask, 16)
    assert_close(torch_to_numpy(first["output"]), ref, "bfloat16", "first call")
    for env in (second, other, captured):
        assert torch.equal(env["output"], first["output"])
        assert not torch.any(env["counters"] != 0)

# ------------------------------------------------------------------ the adapters
def _bad_cases():
    q, k, v, cu_k, cu_q = make_batch([40, 20], [40, 5], 4, 2, 16, "float32")
    (crow, col), _ = build_sparse_layout(4, 64, 16, 2, 2, False)
    (crow3, col3), _ = build_sparse_layout(3, 64, 16, 2, 2, False)
    base = dict(q=q, k=k, v=v, cu_k=cu_k, cu_q=cu_q, crow=crow, col=col, bs=16, qbs=None, ms=None)
    return base, [
        ("sparse_layout", dict(crow=crow3, col=col3)),                  # 3 layout heads vs Hq = 4
        ("Hq % Hkv", dict(k=k[:, :1].repeat(3, 1), v=v[:, :1].repeat(3, 1))),
        ("q_block_size", dict(qbs=24)),
        ("v: shape", dict(v=v[:, :1])),
        ("cu_seqlens_q", dict(cu_q=cu_q[:2])),
        ("cu_seqlens_k", dict(cu_k=cu_k.astype(np.float32))),
        ("cu_seqlens_q", dict(q=q[:7])),                                 # neither B nor Tk tokens, no cu_q
        ("k: dtype", dict(k=k.astype(np.float16))),
        ("head size", dict(q=np.zeros((45, 4, 300), np.float32), k=np.zeros((60, 2, 300), np.float32),
                           v=np.zeros((60, 2, 300), np.float32))),
        ("max_seqlen", dict(ms=100)),
        ("block_size", dict(bs=48)),
    ]


class BlocksparseTests:
    """Every adapter test, written once; a subclass per adapter implements
    ``attend`` and ``module_cls`` (and may add framework-only tests)."""
    module_cls = None  # the adapter's LocalStridedBlockSparseAttn

    def attend(self, q, k, v, cu_k, cu_q, layout, *, block_size, q_block_size=None, max_seqlen=None,
               sm_scale=None, config=None):
        """numpy inputs -> numpy output of blocksparse_flash_attn_varlen_fwd through this adapter."""
        raise NotImplementedError

    @pytest.mark.parametrize("dtype", FLOAT_DTYPES)
    @pytest.mark.parametrize("case", list(CASES))
    def test_matches_reference(self, dtype, case):
        (q, k, v, cu_k, cu_q), layout, block_mask, opts = case_inputs(case, dtype)
        out = self.attend(q, k, v, cu_k, cu_q, layout, **opts)
        ref = reference(q, k, v, cu_k, cu_q, block_mask, **opts)
        assert out.dtype == q.dtype
        assert_close(out, ref, dtype, case, scale=2.0)

    @pytest.mark.parametrize("dtype", FLOAT_DTYPES)
    def test_empty_sequences_mid_batch(self, dtype):
        """Sequences without keys (and so without queries) and with keys but no
        queries, between and after live ones; the reference (which needs a
        non-empty score matrix) runs on the live sequences alone."""
        lens_k, lens_q = [40, 0, 33, 20, 0, 17, 0], [40, 0, 0, 5, 0, 17, 0]
        hq, hkv, d, bs = 4, 2, 16, 16
        nb = -(-max(lens_k) // bs)
        (crow, col), _ = build_sparse_layout(hq, max(lens_k), bs, 2, 3, False)
        block_mask = formula_block_mask(hq, nb, 2, 3, False)
        q, k, v, cu_k, cu_q = make_batch(lens_k, lens_q, hq, hkv, d, dtype)
        out = self.attend(q, k, v, cu_k, cu_q, (crow, col), block_size=bs)
        assert out.shape == q.shape and out.dtype == q.dtype
        live = [i for i, n in enumerate(lens_q) if n]
        pick = lambda x, cu: np.concatenate([x[cu[i]:cu[i + 1]] for i in live])  # noqa: E731
        lk, lq = [lens_k[i] for i in live], [lens_q[i] for i in live]
        ref = reference(pick(q, cu_q), pick(k, cu_k), pick(v, cu_k),
                        np.concatenate([[0], np.cumsum(lk)]).astype(np.int32),
                        np.concatenate([[0], np.cumsum(lq)]).astype(np.int32), block_mask, block_size=bs)
        assert_close(out, ref, dtype, "live sequences", scale=2.0)

    # the one-split batch (enough sequences to fill 132 SMs without splits) is
    # slow under the interpreter: one dtype (split-kv covers the others)
    @pytest.mark.parametrize("dtype,batch", [(dt, 3) for dt in FLOAT_DTYPES] + [("float32", 70)],
                             ids=[f"split-kv-{dt}" for dt in FLOAT_DTYPES] + ["one-split-float32"])
    def test_decode_only(self, dtype, batch):
        (q, k, v, cu_k, _), layout, mask = decode_batch(batch, dtype, max_len=120 if batch < 16 else 40)
        assert q.shape[0] == batch
        out = self.attend(q, k, v, cu_k, None, layout, block_size=16, sm_scale=0.3)
        ref = reference(q, k, v, cu_k, None, mask, 16, sm_scale=0.3)
        assert_close(out, ref, dtype, "decode", scale=2.0)

    @pytest.mark.parametrize("config", [
        BlocksparsePrefillConfig(16, 16, 4, 2),          # the prefill kernel on a decode batch
        BlocksparseDecodeConfig(1), BlocksparseDecodeConfig(4, num_warps=4),
        BlocksparseGroupDecodeConfig(1, 32), BlocksparseGroupDecodeConfig(3, 2, num_stages=2),
    ], ids=str)
    def test_decode_configs(self, config):
        """Every variant and split of a decode-only batch through ``config=``."""
        (q, k, v, cu_k, _), layout, mask = decode_batch(5, "float32")
        out = self.attend(q, k, v, cu_k, None, layout, block_size=16, config=config)
        assert_close(out, reference(q, k, v, cu_k, None, mask, 16), "float32", str(config), scale=2.0)

    @pytest.mark.parametrize("case,config", [("mixed-perhead", BlocksparsePrefillConfig(16, 16)),
                                             ("block32", BlocksparsePrefillConfig(32, 16)),
                                             ("block32", BlocksparsePrefillConfig(16, 16, 2, 1))], ids=str)
    def test_prefill_tile_configs(self, case, config):
        """Query tiles of a whole layout row or part of one (block_m <= block_size),
        K/V sub-blocks (block_n < block_size)."""
        (q, k, v, cu_k, cu_q), layout, block_mask, opts = case_inputs(case, "float32")
        out = self.attend(q, k, v, cu_k, cu_q, layout, **opts, config=config)
        assert_close(out, reference(q, k, v, cu_k, cu_q, block_mask, opts["block_size"]), "float32",
                     str(config))

    def test_config_errors(self):
        (q, k, v, cu_k, cu_q), layout, _, opts = case_inputs("mixed-perhead", "float32")
        with pytest.raises(ValueError, match="decode-only"):
            self.attend(q, k, v, cu_k, cu_q, layout, **opts, config=BlocksparseDecodeConfig(2))
        with pytest.raises(TypeError, match="config"):
            self.attend(q, k, v, cu_k, cu_q, layout, **opts, config=("splits", 2))

    @pytest.mark.parametrize("qbs", [None, 32])
    def test_user_supplied_layout(self, qbs):
        g = rng()
        (crow, col), mask = random_user_layout(g, 4, 8)
        for lens_q in (MIXED[1], None):
            lens_k = MIXED[0] if lens_q is not None else [60, 3, 128, 77]
            q, k, v, cu_k, cu_q = make_batch(lens_k, lens_q, 4, 4, 16, "float32")
            out = self.attend(q, k, v, cu_k, cu_q, (crow, col), block_size=16, q_block_size=qbs)
            ref = reference(q, k, v, cu_k, cu_q, mask, 16, q_block_size=qbs)
            assert_close(out, ref, "float32", "user layout", scale=2.0)

    def test_broadcast_layout_and_scale(self):
        (crow, col), _ = build_sparse_layout(1, 128, 16, 2, 3, True)
        q, k, v, cu_k, cu_q = make_batch(*MIXED, 4, 1, 32, "float16")
        out = self.attend(q, k, v, cu_k, cu_q, (crow[0], col[0]), block_size=16, sm_scale=0.05)
        ref = reference(q, k, v, cu_k, cu_q, formula_block_mask(1, 8, 2, 3), 16, sm_scale=0.05)
        assert_close(out, ref, "float16", "1-D layout broadcast")

    def test_empty_batch(self):
        (crow, col), _ = build_sparse_layout(2, 64, 16, 2, 2)
        q, k, v, cu_k, cu_q = make_batch([0], [0], 2, 2, 16, "float32")
        out = self.attend(q, k, v, cu_k, cu_q, (crow, col), block_size=16)
        assert out.shape == (0, 2, 16)

    def test_module(self):
        attn = self.module_cls(8, 128, 2, 4, 16, homo_head=False, active_head_range=(4, 8), q_block_size=32)
        q, k, v, cu_k, cu_q = make_batch(*MIXED, 4, 2, 16, "float32")
        out = self.numpy(attn(*map(self.array, (q, k, v, cu_k, cu_q))))
        mask = formula_block_mask(8, 8, 2, 4, False, range(4, 8))
        assert_close(out, reference(q, k, v, cu_k, cu_q, mask, 16, q_block_size=32), "float32", "module")
        # config= per call: the prefill kernel with other tiles
        out = self.numpy(attn(*map(self.array, (q, k, v, cu_k, cu_q)),
                              config=BlocksparsePrefillConfig(16, 16, 2, 1)))
        assert_close(out, reference(q, k, v, cu_k, cu_q, mask, 16, q_block_size=32), "float32", "config")

    @pytest.mark.parametrize("case", range(11))
    def test_errors_name_the_argument(self, case):
        base, cases = _bad_cases()
        name, repl = cases[case]
        a = {**base, **repl}
        if name == "cu_seqlens_q" and "q" in repl:
            a["cu_q"] = None
        with pytest.raises((ValueError, TypeError), match=name):
            self.attend(a["q"], a["k"], a["v"], a["cu_k"], a["cu_q"], (a["crow"], a["col"]),
                        block_size=a["bs"], q_block_size=a["qbs"], max_seqlen=a["ms"])

    def test_module_errors(self):
        with pytest.raises(ValueError, match="q_block_size"):
            self.module_cls(4, 128, 2, 3, 16, q_block_size=40)
        with pytest.raises(ValueError, match="active_head_range"):
            self.module_cls(4, 128, 2, 3, 16, active_head_range=(0, 5))


    # ---- int64 indices and vLLM's surface
    ops = None               # the adapter module

    def x64(self):
        """A context in which int64 arrays stay int64 (JAX: jax_enable_x64)."""
        return contextlib.nullcontext()

    def fdtype(self, name):
        raise NotImplementedError

    # CPU: the q-block case's index arithmetic is the prefill case's (kept on the GPU)
    @pytest.mark.parametrize("case", ["mixed-perhead", "decode", "decode-packed"] + (["qblock2x"] if GPU else []))
    def test_int64_indices(self, case):
        """int64 cu_seqlens and CSR (vLLM's layouts are int64): bitwise the int32 result."""
        config = None
        if case.startswith("decode"):
            (q, k, v, cu_k, cu_q), (crow, col), mask = decode_batch(3, "float32")
            opts = dict(block_size=16)
            config = BlocksparseGroupDecodeConfig(2, 4) if case == "decode-packed" else None
        else:
            (q, k, v, cu_k, cu_q), (crow, col), mask, opts = case_inputs(case, "float32")
        out32 = self.attend(q, k, v, cu_k, cu_q, (crow, col), **opts, config=config)
        with self.x64():
            cu_k64, cu_q64, crow64, col64 = as_int64(cu_k, cu_q, crow, col)
            assert self.array(cu_k64).dtype == self.array(crow64).dtype == self.index_dtype64
            out64 = self.attend(q, k, v, cu_k64, cu_q64, (crow64, col64), **opts, config=config)
            mixed = self.attend(q, k, v, cu_k, cu_q64, (crow64, col), **opts, config=config)
        assert_bitwise_equal(out64, out32, case)
        assert_bitwise_equal(mixed, out32, case + " mixed widths")
        assert_close(out64, reference(q, k, v, cu_k, cu_q, mask, opts["block_size"],
                                      q_block_size=opts.get("q_block_size")), "float32", case, scale=2.0)

    @pytest.mark.parametrize("args", [
        (4, 128, 128, 16, 2, 3, False, "binary"), (4, 50, 100, 16, 2, 3, False, "bias"),
        (3, 100, 100, 32, 1, 2, True, "bias"), (2, 7, 64, 16, 3, 2, True, "binary"),
    ], ids=str)
    def test_get_sparse_attn_mask_vllm(self, args):
        """vLLM's get_sparse_attn_mask: positional order, result structure, dtypes."""
        n, q_len, ms, bs, local, stride, homo, kind = args
        want_block, want_rows, want_dense = vllm_mask_expected(n, q_len, ms, bs, local, stride, homo)
        with self.x64():
            (crow, col), block, dense = self.ops.get_sparse_attn_mask(
                n, q_len, ms, self.fdtype("float16"), self.device, bs, local, stride, homo, True, kind)
            assert crow.dtype == col.dtype == self.index_dtype64
        assert block.dtype == dense.dtype == self.fdtype("float16")
        crow, col, block, dense = map(self.numpy, (crow, col, block, dense))
        nb, nbq = -(-ms // bs), -(-q_len // bs)
        assert crow.shape == (n, nbq + 1) and col.shape[0] == n
        np.testing.assert_array_equal(block, want_block.astype(np.float16))
        np.testing.assert_array_equal(crow_col_to_dense(crow, col, nb)[:, :nbq], want_rows)
        assert np.all(col[np.arange(col.shape[1])[None, :] >= crow[:, -1:]] == -1), "padded with -1"
        expect = np.where(want_dense, 1.0, 0.0) if kind == "binary" else np.where(want_dense, 0.0, -np.inf)
        np.testing.assert_array_equal(dense.astype(np.float64), expect)
        # defaults: block_size 64, local 4, stride 4, homo, no dense mask
        (crow, col), block, dense = self.ops.get_sparse_attn_mask(2, 300, 300, self.fdtype("float32"),
                                                                  self.device)
        assert dense is None and tuple(block.shape) == (5, 5)
        np.testing.assert_array_equal(self.numpy(block), formula_block_mask(1, 5, 4, 4)[0].astype(np.float32))

    def test_get_sparse_attn_mask_errors(self):
        with pytest.raises(ValueError, match="dense_mask_type"):
            self.ops.get_sparse_attn_mask(2, 64, 64, self.fdtype("float32"), self.device,
                                          dense_mask_type="additive")
        with pytest.raises(ValueError, match="q_len"):
            self.ops.get_sparse_attn_mask(2, 65, 64, self.fdtype("float32"), self.device)

    def test_module_vllm_surface(self):
        """vLLM's constructor, attributes, get_attn_pattern, varlen_attn / forward."""
        attn = self.module_cls(8, 128, 2, 4, 16, self.device, None, False, (4, 8))
        assert (attn.n_heads, attn.max_seqlen, attn.local_blocks, attn.vert_stride, attn.block_size) == \
            (8, 128, 2, 4, 16)
        assert (attn.homo_head, attn.active_head_range, attn.q_block_size, attn.use_spda) == \
            (False, (4, 8), None, False)
        assert attn.head_sliding_step == 1 and attn.dense_attn_mask is None
        assert attn.dtype == self.fdtype("bfloat16")
        crow, col = map(self.numpy, attn.sparse_layout)
        formula = formula_block_mask(8, 8, 2, 4, False)
        np.testing.assert_array_equal(crow_col_to_dense(crow, col, 8), formula[4:])
        with self.x64():
            (pcrow, pcol), pattern, dense = attn.get_attn_pattern(self.fdtype("float32"), self.device)
        assert dense is None and tuple(pattern.shape) == (8, 8, 8) and tuple(pcrow.shape) == (4, 9)
        np.testing.assert_array_equal(self.numpy(pattern), formula.astype(np.float32))
        np.testing.assert_array_equal(crow_col_to_dense(self.numpy(pcrow), self.numpy(pcol), 8), formula[4:])
        q, k, v, cu_k, cu_q = make_batch(*MIXED, 4, 2, 16, "float32")
        ref = reference(q, k, v, cu_k, cu_q, formula[4:], 16, sm_scale=0.2)
        with self.x64():
            args = [self.array(x) for x in (q, k, v, *as_int64(cu_k, cu_q))]
            out = self.numpy(attn.varlen_attn(*args, sm_scale=0.2))
            assert_bitwise_equal(self.numpy(attn.forward(*args, sm_scale=0.2)), out, "forward")
        assert_close(out, ref, "float32", "varlen_attn")

    def test_module_spda(self):
        """use_spda=True: the dense fallback (prefill only) against the reference."""
        attn = self.module_cls(6, 128, 2, 3, 16, self.device, self.fdtype("float32"), False, (2, 6),
                               use_spda=True)
        assert attn.use_spda and tuple(attn.dense_attn_mask.shape) == (4, 128, 128)
        q, k, v, cu_k, _ = make_batch([70, 33, 100, 1], None, 4, 2, 16, "float32")
        q = cast(rng().standard_normal((k.shape[0], 4, 16)), "float32")
        mask = formula_block_mask(6, 8, 2, 3, False)[2:]
        args = [self.array(x) for x in (q, k, v, cu_k)]
        out = self.numpy(attn(*args))
        assert_close(out, reference(q, k, v, cu_k, None, mask, 16), "float32", "spda", scale=4.0)
        out = self.numpy(attn.spda(*args, cu_seqlens_q=args[3], sm_scale=0.3))
        assert_close(out, reference(q, k, v, cu_k, None, mask, 16, sm_scale=0.3), "float32", "spda",
                     scale=4.0)
        half = [self.array(x) for x in (cast(q, "float16"), cast(k, "float16"), cast(v, "float16"))]
        out = self.numpy(attn.spda(*half, args[3]))                       # the mask follows q's dtype
        assert out.dtype == np.float16
        assert_close(out, reference(cast(q, "float16"), cast(k, "float16"), cast(v, "float16"), cu_k, None,
                                    mask, 16), "float16", "spda fp16", scale=4.0)
        with pytest.raises(ValueError, match="prefill"):
            attn.spda(args[0][:4], *args[1:])
        with pytest.raises(ValueError, match="config"):
            attn(*args, config=BlocksparsePrefillConfig(16, 16))

    def test_transpose_and_pad_unpad(self):
        g = rng()
        lens = [5, 0, 9, 3]
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        x = cast(g.standard_normal((cu[-1], 3, 4)), "float32")
        padded = self.numpy(self.module_cls.transpose_and_pad(self.array(x), self.array(cu), 10, 2))
        want = np.zeros((4, 6, 10, 4), np.float32)
        for i, n in enumerate(lens):
            for h in range(6):
                want[i, h, :n] = x[cu[i]:cu[i + 1], h // 2]
        assert_bitwise_equal(padded, want, "transpose_and_pad")
        back = self.module_cls.transpose_and_unpad(self.array(want[:, ::2].copy()), self.array(cu))
        assert_bitwise_equal(self.numpy(back), x, "transpose_and_unpad")


class TestTorch(TorchAdapter, BlocksparseTests):
    module_cls = at.LocalStridedBlockSparseAttn
    ops = at
    device = DEVICE
    index_dtype64 = torch.int64

    def fdtype(self, name):
        return getattr(torch, name)

    def test_get_sparse_attn_mask_homo_views(self):
        """homo_head: crow/col/dense expanded over the heads (as vLLM's), on the device."""
        (crow, col), block, dense = at.get_sparse_attn_mask(4, 64, 64, torch.float32, DEVICE, 16, 2, 3,
                                                            True, True, "bias")
        assert crow.stride(0) == col.stride(0) == dense.stride(0) == 0
        assert crow.device.type == block.device.type == dense.device.type == torch.device(DEVICE).type

    def attend(self, q, k, v, cu_k, cu_q, layout, *, block_size, q_block_size=None, max_seqlen=None,
               sm_scale=None, config=None):
        crow, col = (np.ascontiguousarray(x) for x in layout)
        # poison: the caching allocator hands this NaN block back to the op's output
        poison = torch.full(q.shape, float("nan"), dtype=to_torch(q[:0]).dtype, device=DEVICE)
        del poison
        out = at.blocksparse_flash_attn_varlen_fwd(
            to_torch(q), to_torch(k), to_torch(v), to_torch(cu_k),
            None if cu_q is None else to_torch(cu_q), sm_scale, (to_torch(crow), to_torch(col)),
            block_size=block_size, q_block_size=q_block_size, max_seqlen=max_seqlen, config=config)
        return torch_to_numpy(out)

    def test_compile_fullgraph(self):
        attn = at.LocalStridedBlockSparseAttn(4, 128, 2, 3, 16, device=DEVICE)
        q, k, v, cu_k, cu_q = make_batch(*MIXED, 4, 2, 16, "float32")
        config = BlocksparsePrefillConfig(16, 16, 2, 1)

        def f(q, k, v, cu_k, cu_q):
            return attn(q, k, v, cu_k, cu_q) * 2 + attn(q, k, v, cu_k, cu_q, config=config)

        backend = "inductor" if GPU else "aot_eager"
        out = torch.compile(f, fullgraph=True, backend=backend)(*map(to_torch, (q, k, v, cu_k, cu_q)))
        ref = reference(q, k, v, cu_k, cu_q, formula_block_mask(4, 8, 2, 3, False), 16)
        assert_close(torch_to_numpy(out), 3 * ref, "float32", "compiled")

    def test_plan_cached_and_grid_static(self):
        (crow, col), _ = build_sparse_layout(4, 128, 16, 2, 3, False)
        q, k, v, cu_k, cu_q = make_batch(*MIXED, 4, 2, 16, "float32")
        self.attend(q, k, v, cu_k, cu_q, (crow, col), block_size=16)
        before = plan_blocksparse_attention.cache_info()
        q2, k2, v2, cu_k2, cu_q2 = make_batch([80, 40, 10, 50, 45], [2, 40, 10, 34, 45], 4, 2, 16, "float32")
        assert q2.shape == q.shape and k2.shape == k.shape
        self.attend(q2, k2, v2, cu_k2, cu_q2, (crow, col), block_size=16)
        assert plan_blocksparse_attention.cache_info().misses == before.misses

    @requires_gpu
    @pytest.mark.parametrize("decode", [False, True])
    def test_gpu_cuda_graph_replay_new_lengths(self, decode):
        attn = at.LocalStridedBlockSparseAttn(32, 2048, 16, 8, 64, device="cuda")
        lens_k = [700, 1300]
        lens_q = None if decode else [700, 300]
        q, k, v, cu_k, cu_q = make_batch(lens_k, lens_q, 32, 8, 128, "bfloat16")
        args = [to_torch(x) for x in (q, k, v, cu_k)] + [None if cu_q is None else to_torch(cu_q)]
        attn(*args)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = attn(*args)
        lens_k2 = [1500, 500]
        lens_q2 = None if decode else [1000, 0]  # same total q tokens
        q2, k2, v2, cu_k2, cu_q2 = make_batch(lens_k2, lens_q2, 32, 8, 128, "bfloat16")
        for dst, src in zip(args, (q2, k2, v2, cu_k2, cu_q2)):
            if dst is not None:
                dst.copy_(to_torch(src))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        ref = reference(q2, k2, v2, cu_k2, cu_q2, formula_block_mask(32, 32, 16, 8, False), 64)
        assert_close(torch_to_numpy(out), ref, "bfloat16", "graph replay with new lengths")


class TestJax(JaxAdapter, BlocksparseTests):
    device = None
    CPU_SKIP = ("test_decode_only[one-split-float32]", "test_module", "test_user_supplied_layout[32]",
                "test_int64_indices[mixed-perhead]", "test_matches_reference[qblock2x-float16]",
                "test_module_vllm_surface", "test_matches_reference[qblock2x-float32]",
                "test_user_supplied_layout[None]", "test_broadcast_layout_and_scale",
                "test_matches_reference[mixed-perhead-float32]", "test_matches_reference[mixed-perhead-float16]",
                "test_matches_reference[head-range-float16]",
                "test_prefill_tile_configs[mixed-perhead-BlocksparsePrefillConfig(block_m=16, block_n=16, "
                "num_warps=4, num_stages=3)]",
                # CI time (the suite took 14 min 50 s with setup at ee963ee): their torch twins run on the CPU
                "test_int64_indices[decode-packed]", "test_int64_indices[decode]",
                "test_matches_reference[qblock4x-float32]", "test_matches_reference[qblock4x-float16]",
                "test_matches_reference[head-range-float32]", "test_module_spda",
                "test_decode_configs[BlocksparsePrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=2)]",
                "test_decode_configs[BlocksparseGroupDecodeConfig(splits=3, chunk=2, num_warps=4, num_stages=2)]",
                "test_prefill_tile_configs[block32-BlocksparsePrefillConfig(block_m=16, block_n=16, "
                "num_warps=2, num_stages=1)]")

    @property
    def module_cls(self):
        import adapters.jax as aj
        return aj.LocalStridedBlockSparseAttn

    @property
    def ops(self):
        import adapters.jax as aj
        return aj

    @property
    def index_dtype64(self):
        import jax.numpy as jnp
        return jnp.int64

    def x64(self):
        import jax
        return jax.enable_x64(True)

    def fdtype(self, name):
        import jax.numpy as jnp
        return jnp.dtype(name)

    def test_spda_under_jit(self):
        import jax
        attn = self.module_cls(4, 128, 2, 3, 16, dtype=self.fdtype("float32"), use_spda=True)
        q, k, v, cu_k, _ = make_batch([70, 33], [70, 33], 4, 2, 16, "float32")
        out = jax.jit(lambda *a: attn(*a))(*map(to_jax, (q, k, v, cu_k)))  # pads to max_seqlen
        mask = formula_block_mask(4, 8, 2, 3, False)
        assert_close(self.numpy(out), reference(q, k, v, cu_k, None, mask, 16), "float32", "jit spda",
                     scale=4.0)

    def attend(self, q, k, v, cu_k, cu_q, layout, *, block_size, q_block_size=None, max_seqlen=None,
               sm_scale=None, config=None, jit=False):
        import jax
        import adapters.jax as aj
        crow, col = (np.ascontiguousarray(x) for x in layout)
        f = functools.partial(aj.blocksparse_flash_attn_varlen_fwd, sm_scale=sm_scale,
                              block_size=block_size, q_block_size=q_block_size, max_seqlen=max_seqlen,
                              config=config)

        def call(q, k, v, cu_k, cu_q, crow, col):
            return f(q, k, v, cu_k, cu_q, sparse_layout=(crow, col))
        if jit:
            call = jax.jit(call)
        return np.asarray(call(to_jax(q), to_jax(k), to_jax(v), to_jax(cu_k),
                               None if cu_q is None else to_jax(cu_q), to_jax(crow), to_jax(col)))

    def test_jit_traced_lengths_do_not_recompile(self):
        import jax
        attn = self.module_cls(4, 128, 2, 3, 16)
        f = jax.jit(lambda *a: attn(*a))
        for lens_k, lens_q in ((MIXED[0], MIXED[1]), ([20, 30, 40, 60, 75], [20, 10, 11, 15, 75])):
            q, k, v, cu_k, cu_q = make_batch(lens_k, lens_q, 4, 2, 16, "float32")
            out = f(*map(to_jax, (q, k, v, cu_k, cu_q)))
            ref = reference(q, k, v, cu_k, cu_q, formula_block_mask(4, 8, 2, 3, False), 16)
            assert_close(self.numpy(out), ref, "float32", "jit")
        assert f._cache_size() == 1, "new sequence lengths recompiled"


# ------------------------------------------------------------------ torch vs JAX
# the interpreter runs the same numpy code for both frameworks: on the CPU one
# case checks the plumbing, the GPU (different launchers and compilers) all of them
@pytest.mark.parametrize("dtype", FLOAT_DTYPES if GPU else ["float32"])
@pytest.mark.parametrize("case", ["mixed-perhead", "qblock2x"] if GPU else ["qblock2x"])
def test_torch_and_jax_bitwise_equal(dtype, case):
    (q, k, v, cu_k, cu_q), layout, _, opts = case_inputs(case, dtype)
    t = TestTorch().attend(q, k, v, cu_k, cu_q, layout, **opts)
    j = TestJax().attend(q, k, v, cu_k, cu_q, layout, jit=True, **opts)
    assert_bitwise_equal(t, j, case)
    lens = [5, 100, 64]
    (crow, col), _ = build_sparse_layout(4, 128, 16, 2, 3, False)
    q, k, v, cu_k, _ = make_batch(lens, None, 4, 2, 32, dtype)
    t = TestTorch().attend(q, k, v, cu_k, None, (crow, col), block_size=16)
    j = TestJax().attend(q, k, v, cu_k, None, (crow, col), block_size=16, jit=True)
    assert_bitwise_equal(t, j, "decode")


def test_torch_and_jax_vllm_surface_bitwise_equal():
    """get_sparse_attn_mask and the module (int64 indices) agree bit for bit across frameworks."""
    import jax
    import adapters.jax as aj
    with jax.enable_x64(True):
        for homo in (False, True):
            t = at.get_sparse_attn_mask(4, 60, 100, torch.float32, DEVICE, 16, 2, 3, homo, True, "bias")
            j = aj.get_sparse_attn_mask(4, 60, 100, jax.numpy.float32, None, 16, 2, 3, homo, True, "bias")
            for a, b in zip((*t[0], *t[1:]), (*j[0], *j[1:])):
                assert_bitwise_equal(torch_to_numpy(a), np.asarray(b), f"mask homo={homo}")
        q, k, v, cu_k, cu_q = make_batch(*MIXED, 4, 2, 16, "float32")
        cu_k, cu_q = as_int64(cu_k, cu_q)
        tm = at.LocalStridedBlockSparseAttn(8, 128, 2, 4, 16, DEVICE, None, False, (4, 8), 32)
        jm = aj.LocalStridedBlockSparseAttn(8, 128, 2, 4, 16, None, None, False, (4, 8), 32)
        t = torch_to_numpy(tm(*map(to_torch, (q, k, v, cu_k, cu_q))))
        j = np.asarray(jax.jit(lambda *a: jm(*a))(*map(to_jax, (q, k, v, cu_k, cu_q))))
    assert_bitwise_equal(t, j, "module int64")


@requires_gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gpu_phi3_small_vs_reference_and_bitwise(dtype):
    torch_, jax_ = TestTorch(), TestJax()
    lens_k, lens_q = [2048, 1500, 900, 4096], [2048, 1, 333, 1]
    (crow, col), _ = build_sparse_layout(32, 4096, 64, 16, 8, False)
    q, k, v, cu_k, cu_q = make_batch(lens_k, lens_q, 32, 8, 128, dtype)
    t = torch_.attend(q, k, v, cu_k, cu_q, (crow, col), block_size=64, max_seqlen=4096)
    j = jax_.attend(q, k, v, cu_k, cu_q, (crow, col), block_size=64, max_seqlen=4096, jit=True)
    assert_bitwise_equal(t, j, "torch vs jax")
    mask = formula_block_mask(32, 64, 16, 8, False)
    ref = reference(q, k, v, cu_k, cu_q, mask, 64)
    assert_close(t, ref, dtype, "phi3-small mixed")
    # decode-only, one sequence (split-KV path), bitwise too
    qd, kd, vd, cu_kd, _ = make_batch([4000], None, 32, 8, 128, dtype)
    t = torch_.attend(qd, kd, vd, cu_kd, None, (crow, col), block_size=64)
    j = jax_.attend(qd, kd, vd, cu_kd, None, (crow, col), block_size=64, jit=True)
    assert_bitwise_equal(t, j, "decode torch vs jax")
    assert_close(t, reference(qd, kd, vd, cu_kd, None, mask, 64), dtype, "phi3-small decode")
    # decode-only batch of 8 x 8 KV heads: the GQA-packed kernel (varlen, split), bitwise too
    lens = [4096, 1, 64, 65, 1000, 3000, 4095, 2049]
    qd, kd, vd, cu_kd, _ = make_batch(lens, None, 32, 8, 128, dtype)
    t = torch_.attend(qd, kd, vd, cu_kd, None, (crow, col), block_size=64)
    j = jax_.attend(qd, kd, vd, cu_kd, None, (crow, col), block_size=64, jit=True)
    assert_bitwise_equal(t, j, "packed decode torch vs jax")
    assert_close(t, reference(qd, kd, vd, cu_kd, None, mask, 64), dtype, "phi3-small packed decode")
    assert "_bsattn_decode_group_kernel" in run_plan_torch(qd, kd, vd, cu_kd, crow, col, 64)[1]


@requires_gpu
def test_gpu_prefill_with_lse():
    """The LSE forward (the one a gradient needs) against the reference, LSE
    included: a mixed batch (prefills over cached prefixes starting mid-block,
    decodes, an empty sequence), GQA, per-head layout."""
    import adapters.jax as aj
    lens_k, lens_q = [2048, 1500, 900, 4096, 77], [2048, 1, 333, 1, 0]
    (crow, col), _ = build_sparse_layout(32, 4096, 64, 16, 8, False)
    q, k, v, cu_k, cu_q = make_batch(lens_k, lens_q, 32, 8, 128, "bfloat16")
    out, lse = aj.blocksparse_flash_attn_varlen_fwd_lse(
        *map(to_jax, (q, k, v, cu_k, cu_q)), None, (to_jax(crow), to_jax(col)), block_size=64,
        max_seqlen=4096)
    mask = formula_block_mask(32, 64, 16, 8, False)
    assert_close(np.asarray(out), reference(q, k, v, cu_k, cu_q, mask, 64), "bfloat16", "LSE forward")
    # the LSE against float64 (each row's allowed keys, the causal mask)
    qf, kf = np.asarray(q, np.float64), np.asarray(k, np.float64)
    for b, (lk, lq) in enumerate(zip(lens_k, lens_q)):
        for i in range(0, lq, 97):
            t, pos = cu_q[b] + i, lk - lq + i
            for h in (0, 13, 31):
                keys = [j for j in range(pos + 1) if mask[h, pos // 64, j // 64]]
                s = kf[cu_k[b] + np.array(keys), h // 4] @ qf[t, h] * 128 ** -0.5
                want = np.log(np.exp(s - s.max()).sum()) + s.max()
                assert abs(float(lse[t, h]) - want) < 1e-2 * max(1.0, abs(want)), (b, i, h)
