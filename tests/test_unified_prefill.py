"""unified_attention's prefill path (core_kernels/unified_attention/prefill_plan.py):
its variants under config overrides (keys gathered or read through the table, the
flat or the per-sequence grid, tiles) against the float64 reference and bit for
bit against each other, and the planner's choices at the issue's shapes. The
op's contract tests (both adapters, every option) are in test_unified_attention.py."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import test_unified_attention as tu
from core_kernels._plan import ArrayInfo
from core_kernels._target import Target
from core_kernels.unified_attention.prefill_plan import (GATHER_CONFIGS, PAGED_CONFIGS,
                                                         UnifiedPrefillConfig, choose_prefill_config)
from core_kernels.unified_attention.problem import validate
from harness import assert_bitwise_equal, rng

C = UnifiedPrefillConfig
# small tiles: several row tiles per sequence, masked and full key tiles, cache
# blocks (16) spanning key tiles (32) and the other way round
SAME_BITS = {
    "paged-per-sequence-grid": C(32, 16, 4, 2, gather=False, flat_grid=False),
    "paged-flat-grid": C(32, 16, 4, 2, gather=False, flat_grid=True),
    "gathered-per-sequence-grid": C(32, 16, 4, 2, gather=True, flat_grid=False),
    "gathered-flat-grid": C(32, 16, 4, 2, gather=True, flat_grid=True),
}
OTHERS = {
    "unpacked-heads-ids-two-ahead": C(16, 32, 4, 2, pack_gqa=False, prefetch_ids=2, gather=False,
                                      flat_grid=True),
    "wide-key-tiles-ids-now": C(64, 64, 4, 2, prefetch_ids=0, gather=False, flat_grid=False),
}
# decode rows (the decode path), prefill rows with and without context, an empty
# sequence, GQA 2:1; causal flags per sequence (the second prefill sequence not
# causal: its window is symmetric)
SEQS = [(20, 37), (1, 50), (0, 12), (33, 0), (3, 9), (26, 5)]
FLAGS = [True, True, False, False, True, True]


def _case(**kw):
    g = rng()
    opts = dict(window_size=(11, 0), softcap=2.5, sinks=(g.standard_normal(4) * 2).astype(np.float32),
                alibi_slopes=(2.0 ** -(1 + np.arange(4))).astype(np.float32), softmax_scale=0.3)
    return tu.make_case(SEQS, 4, 2, 32, 16, "float16", causal=FLAGS, window_left=11, **kw), opts


@pytest.mark.parametrize("sqrt", [False, True], ids=["alibi", "alibi-sqrt"])
def test_variants_same_bits_and_reference(sqrt):
    """Gathered and paged keys, flat and per-sequence grids: the same tiles give the
    same bits (every row's key tiles are visited in the same order), and match the
    reference with every option on (window, softcap, ALiBi, sinks, causal flags)."""
    case, opts = _case()
    opts["use_alibi_sqrt"] = sqrt
    outs = {name: tu.TestTorch().attention(case, config=cfg, **opts) for name, cfg in SAME_BITS.items()}
    first = next(iter(outs))
    tu.check(outs[first], tu.reference(case, **opts), case, first)
    for name, out in outs.items():
        assert_bitwise_equal(out, outs[first], f"{name} vs {first}")


@pytest.mark.parametrize("name", list(OTHERS))
def test_other_tilings_match_reference(name):
    case, opts = _case()
    tu.check(tu.TestTorch().attention(case, config=OTHERS[name], **opts), tu.reference(case, **opts),
             case, name)


def test_fp8_gathered_and_paged():
    """An e4m3 q and cache (uint8 bits, descales per sequence and kv head) with an
    e4m3 output: the gather widens the cache exactly, so both forms give the same bits."""
    case, opts = _case(kv="uint8", q_fp8=True, per_seq_descale=True)
    case["out_dtype"] = "bfloat16"
    outs = [tu.TestTorch().attention(case, config=SAME_BITS[n], output_scale=0.02, **opts)
            for n in ("paged-flat-grid", "gathered-per-sequence-grid")]
    assert_bitwise_equal(outs[0], outs[1], "gathered vs paged")
    tu.fp8_out_check(outs[0], tu.reference(case, **opts), 0.02, case)


SM90 = Target("cuda", 90, 132, gluon=True)


def _problem(seqs, dtype="bfloat16", width=None, max_seqlen_k=None):
    t, b = sum(q for q, _ in seqs), len(seqs)
    width = width or max(-(-L // 16) for _, L in seqs)
    cache = ArrayInfo.contiguous((b * width, 16, 8, 128), dtype)
    return validate(ArrayInfo.contiguous((t, 32, 128), dtype), cache, cache,
                    ArrayInfo.contiguous((b + 1,), "int32"), ArrayInfo.contiguous((b,), "int32"),
                    ArrayInfo.contiguous((b, width), "int32"), max_seqlen_q=max(q for q, _ in seqs),
                    max_seqlen_k=max_seqlen_k or max(L for _, L in seqs), softmax_scale=0.088)


def test_planner_choices():
    """The measured choices (the NOTEs in prefill_plan.py) at the issue's shapes."""
    gathered = dataclasses.replace(GATHER_CONFIGS[(2, 128)], gather=True, flat_grid=True)
    paged = dataclasses.replace(PAGED_CONFIGS[(2, 128)], gather=False, flat_grid=True)
    for seqs, want, cap in (([(1024, 5120)] * 4, gathered, 5120), ([(8192, 8192)], gathered, 8192),
                            ([(1, 4096)] * 127 + [(2048, 10240)], paged, 16384)):
        config, pack, ctx_cap = choose_prefill_config(SM90, _problem(seqs))
        assert (config, pack) == (want, 4), seqs[-1]
        assert ctx_cap <= cap
    # many short prefills: the per-sequence grid (no more programs than sequences x tiles)
    config = choose_prefill_config(SM90, _problem([(16, 2000)] * 256))[0]
    assert not config.flat_grid and not config.gather
    # a block table 32x wider than the batch needs: the scratch follows max_seqlen_k
    _, _, ctx_cap = choose_prefill_config(SM90, _problem([(1024, 5120)] * 4, width=320 * 32))
    assert ctx_cap == 8192
    # no measured gather table for fp32, nor for a scratch over GATHER_MAX_BYTES
    assert not choose_prefill_config(SM90, _problem([(1024, 5120)] * 4, "float32"))[0].gather
    assert not choose_prefill_config(SM90, _problem([(512, 8192)] * 64))[0].gather


def test_config_is_checked():
    p = _problem([(64, 64)])
    for bad in (C(48, 16), C(16, 8), C(32, 32, num_warps=3), C(32, 32, prefetch_ids=3),
                C(32, 32, gather=1), C(32, 32, flat_grid="yes")):
        with pytest.raises(ValueError, match="config"):
            choose_prefill_config(SM90, p, bad)
