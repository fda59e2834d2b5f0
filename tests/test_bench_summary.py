"""benchmarks/summary.py: each bench module's rows mapped to the uniform summary
schema, and summary.json's merge (also through benchmarks.run). CPU only, no
kernels: the rows are synthetic, shaped like the committed benchmarks/results JSON.
"""
from __future__ import annotations

import json
import sys
import types

import pytest

from benchmarks import run as bench_run
from benchmarks.summary import FIELDS, summary_rows, write_summary


def by_case(rows):
    out = {r["case"]: r for r in rows}
    assert len(out) == len(rows), "case names must be unique within an op"
    for r in rows:
        assert tuple(r) == FIELDS
    return out


def check(row, **want):
    for k, v in want.items():
        if isinstance(v, float):
            assert row[k] == pytest.approx(v, rel=1e-12), k
        else:
            assert row[k] == v, k


def test_blocksparse_attention():
    rows = [
        dict(name="prefill-1x16384", variant="default", time_us=1400.0, tflops=360.0,
             pct_roofline=51.4, sdpa_us=3800.0, speedup_vs_sdpa=3800 / 1400, vs_baseline=1.09,
             gpu_us=1403.5, jax_torch_ratio=1.002, bitwise_equal=True),
        dict(name="decode-64x4096", variant="groupNone-splits4", time_us=185.0, tflops=7.96,
             pct_roofline=10.0, sdpa_us=957.9, speedup_vs_sdpa=957.9 / 185),
        dict(name="mixed-2pf2048+2ctx4096q512+28dec4096", variant="default", time_us=355.4,
             tflops=214.0, pct_roofline=30.5, sdpa_us=None, speedup_vs_sdpa=None),
    ]
    s = by_case(summary_rows("blocksparse_attention", rows))
    assert list(s) == ["prefill-1x16384 / default", "decode-64x4096 / groupNone-splits4",
                       "mixed-2pf2048+2ctx4096q512+28dec4096 / default"]
    check(s["prefill-1x16384 / default"], op="blocksparse_attention", dtype="bfloat16",
          time_us=1400.0, metric="TFLOP/s", value=360.0, baseline="torch SDPA (dense causal)",
          baseline_us=3800.0, ratio=3800 / 1400)
    check(s["decode-64x4096 / groupNone-splits4"], time_us=185.0, value=7.96, ratio=957.9 / 185)
    check(s["mixed-2pf2048+2ctx4096q512+28dec4096 / default"], time_us=355.4, value=214.0,
          baseline=None, baseline_us=None, ratio=None)


def test_composability():
    rows = [dict(case="merge V8 x N512 H32 D128 bf16", what="vmap", us=99.0, baseline="loop of calls",
                 baseline_us=209.0, ratio=209 / 99, bitwise=True),
            dict(case="lightning B1 H64 N4096 D128 bf16", what="1-device mesh, heads sharded", us=85.0,
                 baseline="unsharded", baseline_us=89.0, ratio=89 / 85, bitwise=True)]
    s = by_case(summary_rows("composability", rows))
    check(s["merge V8 x N512 H32 D128 bf16 / vmap"], dtype="bfloat16", time_us=99.0, metric=None,
          value=None, baseline="loop of calls", baseline_us=209.0, ratio=209 / 99)
    check(s["lightning B1 H64 N4096 D128 bf16 / 1-device mesh, heads sharded"], time_us=85.0,
          baseline="unsharded", baseline_us=89.0, ratio=89 / 85)


def test_scaleout():
    rows = [dict(name="merge_attn_states N16384 H32 D128 bf16", framework="torch", variant="heads",
                 one_gpu_us=102.0, us=53.0, speedup=102 / 53, bitwise=True, baseline="one GPU (same process)",
                 baseline_us=102.0),
            dict(name="lightning_attention_cp B1 H64 N65536 float32 fwd", framework="jax", variant="cp",
                 one_gpu_us=900.0, us=500.0, speedup=1.8),
            dict(name="(all)", framework="torch", error="torchrun exited 1")]
    s = by_case(summary_rows("scaleout", rows))
    assert len(s) == 2
    check(s["merge_attn_states N16384 H32 D128 bf16 / torch / heads"], dtype="bfloat16", time_us=53.0,
          metric="x one GPU", value=102 / 53, baseline="one GPU (same process)", baseline_us=102.0,
          ratio=102 / 53)
    check(s["lightning_attention_cp B1 H64 N65536 float32 fwd / jax / cp"], dtype="float32", time_us=500.0,
          baseline_us=900.0, ratio=1.8)


def test_lightning_attention():
    nbytes = 5.0e8  # bytes per call; TB/s = nbytes / t
    t, t_c, t_jax, t_b = 139.0, 297.0, 140.0, 750.0
    rows = [
        dict(name="copy-bandwidth", **{"TB/s": 4.25}, run="2026-11-21 3cc5048"),
        dict(name="decode-B64-bfloat16", us=t, **{"TB/s": nbytes / t / 1e6, "%copy": 90.0},
             jax_us=t_jax, torch_pipe_us=138.0, bitwise=True, baseline="vllm-kernel(same H200)",
             baseline_us=169.0, vs_baseline=169 / t, graph_us=137.0),
        # rows that time the baseline itself: us == baseline_us, vs_baseline = baseline / ours
        dict(name="decode-B64-bfloat16-torch.compile", us=t_c, **{"TB/s": nbytes / t_c / 1e6},
             baseline="torch.compile", baseline_us=t_c, vs_baseline=t_c / t),
        dict(name="decode-B64-bfloat16-jnp-jit", us=t_b, **{"TB/s": nbytes / t_b / 1e6},
             baseline="jnp under jax.jit", baseline_us=t_b, vs_baseline=t_b / t_jax),
        dict(name="prefill-B1-H64-N4096-float32-final", us=182.0, **{"TB/s": 2.97}, jax_us=185.0),
        dict(name="sweep-decode-B64-bf16-be64-w2", us=140.4, **{"TB/s": 3.82}),
        dict(name="prefill-B1-H64-N4096-float16", error="RuntimeError('out of shared memory')"),
    ]
    s = by_case(summary_rows("lightning_attention", rows))
    assert list(s) == ["decode-B64-bfloat16", "decode-B64-bfloat16-torch.compile",
                       "decode-B64-bfloat16-jnp-jit", "prefill-B1-H64-N4096-float32-final",
                       "sweep-decode-B64-bf16-be64-w2"]  # reference and error rows skipped
    check(s["decode-B64-bfloat16"], dtype="bfloat16", time_us=t, metric="TB/s", value=nbytes / t / 1e6,
          baseline="vllm-kernel(same H200)", baseline_us=169.0, ratio=169 / t)
    # turned round: our time, our TB/s, the baseline's time
    check(s["decode-B64-bfloat16-torch.compile"], time_us=t, value=nbytes / t / 1e6,
          baseline="torch.compile", baseline_us=t_c, ratio=t_c / t)
    check(s["decode-B64-bfloat16-jnp-jit"], time_us=t_jax, value=nbytes / t_jax / 1e6,
          baseline="jnp under jax.jit", baseline_us=t_b, ratio=t_b / t_jax)
    check(s["prefill-B1-H64-N4096-float32-final"], dtype="float32", time_us=182.0, value=2.97,
          baseline=None, baseline_us=None, ratio=None)
    check(s["sweep-decode-B64-bf16-be64-w2"], dtype="bfloat16", time_us=140.4)


def test_lightning_varlen():
    rows = [dict(name="copy-bandwidth", **{"TB/s": 4.247}),
            dict(name="varlen-B16-mixed256-8192-float32", us=4820.0, **{"TB/s": 1.426, "%copy": 33.6},
                 x_floor=2.98, loop_us=5153.0, x_loop=5153 / 4820, jax_us=4900.0, bitwise=True, items=16),
            dict(name="sweep-varlen-B16-mixed256-8192-bfloat16-segment_len0", us=1290.8,
                 **{"TB/s": 2.714}, items=16)]
    s = by_case(summary_rows("lightning_varlen", rows))
    assert len(s) == 2
    check(s["varlen-B16-mixed256-8192-float32"], dtype="float32", time_us=4820.0, metric="TB/s",
          value=1.426, baseline="loop of lightning_attention calls", baseline_us=5153.0,
          ratio=5153 / 4820)
    check(s["sweep-varlen-B16-mixed256-8192-bfloat16-segment_len0"], dtype="bfloat16",
          time_us=1290.8, value=2.714, baseline=None, ratio=None)


def test_merge_attn_states():
    rows = [dict(name="copy-bandwidth", **{"TB/s": 4.25}),
            dict(name="sweep-float16-tile2048-w2", torch_us=112.5, **{"TB/s": 3.635, "%copy": 85.5}),
            dict(name="host-overhead-N1-32x128-bf16", torch_us=38.0, torch_with_ctx_us=37.8,
                 plain_triton_us=20.7, jax_us=33.1),
            dict(name="llama8b-N1-bfloat16", n=1, h=32, d=128, dtype="bfloat16", torch_us=6.08,
                 **{"TB/s": 0.0041, "%copy": 0.1}, jax_us=31.8, bitwise=True),
            dict(name="llama8b-N64-bfloat16", n=64, h=32, d=128, dtype="bfloat16", torch_us=5.9,
                 **{"TB/s": 0.27, "%copy": 6.4}, jax_us=31.0, vllm_us=6.3, vs_vllm=6.3 / 5.9,
                 baseline="vLLM merge_attn_states kernel", baseline_us=6.3),
            dict(name="llama8b-N16384-float32", n=16384, h=32, d=128, dtype="float32", torch_us=195.1,
                 **{"TB/s": 4.16, "%copy": 97.9}, jax_us=190.0, compile_us=205.1,
                 jnp_us=220.0, vs_compile=205.1 / 195.1, vs_jnp=1.15, vllm_us=690.0,
                 baseline="torch.compile", baseline_us=205.1)]
    s = by_case(summary_rows("merge_attn_states", rows))
    assert list(s) == ["sweep-float16-tile2048-w2", "llama8b-N1-bfloat16", "llama8b-N64-bfloat16",
                       "llama8b-N16384-float32"]
    check(s["sweep-float16-tile2048-w2"], dtype="float16", time_us=112.5, metric="TB/s", value=3.635,
          baseline=None, baseline_us=None, ratio=None)
    check(s["llama8b-N1-bfloat16"], dtype="bfloat16", time_us=6.08, value=0.0041, baseline=None)
    # below 4096 tokens the row's baseline is vLLM's kernel, from 4096 torch.compile
    check(s["llama8b-N64-bfloat16"], dtype="bfloat16", time_us=5.9, value=0.27,
          baseline="vLLM merge_attn_states kernel", baseline_us=6.3, ratio=6.3 / 5.9)
    check(s["llama8b-N16384-float32"], dtype="float32", time_us=195.1, value=4.16,
          baseline="torch.compile", baseline_us=205.1, ratio=205.1 / 195.1)


def test_prefix_prefill():
    cfg = "(128, 128, 8, 3, True, 1, False)"
    rows = [dict(name="dense-bf16-matmul", **{"TFLOP/s": 709.7}),
            dict(name="B4-q1024-ctx4096-fp16", config="default", torch_us=727.8,
                 **{"TFLOP/s": 425.0, "%matmul": 59.9}, vs_baseline=425 / 139, max_err=3e-4),
            dict(name="B4-q1024-ctx4096-fp16", config=cfg, torch_us=1111.0,
                 **{"TFLOP/s": 278.4, "%matmul": 39.2}, vs_baseline=278.4 / 139, max_err=3e-4),
            dict(name="B4-q1024-ctx4096-fp16", config="default-pipelined", torch_pipe_us=702.9,
                 jax_us=717.4, **{"jax/torch": 1.02}, bitwise=True, best_config="None"),
            dict(name="B4-q1024-ctx4096-bf16-fp8kv", config=cfg, error="OutOfResources()"),
            dict(name="torch-sdpa-causal-B1-8192-bf16", torch_us=988.2,
                 **{"TFLOP/s": 556.4, "%matmul": 78.4})]
    s = by_case(summary_rows("prefix_prefill", rows))
    assert list(s) == ["B4-q1024-ctx4096-fp16 / default", f"B4-q1024-ctx4096-fp16 / {cfg}"]
    # baseline: the modelled kernel's 139 TFLOP/s on the same FLOPs
    check(s["B4-q1024-ctx4096-fp16 / default"], dtype="float16", time_us=727.8, metric="TFLOP/s",
          value=425.0, baseline="modelled kernel at 139 TFLOP/s", baseline_us=727.8 * 425 / 139,
          ratio=425 / 139)
    check(s[f"B4-q1024-ctx4096-fp16 / {cfg}"], time_us=1111.0, value=278.4, ratio=278.4 / 139)


def test_unknown_op_and_no_rows():
    rows = [dict(name="x-bf16", config="a", torch_us=10.0, **{"TFLOP/s": 5.0}, baseline="ref",
                 baseline_us=25.0),
            dict(name="y-fp32", us=4.0, **{"TB/s": 2.0}),
            dict(name="only-a-rate", **{"TB/s": 1.0}),
            "not a row"]
    s = by_case(summary_rows("some_new_op", rows))
    check(s["x-bf16 / a"], op="some_new_op", dtype="bfloat16", time_us=10.0, metric="TFLOP/s",
          value=5.0, baseline="ref", baseline_us=25.0, ratio=2.5)
    check(s["y-fp32"], dtype="float32", time_us=4.0, metric="TB/s", value=2.0, baseline=None, ratio=None)
    assert len(s) == 2
    # the backward benches' run() returns None
    assert summary_rows("blocksparse_backward", None) == []
    assert summary_rows("lightning_attention", []) == []


def read(path):
    doc = json.loads(path.read_text())
    assert set(doc) == {"generated", "rows"} and doc["generated"][:2] == "20"
    return doc["rows"]


VARLEN = [dict(name="varlen-B2-32768-bfloat16", us=1610.0, **{"TB/s": 2.68}, loop_us=2712.0)]
MERGE = [dict(name="llama8b-N1-bfloat16", dtype="bfloat16", torch_us=6.0, **{"TB/s": 0.004})]


def test_write_summary_merges(tmp_path):
    write_summary(tmp_path, {"lightning_varlen": VARLEN, "merge_attn_states": MERGE})
    rows = read(tmp_path / "summary.json")
    assert [(r["op"], r["case"]) for r in rows] == [("lightning_varlen", "varlen-B2-32768-bfloat16"),
                                                    ("merge_attn_states", "llama8b-N1-bfloat16")]
    assert rows[0]["ratio"] == pytest.approx(2712 / 1610)
    # running one op again replaces its rows and keeps the other's
    new = [dict(VARLEN[0], us=1000.0), dict(VARLEN[0], name="varlen-B2-32768-float32", us=6000.0)]
    write_summary(tmp_path, {"lightning_varlen": new})
    rows = read(tmp_path / "summary.json")
    assert [(r["op"], r["case"], r["time_us"]) for r in rows] == [
        ("lightning_varlen", "varlen-B2-32768-bfloat16", 1000.0),
        ("lightning_varlen", "varlen-B2-32768-float32", 6000.0),
        ("merge_attn_states", "llama8b-N1-bfloat16", 6.0)]
    # an op that ran with no rows drops its old ones
    write_summary(tmp_path, {"merge_attn_states": None})
    assert {r["op"] for r in read(tmp_path / "summary.json")} == {"lightning_varlen"}
    # an unreadable summary.json is replaced
    (tmp_path / "summary.json").write_text("{not json")
    write_summary(tmp_path, {"merge_attn_states": MERGE})
    assert [r["op"] for r in read(tmp_path / "summary.json")] == ["merge_attn_states"]


def test_run_writes_summary(tmp_path, monkeypatch, capsys):
    """benchmarks.run: summary.json of the ops that ran, a failed op's old rows kept,
    a bench whose run() returns None (no COLUMNS either) does not stop the run."""
    def fake(name, run, columns=True):
        mod = types.ModuleType(f"benchmarks.bench_{name}")
        mod.run = run
        if columns:
            mod.COLUMNS = ["name", "us"]
        monkeypatch.setitem(sys.modules, mod.__name__, mod)

    def boom():
        raise RuntimeError("no GPU")
    write_summary(tmp_path, {"merge_attn_states": MERGE, "lightning_varlen": VARLEN})
    fake("lightning_varlen", lambda: [dict(VARLEN[0], us=800.0)])
    fake("merge_attn_states", boom)
    fake("blocksparse_backward", lambda: None, columns=False)
    rc = bench_run.main(["lightning_varlen", "merge_attn_states", "blocksparse_backward",
                         "--out", str(tmp_path)])
    assert rc == 1  # merge failed
    rows = read(tmp_path / "summary.json")
    assert [(r["op"], r["time_us"]) for r in rows] == [("lightning_varlen", 800.0),
                                                      ("merge_attn_states", 6.0)]
    assert json.loads((tmp_path / "bench_lightning_varlen.json").read_text())[0]["us"] == 800.0
