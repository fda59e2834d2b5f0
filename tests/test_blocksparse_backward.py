"""Block-sparse varlen attention backward: the float64 reference against finite
differences, both adapters against the reference (homo and per-head layouts,
GQA, varlen with q_len <= k_len, merged q blocks), torch vs JAX bitwise,
determinism, opcheck, torch.compile, the module, jax.jit / vmap.

CPU budget: every case is tiny (block 16, D 16, <= 4 layout blocks) because the
kernels run under Triton's interpreter in CI; larger shapes run on a GPU only.
"""
import numpy as np
import pytest
import torch

import adapters.torch as at
from adapters.torch._register import OPS
from core_kernels.blocksparse_attention import (BlocksparseDecodeConfig, blocksparse_attention_backward_reference,
                                                blocksparse_attention_reference, build_sparse_layout)
from harness import (DEVICE, GPU, JaxAdapter, TorchAdapter, assert_bitwise_equal, assert_close,
                     assert_matches_finite_differences, cast, rng, to_jax, to_torch, torch_to_numpy)

BACKEND = "inductor" if GPU else "aot_eager"
BS = 16


def make_case(lens, hq, hkv, d, dtype, *, nb=4, local=1, stride=2, homo=False, seed=None, bs=BS):
    """Packed sequences ``lens`` = [(q_len, k_len)], a layout of ``nb`` blocks of
    BS (crow/col int32, one head when homo), fresh normal inputs and dO."""
    g = rng(seed)
    (crow, col), mask = build_sparse_layout(1 if homo else hq, nb * bs, bs, local, stride, homo)
    cu_q = np.cumsum([0] + [a for a, _ in lens]).astype(np.int32)
    cu_k = np.cumsum([0] + [b for _, b in lens]).astype(np.int32)
    q = cast(g.standard_normal((cu_q[-1], hq, d)), dtype)
    k = cast(g.standard_normal((cu_k[-1], hkv, d)), dtype)
    v = cast(g.standard_normal((cu_k[-1], hkv, d)), dtype)
    go = cast(g.standard_normal((cu_q[-1], hq, d)), dtype)
    return dict(q=q, k=k, v=v, go=go, cu_k=cu_k, cu_q=cu_q, crow=np.ascontiguousarray(crow),
                col=np.ascontiguousarray(col), mask=mask, max_seqlen=nb * bs, bs=bs)


def reference(c, sm_scale, q_block_size=None):
    f = lambda x: np.asarray(x, np.float64)  # noqa: E731
    return blocksparse_attention_backward_reference(f(c["q"]), f(c["k"]), f(c["v"]), c["cu_k"], c["cu_q"],
                                                    c["mask"], f(c["go"]), block_size=c["bs"],
                                                    sm_scale=sm_scale, q_block_size=q_block_size)


def check_grads(got, want, dtype):
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert np.asarray(g).dtype == cast(np.zeros(1), dtype).dtype, f"{name}: dtype {np.asarray(g).dtype}"
        # sums over up to 64 keys (and a GQA group) of products of dtype-rounded values
        assert_close(g, w, dtype, name, scale=4.0)


# ------------------------------------------------------------------ core reference
def test_reference_matches_finite_differences():
    c = make_case([(5, 9), (3, 3)], 2, 1, 3, "float64", nb=1, seed=0)
    bs_small = 4   # 3 layout blocks of 4 tokens over 9 keys: sparse inside the sequence
    (crow, col), mask = build_sparse_layout(2, 12, bs_small, 1, 2, False)
    args = [c["q"], c["k"], c["v"]]

    def loss(q, k, v):
        out = blocksparse_attention_reference(q, k, v, c["cu_k"], c["cu_q"], mask, block_size=bs_small,
                                              sm_scale=0.7)
        return (out * c["go"]).sum()

    want = blocksparse_attention_backward_reference(*args, c["cu_k"], c["cu_q"], mask, c["go"],
                                                    block_size=bs_small, sm_scale=0.7)
    assert_matches_finite_differences(loss, args, want)


# ------------------------------------------------------------------ both adapters
# (lens, hq, hkv, d, homo, q_block_size): per-head GQA varlen (prefill, cached
# prefix, a sequence in the middle of a block) and a homo layout with q blocks of
# two layout rows over odd head size
CASES = {
    "perhead-gqa-varlen": ([(20, 36), (13, 13), (9, 25)], 4, 2, 16, False, None),
    "homo-qblock32-D24": ([(30, 30), (7, 19)], 2, 1, 24, True, 32),
}
DTYPE_OF = {"perhead-gqa-varlen": "float32", "homo-qblock32-D24": "float16"}


class BlocksparseBackwardTests:
    """numpy in, numpy (dq, dk, dv) out, per adapter."""

    def grads(self, c, sm_scale, q_block_size=None, jit=False):
        raise NotImplementedError

    @pytest.mark.parametrize("case", list(CASES))
    def test_matches_reference(self, case):
        lens, hq, hkv, d, homo, qbs = CASES[case]
        dtype = DTYPE_OF[case]
        c = make_case(lens, hq, hkv, d, dtype, homo=homo)
        check_grads(self.grads(c, 0.3, qbs), reference(c, 0.3, qbs), dtype)


class TestTorch(TorchAdapter, BlocksparseBackwardTests):
    def grads(self, c, sm_scale, q_block_size=None, module=None):
        q, k, v = (to_torch(c[n]).requires_grad_(True) for n in ("q", "k", "v"))
        args = (to_torch(c["cu_k"]), to_torch(c["cu_q"]))
        if module is not None:
            out = module(q, k, v, *args, sm_scale=sm_scale)
        else:
            out = at.blocksparse_flash_attn_varlen_fwd(q, k, v, *args, sm_scale,
                                                       (to_torch(c["crow"]), to_torch(c["col"])),
                                                       block_size=c["bs"], q_block_size=q_block_size,
                                                       max_seqlen=c["max_seqlen"])
        assert out.grad_fn is not None
        out.backward(to_torch(c["go"]))
        return [torch_to_numpy(x.grad) for x in (q, k, v)]

    def test_module_forward_and_no_grad_path(self):
        c = make_case([(32, 32)], 2, 1, 16, "float32", homo=False)
        mod = at.LocalStridedBlockSparseAttn(2, 64, 1, 2, BS, device=DEVICE, homo_head=False)
        (crow, col), mask = build_sparse_layout(2, 64, BS, 1, 2, False)
        c.update(mask=mask)
        check_grads(self.grads(c, 0.25, module=mod), reference(c, 0.25), "float32")
        q, k, v = (to_torch(c[n]).requires_grad_(True) for n in ("q", "k", "v"))
        with torch.no_grad():
            out = mod(q, k, v, to_torch(c["cu_k"]))
        assert out.grad_fn is None

    def test_decode_config_with_grad_is_refused(self):
        c = make_case([(1, 20), (1, 9)], 2, 1, 16, "float32")
        q = to_torch(c["q"]).requires_grad_(True)
        with pytest.raises(ValueError, match="config: a call that needs a gradient"):
            at.blocksparse_flash_attn_varlen_fwd(q, to_torch(c["k"]), to_torch(c["v"]), to_torch(c["cu_k"]),
                                                 None, 0.3, (to_torch(c["crow"]), to_torch(c["col"])),
                                                 block_size=BS, config=BlocksparseDecodeConfig(1))

    def test_compile_fullgraph_grads_equal_eager(self):
        c = make_case([(16, 24)], 2, 1, 16, "float32", nb=2, seed=3)
        layout, cu_k, cu_q, go = (to_torch(c["crow"]), to_torch(c["col"])), to_torch(c["cu_k"]), \
            to_torch(c["cu_q"]), to_torch(c["go"])

        def f(q, k, v):
            out = at.blocksparse_flash_attn_varlen_fwd(q, k, v, cu_k, cu_q, 0.3, layout, block_size=BS,
                                                       max_seqlen=32)
            return (out * go).sum()

        grads = []
        torch._dynamo.reset()
        for fn in (f, torch.compile(f, fullgraph=True, backend=BACKEND)):
            inputs = [to_torch(c[n]).requires_grad_(True) for n in ("q", "k", "v")]
            fn(*inputs).backward()
            grads.append([torch_to_numpy(x.grad) for x in inputs])
        for e, g in zip(*grads):
            assert_bitwise_equal(g, e, "compiled vs eager gradient")

    def test_opcheck(self):
        c = make_case([(16, 16)], 2, 1, 16, "float32", nb=1, seed=4)
        q, k, v, go = (to_torch(c[n]) for n in ("q", "k", "v", "go"))
        idx = [to_torch(c[n]) for n in ("cu_k", "cu_q", "crow", "col")]
        opts = [0.3, BS, None, 16, None]
        args = [q.clone().requires_grad_(True), k.clone().requires_grad_(True), v.clone().requires_grad_(True),
                *idx, *opts]
        torch.library.opcheck(OPS["blocksparse_flash_attn_varlen_fwd_lse"].op, args)
        out, lse = OPS["blocksparse_flash_attn_varlen_fwd_lse"].op(q, k, v, *idx, *opts)
        torch.library.opcheck(OPS["blocksparse_flash_attn_varlen_backward"].op,
                              [q, k, v, out, lse, go, *idx, *opts])

    def test_double_backward_is_refused(self):
        c = make_case([(16, 16)], 2, 1, 16, "float32", nb=1)
        q, k, v = (to_torch(c[n]).requires_grad_(True) for n in ("q", "k", "v"))
        out = at.blocksparse_flash_attn_varlen_fwd(q, k, v, to_torch(c["cu_k"]), None, 0.3,
                                                   (to_torch(c["crow"]), to_torch(c["col"])), block_size=BS)
        with pytest.raises(RuntimeError, match="blocksparse_flash_attn_varlen_backward has no backward"):
            torch.autograd.grad((out * to_torch(c["go"])).sum(), q, create_graph=True)


class TestJax(JaxAdapter, BlocksparseBackwardTests):
    def grads(self, c, sm_scale, q_block_size=None, jit=False):
        import jax
        import adapters.jax as aj

        def loss(q, k, v, go, cu_k, cu_q, crow, col):
            out = aj.blocksparse_flash_attn_varlen_fwd(q, k, v, cu_k, cu_q, sm_scale, (crow, col),
                                                       block_size=c["bs"], q_block_size=q_block_size,
                                                       max_seqlen=c["max_seqlen"])
            return (out.astype(np.float32) * go.astype(np.float32)).sum()

        fn = jax.grad(loss, argnums=(0, 1, 2))
        if jit:
            fn = jax.jit(fn)
        got = fn(*(to_jax(c[n]) for n in ("q", "k", "v", "go", "cu_k", "cu_q", "crow", "col")))
        return [np.asarray(x) for x in got]

    def test_explicit_backward_across_layout_words(self):
        """The LSE forward and the backward called directly, over 40 layout rows:
        the transposed layout's rows in two 32-bit words (queries in rows 29-37)."""
        import adapters.jax as aj
        c = make_case([(135, 600)], 2, 1, 16, "float32", nb=40, local=3, stride=3)
        args = [to_jax(c[n]) for n in ("q", "k", "v")]
        idx = (to_jax(c["cu_k"]), to_jax(c["cu_q"]), 0.3, (to_jax(c["crow"]), to_jax(c["col"])))
        opts = dict(block_size=c["bs"], max_seqlen=c["max_seqlen"])
        out, lse = aj.blocksparse_flash_attn_varlen_fwd_lse(*args, *idx, **opts)
        got = aj.blocksparse_flash_attn_varlen_backward(*args, out, lse, to_jax(c["go"]), *idx, **opts)
        check_grads([np.asarray(x) for x in got], reference(c, 0.3), "float32")

    def test_tokens_outside_every_sequence_get_zero_gradients(self, monkeypatch):
        """Rows past cu_seqlens[-1] (padding) in q, k and v: their gradients are
        zeros, the others match the reference. On the CPU the interpreter's
        uninitialised buffers are poisoned (NaN) so that a missed row shows."""
        import adapters.jax as aj
        import core_kernels._interpret as interp

        class PoisonedNumpy:
            def __getattr__(self, name):
                return getattr(np, name)

            @staticmethod
            def empty(shape, dtype=float):
                return np.full(shape, np.nan if np.dtype(dtype).kind in "fV" else -7, dtype)

        monkeypatch.setattr(interp, "np", PoisonedNumpy())
        c = make_case([(20, 36), (9, 25)], 4, 2, 16, "float32")
        pad = lambda x, n: np.concatenate([x, np.full((n,) + x.shape[1:], 3.0, x.dtype)])  # noqa: E731
        args = [to_jax(pad(c["q"], 5)), to_jax(pad(c["k"], 7)), to_jax(pad(c["v"], 7))]
        idx = (to_jax(c["cu_k"]), to_jax(c["cu_q"]), 0.3, (to_jax(c["crow"]), to_jax(c["col"])))
        opts = dict(block_size=c["bs"], max_seqlen=c["max_seqlen"])
        out, lse = aj.blocksparse_flash_attn_varlen_fwd_lse(*args, *idx, **opts)
        got = aj.blocksparse_flash_attn_varlen_backward(*args, out, lse, to_jax(pad(c["go"], 5)), *idx, **opts)
        got = [np.asarray(x) for x in got]
        for name, g, n in zip(("dq", "dk", "dv"), got, (5, 7, 7)):
            assert np.all(g[-n:] == 0), f"{name}: rows outside every sequence"
        check_grads([g[:len(g) - n] for g, n in zip(got, (5, 7, 7))], reference(c, 0.3), "float32")

    def test_module_and_vmap_of_grad(self):
        import jax
        import adapters.jax as aj
        mod = aj.LocalStridedBlockSparseAttn(2, 32, 1, 2, BS, homo_head=True)
        cases = [make_case([(16, 16), (8, 16)], 2, 1, 16, "float32", nb=2, homo=True) for _ in range(2)]
        cu_k, cu_q = to_jax(cases[0]["cu_k"]), to_jax(cases[0]["cu_q"])

        def loss(q, k, v, go):
            return (mod(q, k, v, cu_k, cu_q, sm_scale=0.3) * go).sum()

        stacked = [to_jax(np.stack([c[n] for c in cases])) for n in ("q", "k", "v", "go")]
        vg = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2))))(*stacked)
        for i, c in enumerate(cases):
            check_grads([np.asarray(x[i]) for x in vg], reference(c, 0.3), "float32")


def test_torch_and_jax_gradients_bitwise_equal_and_deterministic():
    lens, hq, hkv, d, homo, qbs = CASES["perhead-gqa-varlen"]
    c = make_case(lens, hq, hkv, d, "float32", homo=homo)
    t1 = TestTorch().grads(c, 0.3, qbs)
    t2 = TestTorch().grads(c, 0.3, qbs)
    j = TestJax().grads(c, 0.3, qbs, jit=True)
    for name, a, b, e in zip(("dq", "dk", "dv"), t1, t2, j):
        assert_bitwise_equal(a, b, f"{name}: two torch backward runs")
        assert_bitwise_equal(a, e, f"{name}: torch vs jax")


@pytest.mark.skipif(not GPU, reason="larger shapes on the GPU only (CI time)")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_gpu_larger_shapes(dtype):
    c = make_case([(300, 700), (512, 512), (64, 1000)], 8, 2, 128, dtype, nb=16, local=4, stride=4, bs=64)
    check_grads(TestTorch().grads(c, 0.1), reference(c, 0.1), dtype)
    j = TestJax().grads(c, 0.1, jit=True)
    for a, b in zip(TestTorch().grads(c, 0.1), j):
        assert_bitwise_equal(a, b, "torch vs jax")


@pytest.mark.skipif(not GPU, reason="the Gluon kernel runs on sm_90 GPUs only")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("gluon", [False, True])
def test_gpu_backward_kernel_forms(dtype, gluon):
    """The Triton dQ and dK/dV kernels, and the Gluon ones (which apply here on
    sm_90), against the reference: sequences starting mid-block
    (past % 64 != 0), partial last key tiles, GQA, per-head layout."""
    import adapters.jax as aj
    from core_kernels.blocksparse_attention import BlocksparseBackwardConfig
    c = make_case([(300, 700), (512, 512), (64, 1000)], 8, 2, 128, dtype, nb=16, local=4, stride=4, bs=64)
    args = [to_jax(c[n]) for n in ("q", "k", "v")]
    idx = (to_jax(c["cu_k"]), to_jax(c["cu_q"]), 0.1, (to_jax(c["crow"]), to_jax(c["col"])))
    opts = dict(block_size=c["bs"], max_seqlen=c["max_seqlen"])
    out, lse = aj.blocksparse_flash_attn_varlen_fwd_lse(*args, *idx, **opts)
    config = BlocksparseBackwardConfig(64, 64, 4, 4, 2, gluon, gluon)
    got = aj.blocksparse_flash_attn_varlen_backward(*args, out, lse, to_jax(c["go"]), *idx, **opts, config=config)
    check_grads([np.asarray(x) for x in got], reference(c, 0.1), dtype)


def test_h200_backward_plans_and_config_errors():
    """The backward plans made for the H200 here (no kernels run): the Gluon dQ and
    dK/dV kernels in their scope (bf16/fp16, D 128, 64-token blocks), the Triton
    ones outside it or when the config asks; bad configs named before any launch."""
    from core_kernels._plan import ArrayInfo
    from core_kernels._target import Target
    from core_kernels.blocksparse_attention import BlocksparseBackwardConfig, plan_blocksparse_attention_backward
    h200 = Target("cuda", 90, 132, gluon=True)

    def plan(dtype, config=None, d=128):
        q, k = ArrayInfo.contiguous((4096, 32, d), dtype), ArrayInfo.contiguous((4096, 8, d), dtype)
        cu = ArrayInfo.contiguous((2,), "int32")
        crow, col = ArrayInfo.contiguous((32, 65), "int32"), ArrayInfo.contiguous((32, 600), "int32")
        lse = ArrayInfo.contiguous((4096, 32), "float32")
        p = plan_blocksparse_attention_backward(h200, q, k, k, q, lse, q, cu, cu, crow, col, block_size=64,
                                                max_seqlen=4096, config=config)
        return [launch.kernel.fn.__name__ for launch in p.launches]

    gluon = ["_bsattn_bwd_colmask_kernel", "_bsattn_bwd_dq_gluon_kernel", "_bsattn_bwd_dkdv_gluon_kernel"]
    triton = ["_bsattn_bwd_colmask_kernel", "_bsattn_bwd_dq_kernel", "_bsattn_bwd_dkdv_kernel"]
    assert plan("bfloat16") == gluon and plan("float16") == gluon
    assert plan("float32") == triton and plan("bfloat16", d=64) == triton
    assert plan("bfloat16", BlocksparseBackwardConfig(dkdv_gluon=False, dq_gluon=False)) == triton
    assert plan("bfloat16", BlocksparseBackwardConfig(dq_warps=8)) == [triton[0], triton[1], gluon[2]]
    for bad, field in ((BlocksparseBackwardConfig(dkdv_gluon=1), "dkdv_gluon"),
                       (BlocksparseBackwardConfig(block_m=48), "block_m")):
        with pytest.raises(ValueError, match=field):
            plan("bfloat16", bad)
