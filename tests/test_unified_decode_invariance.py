"""unified_attention's decode path: a sequence's output is bitwise the same
whatever other sequences share the call (their number, order, lengths, the
max_seqlen bounds), whatever the work split (chunks per program) and run to
run. Through the public torch op; on the CPU under Triton's interpreter with a
small chunk size so that sequences split into several chunks (merged by the
combine kernel), on a GPU at real sizes with the planner's own config."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from core_kernels.unified_attention.decode_plan import DEFAULT_CONFIG, UnifiedDecodeConfig
from harness import DEVICE, GPU, rng
import adapters.torch as at

# CPU: 16-key tiles, 32-key chunks doubled up to 4 per sequence (lengths up to
# 300 take 1 to 4 chunks of 32 .. 128 keys); GPU: the planner's choice
CONFIG = None if GPU else UnifiedDecodeConfig(block_n=16, chunk_min=32, max_chunks=4)
LENGTHS = (5000, 70000, 3, 1024, 1025, 20000) if GPU else (300, 47, 3, 129, 64, 200)
HQ, HKV, D, BS = (32, 8, 128, 16) if GPU else (4, 2, 32, 16)


def _cache(g, num_blocks, fp8):
    x = torch.tensor(g.standard_normal((num_blocks, BS, HKV, D), np.float32))
    return (x * 2).to(torch.float8_e4m3fn) if fp8 else x.to(torch.bfloat16)


def _batch(g, seqs, k, v, num_blocks):
    """q, cu_seqlens_q, seqused_k, block_table of sequences [(qlen, L, seed)]:
    each sequence's queries and blocks come from its own seed, so the same
    sequence has the same data in any batch."""
    qs, tables = [], []
    width = max(-(-L // BS) for _, L, _ in seqs) + 1
    for qlen, L, seed in seqs:
        gs = np.random.default_rng(seed)
        qs.append(torch.tensor(gs.standard_normal((qlen, HQ, D), np.float32)).to(torch.bfloat16))
        row = np.full(width, 1 << 30, np.int64)  # slots past the sequence: never read
        row[:-(-L // BS)] = gs.integers(0, num_blocks, -(-L // BS))
        tables.append(row)
    cu = np.concatenate([[0], np.cumsum([q for q, _, _ in seqs])])
    return (torch.cat(qs).to(DEVICE), torch.tensor(cu, dtype=torch.int32, device=DEVICE),
            torch.tensor([L for _, L, _ in seqs], dtype=torch.int32, device=DEVICE),
            torch.tensor(np.stack(tables), dtype=torch.int32, device=DEVICE))


def _run(seqs, k, v, num_blocks, opts, descale_table=None, config=CONFIG):
    g = rng(0)
    q, cu, seqused, table = _batch(g, seqs, k, v, num_blocks)
    out = torch.full_like(q, float("nan"))
    kw = dict(opts)
    window, softcap = kw.pop("window_size", (-1, -1)), kw.pop("softcap", 0.0)
    if descale_table is not None:  # [B, Hkv] descales, each sequence's row by its seed
        d = torch.stack([descale_table[s % len(descale_table)] for _, _, s in seqs]).to(DEVICE)
        kw.update(k_descale=d, v_descale=d * 0.5)
    at.unified_attention(q=q, k=k, v=v, out=out, cu_seqlens_q=cu, max_seqlen_q=int(max(s[0] for s in seqs)),
                         seqused_k=seqused, max_seqlen_k=int(seqused.max()), softmax_scale=D ** -0.5,
                         causal=True, window_size=window, block_table=table, softcap=softcap,
                         q_descale=None,
                         k_descale=kw.pop("k_descale", None), v_descale=kw.pop("v_descale", None),
                         config=config, **kw)
    rows = np.concatenate([[0], np.cumsum([s[0] for s in seqs])])
    return {s[2]: out[rows[i]:rows[i + 1]].cpu() for i, s in enumerate(seqs)}


OPTIONS = {
    "bf16": ({}, False),
    "fp8 cache [B, Hkv] descales, sinks, softcap, window": (
        dict(softcap=20.0, window_size=(100 if not GPU else 3000, 0), kv_quant_mode="FP8_PER_TENSOR"), True),
}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_decode_output_independent_of_the_batch(name):
    opts, fp8 = OPTIONS[name]
    g = rng()
    num_blocks = sum(-(-L // BS) for L in LENGTHS) + 8
    k, v = (_cache(g, num_blocks, fp8).to(DEVICE) for _ in range(2))
    extra = {}
    if fp8 or "sinks" in name:
        extra["sinks"] = torch.tensor(g.standard_normal(HQ), dtype=torch.float32, device=DEVICE)
    table = torch.tensor(g.uniform(0.5, 1.5, (7, HKV)), dtype=torch.float32) if fp8 else None
    qlens = (1, 3, 1, 2, 8, 1)
    full = [(q, L, seed) for seed, (q, L) in enumerate(zip(qlens, LENGTHS))]

    def run(seqs, config=CONFIG):
        return _run(seqs, k, v, num_blocks, dict(opts, **extra), table, config)

    batch = run(full)
    again = run(full)
    # another work split: 3 consecutive chunks per program
    split = run(full, dataclasses.replace(CONFIG or DEFAULT_CONFIG, chunks_per_program=3))
    for seed, out in batch.items():
        assert not torch.isnan(out.float()).any(), f"sequence {seed}: NaN in the output"
        assert torch.equal(out, again[seed]), f"sequence {seed}: differs run to run"
        assert torch.equal(out, split[seed]), f"sequence {seed}: differs with 3 chunks per program"
    # alone, and in another batch (other order, fewer and shorter neighbours:
    # other max_seqlen_q / max_seqlen_k, fewer chunk slots)
    for seed in (0, 1, 4):
        alone = run([full[seed]])[seed]
        assert torch.equal(alone, batch[seed]), f"sequence {seed}: alone != in the batch"
    other = run([full[3], full[2], full[5]])
    for seed, out in other.items():
        assert torch.equal(out, batch[seed]), f"sequence {seed}: differs in another batch"
