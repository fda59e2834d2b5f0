"""Demo: every op through both adapters on identical inputs.

Prints, per case: max |torch - JAX|, whether the two are bitwise equal, the
max error against the float64 numpy reference, and the time per call of each
adapter. Without a GPU the kernels run under Triton's interpreter (small
shapes); on a GPU the real kernels run (real model shapes).
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


def _lightning_cases():
    if GPU:
        yield ("lightning_attention", "prefill B1 H64 N1024 D128 bf16",
               lambda: lightning_case(1, 64, 1024, 128, "bfloat16"))
    else:
        yield ("lightning_attention", "prefill B1 H2 N100 D32 fp32",
               lambda: lightning_case(1, 2, 100, 32, "float32", block_size=32))


EXTRA_CASES.append(_lightning_cases)


def main():
    reps = 20 if GPU else 1
    print(f"device: {torch.cuda.get_device_name() if GPU else 'CPU (Triton interpreter)'}")
    header = f"{'op':<22} {'case':<34} {'max|torch-jax|':>14} {'bitwise':>8} {'rel err':>11} {'torch ms':>9} {'jax ms':>9}"
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
        diff = max(float(np.nanmax(np.abs(_np(a) - _np(b)), initial=0)) for a, b in zip(t_out, j_out))
        bitwise = all(np.array_equal(_np(a), _np(b), equal_nan=True) for a, b in zip(t_out, j_out))
        # largest error relative to the output's scale (max |reference|)
        err = max(float(np.nanmax(np.abs(_np(a) - r), initial=0))
                  / max(float(np.nanmax(np.abs(r), initial=0)), 1e-30) for a, r in zip(t_out, ref))
        ok &= bitwise
        print(f"{op:<22} {name:<34} {diff:>14.3g} {str(bitwise):>8} {err:>11.3g} "
              f"{t_time * 1e3:>9.3f} {j_time * 1e3:>9.3f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
