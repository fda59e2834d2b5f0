"""Experiment (GPU): batch invariance at real shapes, and what it costs.

    python3 -m benchmarks.experiments.exp_batch_invariance check [OUT.json]   # bitwise checks
    python3 -m benchmarks.experiments.exp_batch_invariance time [OUT.json]    # lightning prefill timings

``check``: with ``batch_invariant=True`` one call equals the calls on its halves (heads,
or sequences) bit for bit, on the GPU's own kernels (Gluon where they run): lightning
prefill B1 H64 N4096 (bf16, fp32), B2 H8 N16384 (segmented rows), its backward, varlen
over the issue-22 batch, block-sparse decode, prefix prefill (and its paged and gathered
context with equal tiles), merge; and, for the record, whether the default plans are
(lightning's are not). Also the Gluon prefill with a 2- and a 4-deep load ring (the
ring's depth must not change a value: invariant plans let it follow the grid).

``time``: lightning prefill (per-block states) with the default and the batch-invariant
plan, GPU time (CUDA events, cold L2: timing.kernel_time_torch) at the headline shapes
and at the shapes where the two differ. A tree without the option times the default
only (the baseline of a comparison run with PYTHONPATH on that tree).
"""
from __future__ import annotations

import inspect
import json
import sys

import torch

DEV = "cuda"


def _r(*shape, dtype=torch.bfloat16, scale=1.0, g=None):
    return (torch.randn(shape, generator=g, device=DEV) * scale).to(dtype)


def _equal(a, b):
    a = a if isinstance(a, (tuple, list)) else (a,)
    b = b if isinstance(b, (tuple, list)) else (b,)
    return all(torch.equal(x, y) for x, y in zip(a, b))


def _cat(parts, dim):
    return tuple(torch.cat([p[i] for p in parts], dim) for i in range(len(parts[0])))


def check():
    import adapters.torch as at
    from core_kernels.blocksparse_attention import build_sparse_layout
    from core_kernels.lightning_attention import LightningGluonConfig
    from core_kernels.prefix_prefill import PrefixPrefillConfig
    g = torch.Generator(device=DEV).manual_seed(0)
    rows = []

    def record(what, ok, **extra):
        rows.append(dict(what=what, bitwise=bool(ok), **extra))
        print(rows[-1], flush=True)

    # lightning prefill: heads halves (Gluon kernels at D = 128)
    for dtype in (torch.bfloat16, torch.float32):
        q, k, v = (_r(1, 64, 4096, 128, dtype=dtype, scale=0.3, g=g) for _ in range(3))
        ed = torch.linspace(0.01, 0.5, 64, device=DEV)
        for inv in (True, False):
            f = lambda q, k, v, ed: at.lightning_attention(q, k, v, ed, batch_invariant=inv)  # noqa: E731
            whole = f(q, k, v, ed)
            halves = _cat([f(q[:, s], k[:, s], v[:, s], ed[s]) for s in (slice(0, 32), slice(32, 64))], 1)
            record(f"lightning B1 H64 N4096 {dtype} heads, {'batch_invariant' if inv else 'default'}",
                   _equal(whole, halves))
        rings = [at.lightning_attention(q, k, v, ed, config=LightningGluonConfig(num_segments=1, stages=st))
                 for st in ((2, 4) if dtype == torch.bfloat16 else (2,))]
        if len(rings) == 2:
            record("lightning gluon bf16 B1 H64 N4096: load ring 2 vs 4", _equal(*rings))
    # segmented rows (N > 8192): heads and batch halves
    q, k, v = (_r(2, 8, 16384, 128, scale=0.3, g=g) for _ in range(3))
    ed = torch.linspace(0.01, 0.5, 8, device=DEV)
    f = lambda q, k, v, ed: at.lightning_attention(q, k, v, ed, batch_invariant=True)  # noqa: E731
    whole = f(q, k, v, ed)
    record("lightning B2 H8 N16384 bf16 heads, batch_invariant (2 segments)",
           _equal(whole, _cat([f(q[:, s], k[:, s], v[:, s], ed[s]) for s in (slice(0, 4), slice(4, 8))], 1)))
    record("lightning B2 H8 N16384 bf16 batch rows, batch_invariant",
           _equal(whole, _cat([f(q[s], k[s], v[s], ed) for s in (slice(0, 1), slice(1, 2))], 0)))
    # backward (the forward kernels' form: ed constant)
    q, k, v = (_r(1, 64, 4096, 128, scale=0.3, g=g).requires_grad_(True) for _ in range(3))
    ed = torch.linspace(0.01, 0.5, 64, device=DEV)

    def grads(q, k, v, ed):
        o, kv = at.lightning_attention(q, k, v, ed, output_final_state_only=True, batch_invariant=True)
        return torch.autograd.grad(o.float().square().sum() + kv.sum(), (q, k, v))
    whole = grads(q, k, v, ed)
    halves = _cat([grads(q[:, s].detach().requires_grad_(True), k[:, s].detach().requires_grad_(True),
                         v[:, s].detach().requires_grad_(True), ed[s]) for s in (slice(0, 32), slice(32, 64))], 1)
    record("lightning backward B1 H64 N4096 bf16 heads, batch_invariant", _equal(whole, halves))
    # varlen, the issue-22 batch: heads halves and the sequences in two calls
    lens = [8192, 256, 4096, 512, 1024, 7000, 300, 2048, 6000, 256, 3000, 5000, 1500, 700, 8192, 3333]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device=DEV, dtype=torch.int32)
    t = int(cu[-1])
    q, k, v = (_r(t, 64, 128, scale=0.3, g=g) for _ in range(3))
    ed = torch.linspace(0.01, 0.5, 64, device=DEV)
    for inv in (True, False):
        f = lambda q, k, v, ed, cu: at.lightning_attention_varlen(q, k, v, ed, cu, batch_invariant=inv)  # noqa: E731
        whole = f(q, k, v, ed, cu)
        heads = _cat([f(q[:, s], k[:, s], v[:, s], ed[s], cu) for s in (slice(0, 32), slice(32, 64))], 1)
        c8 = int(cu[8])
        first, second = f(q[:c8], k[:c8], v[:c8], ed, cu[:9]), f(q[c8:], k[c8:], v[c8:], ed, cu[8:] - c8)
        record(f"varlen issue-22 H64 bf16 heads, {'batch_invariant' if inv else 'default'}", _equal(whole, heads))
        record(f"varlen issue-22 H64 bf16 sequences 0-7 / 8-15, {'batch_invariant' if inv else 'default'}",
               _equal(whole, _cat([first, second], 0)))
    # block-sparse decode (Phi-3-small layout)
    for nseq, seq in ((64, 4096), (1, 16384)):
        (crow, col), _ = build_sparse_layout(32, seq, 64, 16, 8, False)
        crow, col = torch.from_numpy(crow.copy()).to(DEV), torch.from_numpy(col.copy()).to(DEV)
        cu_k = torch.arange(nseq + 1, device=DEV, dtype=torch.int32) * seq
        q, k, v = _r(nseq, 32, 128, g=g), _r(nseq * seq, 8, 128, g=g), _r(nseq * seq, 8, 128, g=g)
        for inv in (True, False):
            f = lambda q, k, v, cu, crow, col: at.blocksparse_flash_attn_varlen_fwd(  # noqa: E731
                q, k, v, cu, None, None, (crow, col), block_size=64, max_seqlen=seq, batch_invariant=inv)
            whole = f(q, k, v, cu_k, crow, col)
            heads = torch.cat([f(q[:, 16 * i:16 * i + 16], k[:, 4 * i:4 * i + 4], v[:, 4 * i:4 * i + 4], cu_k,
                                 crow[16 * i:16 * i + 16], col[16 * i:16 * i + 16]) for i in (0, 1)], 1)
            record(f"blocksparse decode {nseq}x{seq} heads, {'batch_invariant' if inv else 'default'}",
                   torch.equal(whole, heads))
            if nseq > 1:
                h = nseq // 2
                tk = int(cu_k[h])
                halves = torch.cat([f(q[:h], k[:tk], v[:tk], cu_k[:h + 1], crow, col),
                                    f(q[h:], k[tk:], v[tk:], cu_k[h:] - tk, crow, col)])
                record(f"blocksparse decode {nseq}x{seq} sequences halves, "
                       f"{'batch_invariant' if inv else 'default'}", torch.equal(whole, halves))
    # prefix prefill, Llama-8B heads: paged vs gathered context with equal tiles; heads halves
    b, ql, ctx, bs = 4, 1024, 4096, 16
    blocks = ctx // bs
    table = torch.randperm(b * blocks + 1, device=DEV)[:b * blocks].reshape(b, blocks).to(torch.int32)
    q, kk, vv = _r(b * ql, 32, 128, g=g), _r(b * ql, 8, 128, g=g), _r(b * ql, 8, 128, g=g)
    kc, vc = _r(b * blocks + 1, 8, 16, bs, 8, g=g), _r(b * blocks + 1, 8, 128, bs, g=g)
    start = torch.arange(b + 1, device=DEV, dtype=torch.int32) * ql
    seqlen = torch.full((b,), ql + ctx, device=DEV, dtype=torch.int32)

    def prefix(q, k, v, kc, vc, config=None, inv=True):
        o = torch.empty_like(q)
        at.context_attention_fwd(q, k, v, o, "auto", kc, vc, table, start, seqlen, ctx, ql, config=config,
                                 batch_invariant=inv)
        return o
    paged = prefix(q, kk, vv, kc, vc, PrefixPrefillConfig(128, 64, 8, 3, True, 1, False))
    gathered = prefix(q, kk, vv, kc, vc, PrefixPrefillConfig(128, 64, 8, 3, True, 0, True))
    record("prefix B4 q1024 ctx4096 bf16: paged vs gathered context, tiles 128x64", torch.equal(paged, gathered))
    whole = prefix(q, kk, vv, kc, vc)
    heads = torch.cat([prefix(q[:, 16 * i:16 * i + 16].contiguous(), kk[:, 4 * i:4 * i + 4].contiguous(),
                              vv[:, 4 * i:4 * i + 4].contiguous(), kc[:, 4 * i:4 * i + 4].contiguous(),
                              vc[:, 4 * i:4 * i + 4].contiguous()) for i in (0, 1)], 1)
    record("prefix B4 q1024 ctx4096 bf16 heads, batch_invariant", torch.equal(whole, heads))
    # merge
    po, so = _r(16384, 32, 128, g=g), _r(16384, 32, 128, g=g)
    pl, sl = _r(32, 16384, dtype=torch.float32, scale=3.0, g=g), _r(32, 16384, dtype=torch.float32, scale=3.0, g=g)

    def merge(po, pl, so, sl):
        o = torch.empty_like(po)
        at.merge_attn_states(o, po, pl, so, sl)
        return o
    whole = merge(po, pl, so, sl)
    heads = torch.cat([merge(po[:, s], pl[s], so[:, s], sl[s]) for s in (slice(0, 16), slice(16, 32))], 1)
    record("merge 16384x32x128 bf16 heads", torch.equal(whole, heads))
    return rows


SHAPES = [(1, 64, 4096), (4, 64, 1024), (1, 8, 65536), (1, 32, 4096), (1, 8, 4096), (1, 64, 65536)]


def time_prefill():
    import adapters.torch as at
    from benchmarks import timing
    has_option = "batch_invariant" in inspect.signature(at.lightning_attention).parameters
    rows = []
    for b, h, n in SHAPES:
        for dtype in (torch.bfloat16, torch.float32):
            q, k, v = (_r(b, h, n, 128, dtype=dtype, scale=0.3) for _ in range(3))
            ed = torch.linspace(0.01, 0.5, h, device=DEV)
            row = dict(name=f"prefill-B{b}-H{h}-N{n}-{str(dtype).split('.')[-1]}")
            for label, kw in (("default_us", {}), ("invariant_us", {"batch_invariant": True})):
                if kw and not has_option:
                    continue
                row[label] = timing.kernel_time_torch(lambda: at.lightning_attention(q, k, v, ed, **kw)) * 1e6
            if "invariant_us" in row:
                row["invariant/default"] = row["invariant_us"] / row["default_us"]
            print(row, flush=True)
            rows.append(row)
            del q, k, v
            torch.cuda.empty_cache()
    return rows


def main():
    what = sys.argv[1] if len(sys.argv) > 1 else "check"
    rows = check() if what == "check" else time_prefill()
    if len(sys.argv) > 2:
        with open(sys.argv[2], "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
