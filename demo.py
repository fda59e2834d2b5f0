"""Demo: every public op through both adapters on identical inputs.

Ops: merge_attn_states, mask_empty_context_lse, context_attention_fwd,
lightning_attention, linear_decode_forward_triton, lightning_attention_varlen,
blocksparse_flash_attn_varlen_fwd, LocalStridedBlockSparseAttn (whose layout
comes from get_head_sliding_step's per-head shift) and get_sparse_attn_mask.

Prints, per case: max |torch - JAX|, whether the two are bitwise equal, the
max error against the float64 numpy reference (relative to the reference's
largest finite value), and the time per call of each adapter (the first call,
which compiles, is not timed). Without a GPU the kernels run under Triton's
interpreter (small shapes, one timed call); on a GPU the real kernels run
(real model shapes, 20 timed calls).
"""
from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import core_kernels  # noqa: E402,F401  (selects the interpreter when there is no GPU)
import numpy as np  # noqa: E402
import torch  # noqa: E402

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
RNG = np.random.default_rng(0)


def _np(x):
    """torch tensor or jax array -> float64 numpy (fp8/bf16 widened)."""
    if isinstance(x, torch.Tensor):
        return x.detach().float().cpu().numpy().astype(np.float64) if x.dtype.is_floating_point \
            else x.cpu().numpy()
    return np.asarray(x).astype(np.float64)


def _timed(fn, reps):
    fn()  # warm-up / compile
    if GPU:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        out = fn()
    if GPU:
        torch.cuda.synchronize()
    import jax
    jax.block_until_ready(out)
    return out, (time.perf_counter() - t0) / reps


def _max_diff(a, b):
    """max |a - b| over the entries that differ (equal infinities and NaNs count as 0)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    return float(np.max(np.abs(a[~same] - b[~same]), initial=0))


def _rel_err(a, r):
    """Largest |a - r| over the entries where r is finite, relative to max |r| there;
    inf if a non-finite reference entry (-inf LSEs) is not matched exactly."""
    fin = np.isfinite(r)
    if not np.array_equal(a[~fin], r[~fin], equal_nan=True):
        return float("inf")
    if not fin.any():
        return 0.0
    return float(np.max(np.abs(a[fin] - r[fin]))) / max(float(np.max(np.abs(r[fin]))), 1e-30)


# ------------------------------------------------------------------ cases
def merge_case(n, h, d, dtype):
    import jax.numpy as jnp
    import adapters.jax as aj
    import adapters.torch as at
    from core_kernels.merge_attn_states import merge_attn_states_reference
    tdt = getattr(torch, dtype)
    po = torch.randn(n, h, d, dtype=tdt, device=DEVICE)
    so = torch.randn(n, h, d, dtype=tdt, device=DEVICE)
    pl = torch.randn(h, n, device=DEVICE) * 3
    sl = torch.randn(h, n, device=DEVICE) * 3
    ptwc = n - n // 4
    out = torch.empty_like(po)
    lse = torch.empty_like(pl)

    def run_torch():
        at.merge_attn_states(out, po, pl, so, sl, lse, ptwc)
        return out, lse

    jargs = [jnp.asarray(_np(t).astype(np.float32)).astype(dtype if t.dtype == tdt else "float32")
             for t in (po, pl, so, sl)]
    import jax
    f = jax.jit(aj.merge_attn_states)
    run_jax = lambda: f(*jargs, prefill_tokens_with_context=ptwc)  # noqa: E731
    ref = merge_attn_states_reference(_np(po), _np(pl), _np(so), _np(sl), ptwc)
    return run_torch, run_jax, ref


def cases():
    if GPU:
        yield "merge_attn_states", "N=16384 H=32 D=128 bf16", lambda: merge_case(16384, 32, 128, "bfloat16")
        yield "merge_attn_states", "N=1 H=32 D=128 bf16 (decode)", lambda: merge_case(1, 32, 128, "bfloat16")
    else:
        yield "merge_attn_states", "N=64 H=8 D=128 fp32", lambda: merge_case(64, 8, 128, "float32")
        yield "merge_attn_states", "N=33 H=4 D=80 fp16", lambda: merge_case(33, 4, 80, "float16")
    for extra in EXTRA_CASES:
        yield from extra()


EXTRA_CASES = []  # other ops append generators of (op, case, make) here


# ------------------------------------------------------------------ block-sparse
def blocksparse_case(seqlens, hq, hkv, d, dtype, block=64, local=16, stride=8):
    import jax
    import jax.numpy as jnp
    import adapters.jax as aj
    import adapters.torch as at
    from core_kernels.blocksparse_attention import build_sparse_layout
    from core_kernels.blocksparse_attention.reference import blocksparse_attention_reference
    tdt = getattr(torch, dtype)
    total = sum(seqlens)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(seqlens)]), dtype=torch.int32, device=DEVICE)
    q = torch.randn(total, hq, d, dtype=tdt, device=DEVICE)
    k = torch.randn(total, hkv, d, dtype=tdt, device=DEVICE)
    v = torch.randn(total, hkv, d, dtype=tdt, device=DEVICE)
    max_seqlen = max(seqlens)
    (crow, col), mask = build_sparse_layout(hq, max_seqlen, block, local, stride, homo_head=False)
    layout_t = (torch.from_numpy(np.array(crow)).to(DEVICE), torch.from_numpy(np.array(col)).to(DEVICE))
    run_torch = lambda: at.blocksparse_flash_attn_varlen_fwd(  # noqa: E731
        q, k, v, cu, cu, None, layout_t, block_size=block, max_seqlen=max_seqlen)
    jq, jk, jv = (jnp.asarray(_np(t).astype(np.float32)).astype(dtype) for t in (q, k, v))
    jcu = jnp.asarray(cu.cpu().numpy())
    layout_j = (jnp.asarray(crow), jnp.asarray(col))
    f = jax.jit(lambda q, k, v, cu: aj.blocksparse_flash_attn_varlen_fwd(
        q, k, v, cu, cu, None, layout_j, block_size=block, max_seqlen=max_seqlen))
    run_jax = lambda: f(jq, jk, jv, jcu)  # noqa: E731
    ref = blocksparse_attention_reference(_np(q), _np(k), _np(v), cu.cpu().numpy(), cu.cpu().numpy(),
                                          mask, block_size=block)
    return run_torch, run_jax, ref


def _blocksparse_cases():
    if GPU:
        yield ("blocksparse_attention", "prefill 2048+1024 Phi-3-small bf16",
               lambda: blocksparse_case([2048, 1024], 32, 8, 128, "bfloat16"))
    else:
        yield ("blocksparse_attention", "prefill 2 seqs (96, 160) fp32",
               lambda: blocksparse_case([96, 160], 4, 2, 32, "float32", block=16, local=2, stride=2))


EXTRA_CASES.append(_blocksparse_cases)


# ------------------------------------------------------------------ prefix prefill
def prefix_prefill_case(q_lens, ctx_lens, hq, hkv, d, dtype, block=16, x=8):
    import jax
    import jax.numpy as jnp
    import adapters.jax as aj
    import adapters.torch as at
    from core_kernels.prefix_prefill.reference import context_attention_reference
    tdt = getattr(torch, dtype)
    b = len(q_lens)
    total = sum(q_lens)
    nblk = [-(-c // block) for c in ctx_lens]
    max_blocks = max(max(nblk), 1)
    num_blocks = sum(nblk) + 4
    perm = RNG.permutation(num_blocks)[: b * max_blocks].reshape(b, max_blocks)  # shuffled block table
    q = torch.randn(total, hq, d, dtype=tdt, device=DEVICE)
    k = torch.randn(total, hkv, d, dtype=tdt, device=DEVICE)
    v = torch.randn(total, hkv, d, dtype=tdt, device=DEVICE)
    k_cache = torch.randn(num_blocks, hkv, d // x, block, x, dtype=tdt, device=DEVICE)
    v_cache = torch.randn(num_blocks, hkv, d, block, dtype=tdt, device=DEVICE)
    b_loc = torch.tensor(perm, dtype=torch.int32, device=DEVICE)
    b_start = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32, device=DEVICE)
    b_seq = torch.tensor(np.add(q_lens, ctx_lens), dtype=torch.int32, device=DEVICE)
    o = torch.empty_like(q)
    max_q = max(q_lens)

    def run_torch():
        at.context_attention_fwd(q, k, v, o, "auto", k_cache, v_cache, b_loc, b_start, b_seq,
                                 None, max_q)
        return o

    jx = [jnp.asarray(_np(t).astype(np.float32)).astype(dtype) for t in (q, k, v, k_cache, v_cache)]
    ji = [jnp.asarray(t.cpu().numpy()) for t in (b_loc, b_start, b_seq)]
    f = jax.jit(lambda *a: aj.context_attention_fwd(*a, max_input_len=max_q))
    run_jax = lambda: f(*jx, *ji)  # noqa: E731
    ref = context_attention_reference(_np(q), _np(k), _np(v), _np(k_cache), _np(v_cache),
                                      perm, b_start.cpu().numpy(), b_seq.cpu().numpy())
    return run_torch, run_jax, ref


def _prefix_prefill_cases():
    if GPU:
        yield ("prefix_prefill", "B4 q512 ctx1024 Llama-8B bf16",
               lambda: prefix_prefill_case([512] * 4, [1024] * 4, 32, 8, 128, "bfloat16"))
    else:
        yield ("prefix_prefill", "B3 q(16,1,9) ctx(40,0,17) fp32",
               lambda: prefix_prefill_case([16, 1, 9], [40, 0, 17], 4, 2, 32, "float32"))


EXTRA_CASES.append(_prefix_prefill_cases)


# ------------------------------------------------------------------ lightning attention
def lightning_case(b, h, n, d, dtype, block_size=256):
    import jax
    import jax.numpy as jnp
    import adapters.jax as aj
    import adapters.torch as at
    from core_kernels.lightning_attention.reference import lightning_attention_reference
    tdt = getattr(torch, dtype)
    q, k, v = (torch.randn(b, h, n, d, dtype=tdt, device=DEVICE) for _ in range(3))
    ed = torch.tensor(RNG.uniform(0.01, 1.0, h), dtype=torch.float32, device=DEVICE)
    hist = torch.randn(b, h, d, d, device=DEVICE)
    run_torch = lambda: at.lightning_attention(q, k, v, ed, block_size, hist)  # noqa: E731
    jx = [jnp.asarray(_np(t).astype(np.float32)).astype(dtype) for t in (q, k, v)]
    jed, jhist = jnp.asarray(ed.cpu().numpy()), jnp.asarray(hist.cpu().numpy())
    f = jax.jit(lambda q, k, v, ed, hh: aj.lightning_attention(q, k, v, ed, block_size=block_size,
                                                               kv_history=hh))
    run_jax = lambda: f(*jx, jed, jhist)  # noqa: E731
    ref = lightning_attention_reference(_np(q), _np(k), _np(v), ed.cpu().numpy(), block_size,
                                        hist.cpu().numpy())
    return run_torch, run_jax, ref


def decode_case(b, h, d, slots, dtype):
    import jax
    import jax.numpy as jnp
    import adapters.jax as aj
    import adapters.torch as at
    from core_kernels.lightning_attention import linear_decode_reference
    tdt = getattr(torch, dtype)
    q, k, v = (torch.randn(b, h, 1, d, dtype=tdt, device=DEVICE) for _ in range(3))
    cache0 = torch.randn(slots, h, d, d, device=DEVICE)
    slope = torch.tensor(RNG.uniform(0.01, 1.0, h), dtype=torch.float32, device=DEVICE)
    slot_idx = torch.tensor(RNG.permutation(slots)[:b], dtype=torch.int32, device=DEVICE)
    slot_idx[b // 2] = -1  # a padding row: output 0, no cache write

    def run_torch():  # the cache is updated in place: start each call from the same state
        cache = cache0.clone()
        return at.linear_decode_forward_triton(q, k, v, cache, slope, slot_idx), cache

    jx = [jnp.asarray(_np(t).astype(np.float32)).astype(dtype) for t in (q, k, v)]
    jc, js, ji = (jnp.asarray(t.cpu().numpy()) for t in (cache0, slope, slot_idx))
    f = jax.jit(aj.linear_decode_forward_triton)
    run_jax = lambda: f(*jx, jc, js, ji)  # noqa: E731
    ref = linear_decode_reference(_np(q), _np(k), _np(v), cache0.cpu().numpy(), slope.cpu().numpy(),
                                  slot_idx.cpu().numpy())
    return run_torch, run_jax, ref


def varlen_case(seqlens, h, d, slots, dtype):
    import jax
    import jax.numpy as jnp
    import adapters.jax as aj
    import adapters.torch as at
    from core_kernels.lightning_attention import lightning_attention_varlen_reference
    tdt = getattr(torch, dtype)
    total = sum(seqlens)
    q, k, v = (torch.randn(total, h, d, dtype=tdt, device=DEVICE) for _ in range(3))
    ed = torch.tensor(RNG.uniform(0.01, 1.0, h), dtype=torch.float32, device=DEVICE)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(seqlens)]), dtype=torch.int32, device=DEVICE)
    cache0 = torch.randn(slots, h, d, d, device=DEVICE)
    slot_idx = torch.tensor(list(RNG.permutation(slots)[:len(seqlens) - 1]) + [-1], dtype=torch.int32,
                            device=DEVICE)  # the last sequence starts from zero, writes nothing

    def run_torch():
        cache = cache0.clone()
        return at.lightning_attention_varlen(q, k, v, ed, cu, kv_cache=cache, slot_idx=slot_idx)

    jx = [jnp.asarray(_np(t).astype(np.float32)).astype(dtype) for t in (q, k, v)]
    jed, jcu, jc, ji = (jnp.asarray(t.cpu().numpy()) for t in (ed, cu, cache0, slot_idx))
    f = jax.jit(lambda q, k, v, ed, cu, c, s: aj.lightning_attention_varlen(q, k, v, ed, cu, kv_cache=c,
                                                                           slot_idx=s))
    run_jax = lambda: f(*jx, jed, jcu, jc, ji)  # noqa: E731
    ref = lightning_attention_varlen_reference(_np(q), _np(k), _np(v), ed.cpu().numpy(), cu.cpu().numpy(),
                                               cache0.cpu().numpy(), slot_idx.cpu().numpy())
    return run_torch, run_jax, ref


def _lightning_cases():
    if GPU:
        yield ("lightning_attention", "prefill B1 H64 N1024 D128 bf16",
               lambda: lightning_case(1, 64, 1024, 128, "bfloat16"))
    else:
        yield ("lightning_attention", "prefill B1 H2 N100 D32 fp32",
               lambda: lightning_case(1, 2, 100, 32, "float32", block_size=32))
    if GPU:
        yield ("linear_decode_forward", "B64 H64 D128 bf16, 128 slots",
               lambda: decode_case(64, 64, 128, 128, "bfloat16"))
        yield ("lightning_varlen", "4 seqs (512, 384, 128, 0) H64 D128 bf16",
               lambda: varlen_case([512, 384, 128, 0], 64, 128, 32, "bfloat16"))
    else:
        yield ("linear_decode_forward", "B4 H2 D32 fp32, 6 slots, 1 pad row",
               lambda: decode_case(4, 2, 32, 6, "float32"))
        yield ("lightning_varlen", "3 seqs (40, 0, 25) H2 D16 fp32",
               lambda: varlen_case([40, 0, 25], 2, 16, 4, "float32"))


EXTRA_CASES.append(_lightning_cases)


# ------------------------------------------------------------------ the rest of merge and block-sparse
def mask_case(h, q_lens, ctx_lens):
    import jax
    import jax.numpy as jnp
    import adapters.jax as aj
    import adapters.torch as at
    from core_kernels.merge_attn_states import mask_empty_context_lse_reference
    qs = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32, device=DEVICE)
    cs = torch.tensor(np.concatenate([[0], np.cumsum(ctx_lens)]), dtype=torch.int32, device=DEVICE)
    lse0 = torch.randn(h, sum(q_lens), device=DEVICE)

    def run_torch():
        lse = lse0.clone()
        at.mask_empty_context_lse(lse, qs, cs)
        return lse

    jl, jq, jc = (jnp.asarray(t.cpu().numpy()) for t in (lse0, qs, cs))
    f = jax.jit(aj.mask_empty_context_lse)
    run_jax = lambda: f(jl, jq, jc)  # noqa: E731
    ref = mask_empty_context_lse_reference(lse0.cpu().numpy(), qs.cpu().numpy(), cs.cpu().numpy())
    return run_torch, run_jax, ref


def module_case(seqlens, hq, hkv, d, dtype, block=16, local=2, stride=4):
    """LocalStridedBlockSparseAttn (homo_head=False: the per-head shift of
    get_head_sliding_step) in both adapters; its layout against the formula."""
    import jax
    import jax.numpy as jnp
    import adapters.jax as aj
    import adapters.torch as at
    from core_kernels.blocksparse_attention.reference import blocksparse_attention_reference
    tdt = getattr(torch, dtype)
    total, max_seqlen = sum(seqlens), max(seqlens)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(seqlens)]), dtype=torch.int32, device=DEVICE)
    q = torch.randn(total, hq, d, dtype=tdt, device=DEVICE)
    k, v = (torch.randn(total, hkv, d, dtype=tdt, device=DEVICE) for _ in range(2))
    mod_t = at.LocalStridedBlockSparseAttn(hq, max_seqlen, local, stride, block, device=DEVICE, dtype=tdt)
    mod_j = aj.LocalStridedBlockSparseAttn(hq, max_seqlen, local, stride, block, dtype=dtype)
    run_torch = lambda: mod_t(q, k, v, cu)  # noqa: E731
    jq, jk, jv = (jnp.asarray(_np(t).astype(np.float32)).astype(dtype) for t in (q, k, v))
    jcu = jnp.asarray(cu.cpu().numpy())
    f = jax.jit(lambda q, k, v, cu: mod_j(q, k, v, cu))
    run_jax = lambda: f(jq, jk, jv, jcu)  # noqa: E731
    ref = blocksparse_attention_reference(_np(q), _np(k), _np(v), cu.cpu().numpy(), cu.cpu().numpy(),
                                          mod_t.block_mask, block_size=block)
    return run_torch, run_jax, ref


def sparse_mask_case(n_heads, q_len, max_seqlen, block, local, stride, homo_head):
    """get_sparse_attn_mask (vLLM's signature) in both adapters: CSR and block mask."""
    import jax.numpy as jnp
    import adapters.jax as aj
    import adapters.torch as at
    from core_kernels.blocksparse_attention import vllm_sparse_attn_mask

    def run_torch():
        (crow, col), mask, _ = at.get_sparse_attn_mask(n_heads, q_len, max_seqlen, torch.float32, DEVICE,
                                                       block, local, stride, homo_head)
        return crow, col, mask

    def run_jax():
        (crow, col), mask, _ = aj.get_sparse_attn_mask(n_heads, q_len, max_seqlen, jnp.float32, None,
                                                       block, local, stride, homo_head)
        return crow, col, mask

    (crow, col), mask, _ = vllm_sparse_attn_mask(n_heads, q_len, max_seqlen, block, local, stride, homo_head)
    return run_torch, run_jax, (crow, col, mask)


def _more_cases():
    yield ("mask_empty_context_lse", "H4, 4 requests, 2 empty contexts",
           lambda: mask_case(4, [3, 5, 1, 7], [8, 0, 2, 0]))
    yield ("get_sparse_attn_mask", "H4 q64 of 256, block 16, per-head",
           lambda: sparse_mask_case(4, 64, 256, 16, 2, 4, False))
    if GPU:
        yield ("LocalStridedBlockSparse", "module, 2048+1024 Phi-3-small bf16",
               lambda: module_case([2048, 1024], 32, 8, 128, "bfloat16", block=64, local=16, stride=8))
    else:
        yield ("LocalStridedBlockSparse", "module, 2 seqs (40, 64) fp32",
               lambda: module_case([40, 64], 2, 1, 16, "float32"))


EXTRA_CASES.append(_more_cases)


def main():
    reps = 20 if GPU else 1
    print(f"device: {torch.cuda.get_device_name() if GPU else 'CPU (Triton interpreter)'}")
    header = f"{'op':<23} {'case':<36} {'max|torch-jax|':>14} {'bitwise':>8} {'rel err':>11} {'torch ms':>9} {'jax ms':>9}"
    print(header)
    print("-" * len(header))
    ok = True
    for op, name, make in cases():
        run_torch, run_jax, ref = make()
        t_out, t_time = _timed(run_torch, reps)
        j_out, j_time = _timed(run_jax, reps)
        t_out = t_out if isinstance(t_out, tuple) else (t_out,)
        j_out = j_out if isinstance(j_out, tuple) else (j_out,)
        ref = ref if isinstance(ref, tuple) else (ref,)
        diff = max(_max_diff(_np(a), _np(b)) for a, b in zip(t_out, j_out))
        bitwise = all(np.array_equal(_np(a), _np(b), equal_nan=True) for a, b in zip(t_out, j_out))
        err = max(_rel_err(_np(a), np.asarray(r, dtype=np.float64)) for a, r in zip(t_out, ref))
        ok &= bitwise
        print(f"{op:<23} {name:<36} {diff:>14.3g} {str(bitwise):>8} {err:>11.3g} "
              f"{t_time * 1e3:>9.3f} {j_time * 1e3:>9.3f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
