"""blocksparse_attention: both adapters against the float64 reference (spec: blocksparse_attention.md).

The reference applies the exact token-level mask built from the spec's layout
formula (reference.formula_block_mask), never the builder's output, so the
layout builder and the kernels are checked independently.
"""
import numpy as np
import pytest
import torch

from core_kernels.blocksparse_attention import (blocksparse_attention_reference, crow_col_to_dense,
                                                formula_block_mask, get_sparse_attn_mask,
                                                plan_blocksparse_attention)
from harness import (ADAPTERS, DEVICE, FLOAT_DTYPES, GPU, assert_bitwise_equal, assert_close, cast,
                     jax_to_numpy, requires_gpu, rng, to_jax, to_torch, torch_to_numpy)
import adapters.torch as at


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


def run(adapter, q, k, v, cu_k, cu_q, layout, *, block_size, q_block_size=None, max_seqlen=None,
        sm_scale=None, jit=False):
    crow, col = (np.ascontiguousarray(x) for x in layout)
    if adapter == "torch":
        # poison: the caching allocator hands this NaN block back to the op's output
        poison = torch.full(q.shape, float("nan"), dtype=to_torch(q[:0]).dtype, device=DEVICE)
        del poison
        out = at.blocksparse_flash_attn_varlen_fwd(
            to_torch(q), to_torch(k), to_torch(v), to_torch(cu_k),
            None if cu_q is None else to_torch(cu_q), sm_scale, (to_torch(crow), to_torch(col)),
            block_size=block_size, q_block_size=q_block_size, max_seqlen=max_seqlen)
        return torch_to_numpy(out)
    import jax
    import adapters.jax as aj

    def f(q, k, v, cu_k, cu_q, crow, col):
        return aj.blocksparse_flash_attn_varlen_fwd(q, k, v, cu_k, cu_q, sm_scale, (crow, col),
                                                    block_size=block_size, q_block_size=q_block_size,
                                                    max_seqlen=max_seqlen)
    if jit:
        f = jax.jit(f)
    return jax_to_numpy(f(to_jax(q), to_jax(k), to_jax(v), to_jax(cu_k),
                          None if cu_q is None else to_jax(cu_q), to_jax(crow), to_jax(col)))


def reference(q, k, v, cu_k, cu_q, block_mask, block_size, q_block_size=None, sm_scale=None):
    return blocksparse_attention_reference(q, k, v, cu_k, cu_q, block_mask, block_size=block_size,
                                           sm_scale=sm_scale, q_block_size=q_block_size)


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
    (crow, col), _ = get_sparse_attn_mask(global_heads, max_seqlen, bs, local, stride, homo, head_range)
    heads = range(*(head_range or (0, hq)))
    nb = -(-max_seqlen // bs)
    block_mask = formula_block_mask(global_heads, nb, local, stride, homo, heads)
    q, k, v, cu_k, cu_q = make_batch(lens_k, lens_q, hq, hkv, d, dtype, seed)
    return (q, k, v, cu_k, cu_q), (crow, col), block_mask, dict(block_size=bs, q_block_size=qbs)


# ------------------------------------------------------------------ layout builder
@pytest.mark.parametrize("n_heads,max_seqlen,bs,local,stride,homo,head_range", [
    (4, 300, 16, 2, 3, True, None), (4, 300, 16, 2, 3, False, None), (32, 1000, 64, 16, 8, False, None),
    (6, 129, 32, 1, 5, False, (2, 5)), (3, 64, 64, 4, 4, False, None), (2, 1000, 16, 100, 7, False, None),
    (40, 2048, 64, 16, 8, False, (8, 16)),
], ids=str)
def test_layout_matches_formula(n_heads, max_seqlen, bs, local, stride, homo, head_range):
    (crow, col), block_mask = get_sparse_attn_mask(n_heads, max_seqlen, bs, local, stride, homo,
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
    again = get_sparse_attn_mask(n_heads, max_seqlen, bs, local, stride, homo, head_range)
    assert again[1] is block_mask, "cached"
    with pytest.raises(ValueError):
        block_mask[0, 0, 0] = False  # read-only: the cache cannot be corrupted


def test_layout_reexported_and_fast():
    import time
    import adapters.jax as aj
    assert at.get_sparse_attn_mask is aj.get_sparse_attn_mask is get_sparse_attn_mask
    t0 = time.perf_counter()
    get_sparse_attn_mask(32, 32768, 64, 16, 8, False, (0, 31))  # uncached: 31 x 512 x 512
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
        get_sparse_attn_mask(**args)


# ------------------------------------------------------------------ attention vs reference
@pytest.mark.parametrize("adapter", ADAPTERS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(adapter, dtype, case):
    (q, k, v, cu_k, cu_q), layout, block_mask, opts = case_inputs(case, dtype)
    out = run(adapter, q, k, v, cu_k, cu_q, layout, **opts)
    ref = reference(q, k, v, cu_k, cu_q, block_mask, **opts)
    assert out.dtype == q.dtype
    assert_close(out, ref, dtype, case, scale=2.0)


@pytest.mark.parametrize("adapter", ADAPTERS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("batch", [3, 70], ids=["split-kv", "one-split"])
def test_decode_only(adapter, dtype, batch):
    g = rng()
    lens = list(g.integers(1, 120, batch))
    lens[0] = 1
    (crow, col), _ = get_sparse_attn_mask(4, 128, 16, 2, 3, False)
    q, k, v, cu_k, _ = make_batch(lens, None, 4, 2, 24, dtype)
    assert q.shape[0] == batch
    out = run(adapter, q, k, v, cu_k, None, (crow, col), block_size=16, sm_scale=0.3)
    ref = reference(q, k, v, cu_k, None, formula_block_mask(4, 8, 2, 3, False), 16, sm_scale=0.3)
    assert_close(out, ref, dtype, "decode", scale=2.0)


def random_user_layout(g, n_heads, nb):
    """Random per-head CSR: the diagonal, random lower blocks, a few (masked) upper blocks."""
    mask = g.random((n_heads, nb, nb)) < 0.35
    mask |= np.eye(nb, dtype=bool)[None]
    from core_kernels.blocksparse_attention import dense_to_crow_col
    return dense_to_crow_col(mask), mask


# GQA-packed decode: one program per KV head walks the union of its query heads' rows.
# (hq, hkv, d, block_size, layout, decode_chunk, decode_splits)
GROUP_DECODE_CASES = {
    "G4-perhead-default": (8, 2, 24, 16, "perhead", None, None),
    "G3-user-chunk2-sub": (6, 2, 16, 16, "user", 2, 3),
    "G24-two-headblocks": (24, 1, 16, 16, "perhead", 4, 1),
    "G1-forced-bs128": (2, 2, 16, 128, "perhead", 2, 2),
}


def run_plan_torch(q, k, v, cu_k, crow, col, block_size, **cfg):
    from adapters.torch._executor import info, run_plan
    t = dict(q=to_torch(q), k=to_torch(k), v=to_torch(v), cu_seqlens_k=to_torch(cu_k),
             crow=to_torch(np.ascontiguousarray(crow)), col=to_torch(np.ascontiguousarray(col)))
    plan = plan_blocksparse_attention(*(info(t[n]) for n in ("q", "k", "v", "cu_seqlens_k")), None,
                                      info(t["crow"]), info(t["col"]), block_size=block_size, **cfg)
    names = [l.kernel.__name__ if hasattr(l.kernel, "__name__") else l.kernel.fn.__name__
             for l in plan.launches]
    out = run_plan(plan, t, None, t["q"].device)["output"]
    return torch_to_numpy(out), names


@pytest.mark.parametrize("case", list(GROUP_DECODE_CASES))
def test_decode_group_packed(case):
    hq, hkv, d, bs, kind, chunk, splits = GROUP_DECODE_CASES[case]
    g = rng()
    nb = 8 if bs == 16 else 3
    lens = [1, nb * bs, 17, int(g.integers(2, nb * bs))]
    if kind == "user":
        (crow, col), mask = random_user_layout(g, hq, nb)
    else:
        (crow, col), _ = get_sparse_attn_mask(hq, nb * bs, bs, 2, 3, False)
        mask = formula_block_mask(hq, nb, 2, 3, False)
    q, k, v, cu_k, _ = make_batch(lens, None, hq, hkv, d, "float32")
    out, names = run_plan_torch(q, k, v, cu_k, crow, col, bs, decode_group=True,
                                decode_chunk=chunk, decode_splits=splits)
    assert "_bsattn_decode_group_kernel" in names
    assert_close(out, reference(q, k, v, cu_k, None, mask, bs), "float32", case, scale=2.0)


@pytest.mark.parametrize("adapter", ADAPTERS)
@pytest.mark.parametrize("qbs", [None, 32])
def test_user_supplied_layout(adapter, qbs):
    g = rng()
    (crow, col), mask = random_user_layout(g, 4, 8)
    for lens_q in (MIXED[1], None):
        lens_k = MIXED[0] if lens_q is not None else [60, 3, 128, 77]
        q, k, v, cu_k, cu_q = make_batch(lens_k, lens_q, 4, 4, 16, "float32")
        out = run(adapter, q, k, v, cu_k, cu_q, (crow, col), block_size=16, q_block_size=qbs)
        ref = reference(q, k, v, cu_k, cu_q, mask, 16, q_block_size=qbs)
        assert_close(out, ref, "float32", "user layout", scale=2.0)


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_broadcast_layout_and_scale(adapter):
    (crow, col), _ = get_sparse_attn_mask(1, 128, 16, 2, 3, True)
    q, k, v, cu_k, cu_q = make_batch(*MIXED, 4, 1, 32, "float16")
    out = run(adapter, q, k, v, cu_k, cu_q, (crow[0], col[0]), block_size=16, sm_scale=0.05)
    ref = reference(q, k, v, cu_k, cu_q, formula_block_mask(1, 8, 2, 3), 16, sm_scale=0.05)
    assert_close(out, ref, "float16", "1-D layout broadcast")


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_empty_batch(adapter):
    (crow, col), _ = get_sparse_attn_mask(2, 64, 16, 2, 2)
    q, k, v, cu_k, cu_q = make_batch([0], [0], 2, 2, 16, "float32")
    out = run(adapter, q, k, v, cu_k, cu_q, (crow, col), block_size=16)
    assert out.shape == (0, 2, 16)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("case", ["mixed-perhead", "qblock2x"])
def test_torch_and_jax_bitwise_equal(dtype, case):
    (q, k, v, cu_k, cu_q), layout, _, opts = case_inputs(case, dtype)
    t = run("torch", q, k, v, cu_k, cu_q, layout, **opts)
    j = run("jax", q, k, v, cu_k, cu_q, layout, jit=True, **opts)
    assert_bitwise_equal(t, j, case)
    lens = [5, 100, 64]
    (crow, col), _ = get_sparse_attn_mask(4, 128, 16, 2, 3, False)
    q, k, v, cu_k, _ = make_batch(lens, None, 4, 2, 32, dtype)
    t = run("torch", q, k, v, cu_k, None, (crow, col), block_size=16)
    j = run("jax", q, k, v, cu_k, None, (crow, col), block_size=16, jit=True)
    assert_bitwise_equal(t, j, "decode")


# ------------------------------------------------------------------ modules, jit, compile
@pytest.mark.parametrize("adapter", ADAPTERS)
def test_module(adapter):
    import adapters.jax as aj
    cls = at.LocalStridedBlockSparseAttn if adapter == "torch" else aj.LocalStridedBlockSparseAttn
    attn = cls(8, 128, 2, 4, 16, homo_head=False, active_head_range=(4, 8), q_block_size=32)
    q, k, v, cu_k, cu_q = make_batch(*MIXED, 4, 2, 16, "float32")
    if adapter == "torch":
        out = torch_to_numpy(attn(*map(to_torch, (q, k, v, cu_k, cu_q))))
    else:
        out = jax_to_numpy(attn(*map(to_jax, (q, k, v, cu_k, cu_q))))
    mask = formula_block_mask(8, 8, 2, 4, False, range(4, 8))
    assert_close(out, reference(q, k, v, cu_k, cu_q, mask, 16, q_block_size=32), "float32", "module")


def test_jax_jit_traced_lengths_do_not_recompile():
    import jax
    import adapters.jax as aj
    attn = aj.LocalStridedBlockSparseAttn(4, 128, 2, 3, 16)
    f = jax.jit(lambda *a: attn(*a))
    for lens_k, lens_q in ((MIXED[0], MIXED[1]), ([20, 30, 40, 60, 75], [20, 10, 11, 15, 75])):
        q, k, v, cu_k, cu_q = make_batch(lens_k, lens_q, 4, 2, 16, "float32")
        out = f(*map(to_jax, (q, k, v, cu_k, cu_q)))
        ref = reference(q, k, v, cu_k, cu_q, formula_block_mask(4, 8, 2, 3, False), 16)
        assert_close(jax_to_numpy(out), ref, "float32", "jit")
    assert f._cache_size() == 1, "new sequence lengths recompiled"


def test_torch_compile_fullgraph():
    attn = at.LocalStridedBlockSparseAttn(4, 128, 2, 3, 16, device=DEVICE)
    q, k, v, cu_k, cu_q = make_batch(*MIXED, 4, 2, 16, "float32")

    def f(q, k, v, cu_k, cu_q):
        return attn(q, k, v, cu_k, cu_q) * 2

    backend = "inductor" if GPU else "aot_eager"
    out = torch.compile(f, fullgraph=True, backend=backend)(*map(to_torch, (q, k, v, cu_k, cu_q)))
    ref = reference(q, k, v, cu_k, cu_q, formula_block_mask(4, 8, 2, 3, False), 16)
    assert_close(torch_to_numpy(out), 2 * ref, "float32", "compiled")


def test_plan_cached_and_grid_static():
    (crow, col), _ = get_sparse_attn_mask(4, 128, 16, 2, 3, False)
    q, k, v, cu_k, cu_q = make_batch(*MIXED, 4, 2, 16, "float32")
    run("torch", q, k, v, cu_k, cu_q, (crow, col), block_size=16)
    before = plan_blocksparse_attention.cache_info()
    q2, k2, v2, cu_k2, cu_q2 = make_batch([80, 40, 10, 50, 45], [2, 40, 10, 34, 45], 4, 2, 16, "float32")
    assert q2.shape == q.shape and k2.shape == k.shape
    run("torch", q2, k2, v2, cu_k2, cu_q2, (crow, col), block_size=16)
    assert plan_blocksparse_attention.cache_info().misses == before.misses


# ------------------------------------------------------------------ errors
def _bad_cases():
    q, k, v, cu_k, cu_q = make_batch([40, 20], [40, 5], 4, 2, 16, "float32")
    (crow, col), _ = get_sparse_attn_mask(4, 64, 16, 2, 2, False)
    (crow3, col3), _ = get_sparse_attn_mask(3, 64, 16, 2, 2, False)
    base = dict(q=q, k=k, v=v, cu_k=cu_k, cu_q=cu_q, crow=crow, col=col, bs=16, qbs=None, ms=None)
    return base, [
        ("sparse_layout", dict(crow=crow3, col=col3)),                  # 3 layout heads vs Hq = 4
        ("Hq % Hkv", dict(k=k[:, :1].repeat(3, 1), v=v[:, :1].repeat(3, 1))),
        ("q_block_size", dict(qbs=24)),
        ("v: shape", dict(v=v[:, :1])),
        ("cu_seqlens_q", dict(cu_q=cu_q[:2])),
        ("cu_seqlens_k", dict(cu_k=cu_k.astype(np.int64))),
        ("cu_seqlens_q", dict(q=q[:7])),                                 # neither B nor Tk tokens, no cu_q
        ("k: dtype", dict(k=k.astype(np.float16))),
        ("head size", dict(q=np.zeros((45, 4, 300), np.float32), k=np.zeros((60, 2, 300), np.float32),
                           v=np.zeros((60, 2, 300), np.float32))),
        ("max_seqlen", dict(ms=100)),
        ("block_size", dict(bs=48)),
    ]


@pytest.mark.parametrize("adapter", ADAPTERS)
@pytest.mark.parametrize("case", range(11))
def test_errors_name_the_argument(adapter, case):
    base, cases = _bad_cases()
    name, repl = cases[case]
    a = {**base, **repl}
    if name == "cu_seqlens_q" and "q" in repl:
        a["cu_q"] = None
    if adapter == "jax" and name == "cu_seqlens_k":
        pytest.skip("JAX without x64 turns int64 into int32")
    with pytest.raises((ValueError, TypeError), match=name):
        run(adapter, a["q"], a["k"], a["v"], a["cu_k"], a["cu_q"], (a["crow"], a["col"]),
            block_size=a["bs"], q_block_size=a["qbs"], max_seqlen=a["ms"])


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_module_errors(adapter):
    import adapters.jax as aj
    cls = at.LocalStridedBlockSparseAttn if adapter == "torch" else aj.LocalStridedBlockSparseAttn
    with pytest.raises(ValueError, match="q_block_size"):
        cls(4, 128, 2, 3, 16, q_block_size=40)
    with pytest.raises(ValueError, match="active_head_range"):
        cls(4, 128, 2, 3, 16, active_head_range=(0, 5))


# ------------------------------------------------------------------ GPU
PHI3 = dict(hq=32, hkv=8, d=128, bs=64, local=16, stride=8)


@requires_gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gpu_phi3_small_vs_reference_and_bitwise(dtype):
    lens_k, lens_q = [2048, 1500, 900, 4096], [2048, 1, 333, 1]
    (crow, col), _ = get_sparse_attn_mask(32, 4096, 64, 16, 8, False)
    q, k, v, cu_k, cu_q = make_batch(lens_k, lens_q, 32, 8, 128, dtype)
    t = run("torch", q, k, v, cu_k, cu_q, (crow, col), block_size=64, max_seqlen=4096)
    j = run("jax", q, k, v, cu_k, cu_q, (crow, col), block_size=64, max_seqlen=4096, jit=True)
    assert_bitwise_equal(t, j, "torch vs jax")
    mask = formula_block_mask(32, 64, 16, 8, False)
    ref = reference(q, k, v, cu_k, cu_q, mask, 64)
    assert_close(t, ref, dtype, "phi3-small mixed")
    # decode-only, one sequence (split-KV path), bitwise too
    qd, kd, vd, cu_kd, _ = make_batch([4000], None, 32, 8, 128, dtype)
    t = run("torch", qd, kd, vd, cu_kd, None, (crow, col), block_size=64)
    j = run("jax", qd, kd, vd, cu_kd, None, (crow, col), block_size=64, jit=True)
    assert_bitwise_equal(t, j, "decode torch vs jax")
    assert_close(t, reference(qd, kd, vd, cu_kd, None, mask, 64), dtype, "phi3-small decode")
    # decode-only batch of 8 x 8 KV heads: the GQA-packed kernel (varlen, split), bitwise too
    lens = [4096, 1, 64, 65, 1000, 3000, 4095, 2049]
    qd, kd, vd, cu_kd, _ = make_batch(lens, None, 32, 8, 128, dtype)
    t = run("torch", qd, kd, vd, cu_kd, None, (crow, col), block_size=64)
    j = run("jax", qd, kd, vd, cu_kd, None, (crow, col), block_size=64, jit=True)
    assert_bitwise_equal(t, j, "packed decode torch vs jax")
    assert_close(t, reference(qd, kd, vd, cu_kd, None, mask, 64), dtype, "phi3-small packed decode")
    assert "_bsattn_decode_group_kernel" in run_plan_torch(qd, kd, vd, cu_kd, crow, col, 64)[1]


@requires_gpu
@pytest.mark.parametrize("decode", [False, True])
def test_gpu_cuda_graph_replay_new_lengths(decode):
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


# ------------------------------------------------------------------ tile configs
@pytest.mark.parametrize("case,cfg", [("mixed-perhead", dict(block_m=16, block_n=16)),
                                      ("block32", dict(block_m=32, block_n=16)),
                                      ("block32", dict(block_m=16, block_n=16))], ids=str)
def test_prefill_tile_configs(case, cfg):
    """Query tiles of a whole layout row or part of one (block_m <= block_size), K/V
    sub-blocks (block_n < block_size); block_m beyond the layout row is refused."""
    from adapters.torch._executor import info, run_plan
    (q, k, v, cu_k, cu_q), (crow, col), block_mask, opts = case_inputs(case, "float32")
    bs = opts["block_size"]
    t = {n: to_torch(x) for n, x in dict(q=q, k=k, v=v, cu_seqlens_k=cu_k, cu_seqlens_q=cu_q,
                                          crow=np.ascontiguousarray(crow),
                                          col=np.ascontiguousarray(col)).items()}
    plan = plan_blocksparse_attention(*(info(t[n]) for n in ("q", "k", "v", "cu_seqlens_k",
                                                             "cu_seqlens_q", "crow", "col")),
                                      block_size=bs, **cfg)
    assert plan.launches[0].constexprs["BLOCK_M"] == cfg["block_m"]
    with pytest.raises(ValueError, match="block_m"):
        plan_blocksparse_attention(*(info(t[n]) for n in ("q", "k", "v", "cu_seqlens_k",
                                                          "cu_seqlens_q", "crow", "col")),
                                   block_size=bs, block_m=2 * bs, block_n=cfg["block_n"])
    out = run_plan(plan, t, None, t["q"].device)["output"]
    assert_close(torch_to_numpy(out), reference(q, k, v, cu_k, cu_q, block_mask, bs), "float32", str(cfg))
