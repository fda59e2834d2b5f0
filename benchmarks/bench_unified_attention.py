"""unified_attention on the GPU: ours (torch and JAX) side by side with vLLM 0.33's
kernel, the one vLLM's TRITON_ATTN backend runs, in the same run.

vLLM's kernel is read from its own file in the git-ignored .peer/vllm_src/
(``python -m tools.peer_check --fetch``; the file's commit and sha256 are in
tools/peer_check_shim/MANIFEST.json) and imported through the peer_check shim
(built under .peer/shim/bench); the package never imports it. Without .peer/
the vLLM columns stay empty. vLLM's backend calls it with seq_threshold_3D =
128 // Hkv and 16 softmax segments (its split-KV "3D" path for batches of at
most that many decodes); so does this benchmark.

Shapes (benchmarks/registry.py UNIFIED_SHAPES): 32/8 heads x 128, cache block
16, bf16. Per case: ``torch_us`` our torch launch and ``vllm_us`` vLLM's, GPU
time after warm-up with the L2 flushed (timing.kernel_time_torch); ``jax_us``
ours under jax.jit as back-to-back calls with one sync (timing.pipelined_time;
``torch_pipe_us`` the torch call timed the same way, ``jax/torch`` their ratio).
Rates: decode ``TB/s`` = K and V bytes read (sum of seqused_k x Hkv x D x 2 x
itemsize) / time, ``%roofline`` of the device-to-device copy rate measured in
this run; prefill and mixed ``TFLOP/s`` = 4 x D x Hq x (visible keys summed over
query rows, causal) / time, ``%roofline`` of the dense bf16 matmul rate measured
in this run. ``vs_vllm`` = vllm_us / torch_us (> 1: ours is faster);
``max_diff_vllm`` = max |ours - vLLM| over the output; ``max_err`` = max |ours -
ref| / max |ref| over the last rows of one sequence, ref in float32 torch;
``bitwise``: torch == JAX. A host-overhead row (decode B1 x 64 keys): torch eager
host time per call vs a plain Triton launch of the same kernels (as
bench_host_overhead.py measures the other ops), vLLM's Python wrapper, and JAX.

UNIFIED_ONLY=a,b runs the cases whose name contains a or b (and "host").
``python -m benchmarks.bench_unified_attention --smoke`` (CPU, Triton's
interpreter): tiny shapes through the same input, accounting and reference
code, vLLM's kernel against the reference, ours where it runs.
"""
from __future__ import annotations

import gc
import hashlib
import importlib
import json
import os
import sys
import traceback
from pathlib import Path

import numpy as np

from benchmarks.registry import UNIFIED_MODEL, UNIFIED_SHAPES

COLUMNS = ["name", "torch_us", "TB/s", "TFLOP/s", "%roofline", "vllm_us", "vs_vllm", "jax_us",
           "torch_pipe_us", "jax/torch", "bitwise", "max_diff_vllm", "max_err", "error"]
HOST_COLUMNS = ["triton_us", "x_triton", "vllm_host_us", "jax_host_us"]
ROOT = Path(__file__).resolve().parent.parent
PEER = ROOT / ".peer"
VLLM_MODULE = "vllm.v1.attention.ops.triton_unified_attention"
VLLM_FILES = ("vllm/v1/attention/ops/triton_unified_attention.py",
              "vllm/v1/attention/ops/triton_quant_kv/_helpers.py")
# vLLM's TRITON_ATTN backend: the 3D (split-KV) path for at most 128 // Hkv decodes, 16 segments
MIN_LAUNCH_GRID_SIZE_2D = 128
NUM_PAR_SOFTMAX_SEGMENTS = 16
BASELINE = "vLLM 0.33 unified_attention (same run)"
FP8_DESCALE = 0.5


# --------------------------------------------------------------------------- vLLM's kernel
def vllm_unified(peer: Path = PEER):
    """(vLLM's triton_unified_attention module, its commit) from ``peer``, imported
    through the peer_check shim; (None, reason) when its files are absent or differ
    from the manifest."""
    manifest = json.loads((ROOT / "tools" / "peer_check_shim" / "MANIFEST.json").read_text())
    entries = {e["path"]: e for e in manifest["files"]}
    for rel in VLLM_FILES:
        path = peer / "vllm_src" / rel
        if not path.exists():
            return None, f"{path} absent (python -m tools.peer_check --fetch)"
        if hashlib.sha256(path.read_bytes()).hexdigest() != entries[rel]["sha256"]:
            return None, f"{path}: sha256 differs from tools/peer_check_shim/MANIFEST.json"
    from tools.peer_check import build_shim
    root = build_shim("vllm", peer, peer / "shim" / "bench").resolve()
    if str(root) not in sys.path:
        sys.path.append(str(root))  # after the repository: our own `tests` package stays ours
    module = importlib.import_module(VLLM_MODULE)
    if root not in Path(module.__file__).resolve().parents:
        raise RuntimeError(f"{VLLM_MODULE} came from {module.__file__}, not the shim at {root} "
                           "(another vllm package is installed)")
    return module, entries[VLLM_FILES[0]]["commit"]


# --------------------------------------------------------------------------- inputs and accounting
def visible_pairs(seqs) -> int:
    """Causal (query, key) pairs: query i of a sequence with L keys and q new tokens sees
    L - q + i + 1 keys."""
    return sum(q * (kv - q) + q * (q + 1) // 2 for q, kv in seqs)


def useful_flops(seqs, hq, d) -> int:
    return 4 * hq * d * visible_pairs(seqs)


def kv_bytes(seqs, hkv, d, itemsize) -> int:
    """K and V bytes a pass over every sequence's keys reads."""
    return 2 * sum(kv for _, kv in seqs) * hkv * d * itemsize


def is_decode(seqs) -> bool:
    return all(q == 1 for q, _ in seqs)


def make_inputs(seqs, opts, device="cuda", model=UNIFIED_MODEL, dtype="bfloat16", seed=0):
    """q [T, Hq, D], the paged cache k, v [num_blocks, block_size, Hkv, D] (random,
    blocks in random order), cu_seqlens_q, seqused_k, block_table and the keyword
    arguments vLLM's backend passes (descales, 3D-path buffers)."""
    import torch
    hq, hkv, d, bs = model["hq"], model["hkv"], model["d"], model["block_size"]
    g = torch.Generator(device=device).manual_seed(seed)
    tdt = getattr(torch, dtype)
    t = sum(q for q, _ in seqs)
    nblk = [-(-kv // bs) for _, kv in seqs]
    num_blocks = max(1, sum(nblk))
    rnd = lambda *shape: torch.randn(*shape, device=device, generator=g, dtype=torch.float32)
    fp8 = bool(opts.get("kv_fp8"))
    cdt = torch.float8_e4m3fn if fp8 else tdt
    q = rnd(t, hq, d).to(tdt)
    k = rnd(num_blocks, bs, hkv, d).to(cdt)
    v = rnd(num_blocks, bs, hkv, d).to(cdt)
    perm = torch.randperm(num_blocks, device=device, generator=g).to(torch.int32)
    table = torch.zeros(len(seqs), max(nblk), dtype=torch.int32, device=device)
    pos = 0
    for i, n in enumerate(nblk):
        table[i, :n] = perm[pos:pos + n]
        pos += n
    qlens = torch.tensor([q for q, _ in seqs], dtype=torch.int32, device=device)
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int32, device=device)
    cu[1:] = torch.cumsum(qlens, 0)
    seqused = torch.tensor([kv for _, kv in seqs], dtype=torch.int32, device=device)
    # vLLM's backend: the layer's scalar scale expanded to [B, Hkv]
    descale = (torch.tensor(FP8_DESCALE, device=device).expand(len(seqs), hkv) if fp8 else None)
    threshold = MIN_LAUNCH_GRID_SIZE_2D // hkv
    segs = NUM_PAR_SOFTMAX_SEGMENTS
    dp = 1 << (d - 1).bit_length()
    return dict(model=model, q=q, k=k, v=v, cu_seqlens_q=cu, seqused_k=seqused, block_table=table,
                max_seqlen_q=max(q for q, _ in seqs), max_seqlen_k=max(kv for _, kv in seqs),
                softmax_scale=d ** -0.5, k_descale=descale, v_descale=descale, kv_fp8=fp8,
                seq_threshold_3D=threshold, num_par_softmax_segments=segs,
                softmax_segm_output=torch.empty(threshold, hq, segs, dp, dtype=torch.float32,
                                                device=device),
                softmax_segm_max=torch.empty(threshold, hq, segs, dtype=torch.float32, device=device),
                softmax_segm_expsum=torch.empty(threshold, hq, segs, dtype=torch.float32,
                                                device=device))


def _kwargs(inp, out):
    """vLLM's unified_attention keywords, as its backend passes them (no sliding
    window, no softcap, causal)."""
    return dict(q=inp["q"], k=inp["k"], v=inp["v"], out=out, cu_seqlens_q=inp["cu_seqlens_q"],
                max_seqlen_q=inp["max_seqlen_q"], seqused_k=inp["seqused_k"],
                max_seqlen_k=inp["max_seqlen_k"], softmax_scale=inp["softmax_scale"], causal=True,
                window_size=(-1, -1), block_table=inp["block_table"], softcap=0, q_descale=None,
                k_descale=inp["k_descale"], v_descale=inp["v_descale"],
                seq_threshold_3D=inp["seq_threshold_3D"],
                num_par_softmax_segments=inp["num_par_softmax_segments"],
                softmax_segm_output=inp["softmax_segm_output"],
                softmax_segm_max=inp["softmax_segm_max"],
                softmax_segm_expsum=inp["softmax_segm_expsum"])


def torch_call(inp, out):
    import adapters.torch as at
    kw = _kwargs(inp, out)
    if inp["kv_fp8"]:
        kw["kv_quant_mode"] = "FP8_PER_TENSOR"
    return lambda: at.unified_attention(**kw)


def vllm_call(vllm, inp, out):
    kw = _kwargs(inp, out)
    kw["kv_quant_mode"] = (vllm.KVQuantMode.FP8_PER_TENSOR if inp["kv_fp8"]
                           else vllm.KVQuantMode.NONE)
    return lambda: vllm.unified_attention(**kw)


def jax_call(inp):
    """ours under jax.jit on the same buffers (DLPack), and its arguments."""
    import jax
    import jax.numpy as jnp
    import adapters.jax as aj
    names = ("q", "k", "v", "cu_seqlens_q", "seqused_k", "block_table")
    arrays = {n: jax.dlpack.from_dlpack(inp[n]) for n in names}
    if inp["kv_fp8"]:  # a 1-element descale (the torch side's is the same value expanded)
        arrays["k_descale"] = arrays["v_descale"] = jnp.full((1,), FP8_DESCALE, jnp.float32)
    static = dict(max_seqlen_q=inp["max_seqlen_q"], max_seqlen_k=inp["max_seqlen_k"],
                  softmax_scale=inp["softmax_scale"])
    f = jax.jit(lambda a: aj.unified_attention(
        a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["seqused_k"], a["block_table"], **static,
        causal=True, window_size=(-1, -1), softcap=0.0, k_descale=a.get("k_descale"),
        v_descale=a.get("v_descale")))
    return lambda: f(arrays)


def reference_error(inp, out, seq_index=0, rows=256) -> float:
    """max |out - ref| / max |ref| over the last ``rows`` queries of one sequence,
    ref in float32 from the cache through the block table."""
    import torch
    m = inp["model"]
    hq, hkv, d, bs = m["hq"], m["hkv"], m["d"], m["block_size"]
    s0, s1 = int(inp["cu_seqlens_q"][seq_index]), int(inp["cu_seqlens_q"][seq_index + 1])
    kv = int(inp["seqused_k"][seq_index])
    blocks = inp["block_table"][seq_index, :-(-kv // bs)].long()
    scale = FP8_DESCALE if inp["kv_fp8"] else 1.0
    keys = (inp["k"][blocks].float().reshape(-1, hkv, d)[:kv] * scale).repeat_interleave(hq // hkv, 1)
    vals = (inp["v"][blocks].float().reshape(-1, hkv, d)[:kv] * scale).repeat_interleave(hq // hkv, 1)
    r0 = max(s0, s1 - rows)
    pos = kv - (s1 - s0) + torch.arange(r0 - s0, s1 - s0, device=keys.device)
    vis = torch.arange(kv, device=keys.device)[None] <= pos[:, None]
    sc = torch.einsum("qhd,khd->hqk", inp["q"][r0:s1].float(), keys) * inp["softmax_scale"]
    p = sc.masked_fill(~vis[None], float("-inf")).softmax(-1)
    ref = torch.einsum("hqk,khd->qhd", p, vals)
    return float((out[r0:s1].float() - ref).abs().max() / ref.abs().max())


# --------------------------------------------------------------------------- the run
def _case(name, seqs, opts, vllm, copy_bw, mm):
    import torch
    from benchmarks import timing
    m = UNIFIED_MODEL
    inp = make_inputs(seqs, opts)
    decode = is_decode(seqs)
    row = dict(name=name, dtype="bfloat16", kv="fp8_e4m3" if inp["kv_fp8"] else "bfloat16",
               seqs=len(seqs), tokens=int(inp["q"].shape[0]),
               path="3D" if decode and len(seqs) <= inp["seq_threshold_3D"] else "2D")
    itemsize = inp["k"].element_size()
    nbytes = kv_bytes(seqs, m["hkv"], m["d"], itemsize)
    flops = useful_flops(seqs, m["hq"], m["d"])

    def rates(t):
        if decode:
            return {"TB/s": nbytes / t / 1e12, "%roofline": 100 * nbytes / t / copy_bw}
        return {"TFLOP/s": flops / t / 1e12, "%roofline": 100 * flops / t / mm,
                "kv_TB/s": nbytes / t / 1e12}

    check_seq = 0 if not decode else len(seqs) - 1
    out = torch.empty_like(inp["q"])
    errors = []
    try:  # ours, torch
        call = torch_call(inp, out)
        out.fill_(float("nan"))
        call()
        torch.cuda.synchronize()
        row["max_err"] = reference_error(inp, out, check_seq)
        t = timing.kernel_time_torch(call)
        row.update(torch_us=t * 1e6, **rates(t))
    except Exception as e:  # noqa: BLE001 - reported in the row; vLLM's side still runs
        errors.append(f"torch: {e!r}"[:200])
        out = None
    if vllm is not None:
        try:
            v_out = torch.empty_like(inp["q"])
            vcall = vllm_call(vllm, inp, v_out)
            vcall()
            torch.cuda.synchronize()
            t_v = timing.kernel_time_torch(vcall)
            row.update(vllm_us=t_v * 1e6, baseline=BASELINE, baseline_us=t_v * 1e6,
                       vllm_max_err=reference_error(inp, v_out, check_seq),
                       **{"vllm_" + k: v for k, v in rates(t_v).items()})
            if out is not None:
                vcall()
                call()
                torch.cuda.synchronize()
                row.update(vs_vllm=t_v / (row["torch_us"] * 1e-6),
                           max_diff_vllm=float((out.float() - v_out.float()).abs().max()))
            del v_out
        except Exception as e:  # noqa: BLE001
            errors.append(f"vllm: {e!r}"[:200])
    if out is not None:
        try:  # ours, JAX (pipelined), and torch == JAX
            reps = 50 if decode else 20
            jcall = jax_call(inp)
            row["jax_us"] = timing.pipelined_time([jcall], "jax", reps=reps, trials=3) * 1e6
            row["torch_pipe_us"] = timing.pipelined_time([call], "torch", reps=reps, trials=3) * 1e6
            row["jax/torch"] = row["jax_us"] / row["torch_pipe_us"]
            call()
            torch.cuda.synchronize()
            row["bitwise"] = bool(torch.equal(out, torch.from_dlpack(jcall())))
        except Exception as e:  # noqa: BLE001
            errors.append(f"jax: {e!r}"[:200])
    if errors:
        row["error"] = "; ".join(errors)
    del inp, out
    gc.collect()
    torch.cuda.empty_cache()
    return row


def host_overhead_row(vllm):
    """Host time per call, decode B1 x 64 keys: torch eager (repeated call, and with the
    call memo off) vs a plain Triton launch of the same kernels, vLLM's Python wrapper,
    and ours jitted in JAX (bench_host_overhead.py's method)."""
    import torch
    from benchmarks import timing
    from benchmarks.bench_host_overhead import _alternated, _plain, _recorded
    from adapters.torch import _executor as ex
    row = dict(name="host-overhead-decode-B1-ctx64-bf16", dtype="bfloat16")
    inp = make_inputs([(1, 64)], {})
    out = torch.empty_like(inp["q"])
    with torch.inference_mode():
        if vllm is not None:
            try:
                vcall = vllm_call(vllm, inp, torch.empty_like(inp["q"]))
                vcall()
                row["vllm_host_us"] = timing.host_overhead(vcall, "torch") * 1e6
            except Exception as e:  # noqa: BLE001
                row["error"] = f"vllm: {e!r}"[:200]
        try:
            call = torch_call(inp, out)
            call()
            rec, _ = _recorded(call)
            plain = _plain(rec)
            plain()
            row["launches"] = len(rec)
            row.update(_alternated(call, plain, ex))
            row["gpu_us"] = timing.kernel_time_torch(call) * 1e6
            jcall = jax_call(inp)
            jcall()
            row["jax_host_us"] = timing.host_overhead(jcall, "jax") * 1e6
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            row["error"] = (row.get("error", "") + f" ours: {e!r}")[:300]
    return row


def run():
    import torch
    from benchmarks import timing
    try:
        vllm, source = vllm_unified()
    except Exception as e:  # noqa: BLE001 - the baseline columns stay empty
        traceback.print_exc()
        vllm, source = None, f"import failed: {e!r}"[:300]
    copy_bw = timing.copy_bandwidth()
    mm = timing.matmul_tflops()
    rows = [dict(name="copy-bandwidth", **{"TB/s": copy_bw / 1e12}),
            dict(name="dense-bf16-matmul", **{"TFLOP/s": mm / 1e12}),
            dict(name="vllm-source", vllm=source if vllm is not None else None,
                 error=None if vllm is not None else source, device=torch.cuda.get_device_name())]
    print(rows, flush=True)
    only = [o for o in os.environ.get("UNIFIED_ONLY", "").split(",") if o]
    for name, seqs, opts in UNIFIED_SHAPES:
        if only and not any(o in name for o in only):
            continue
        rows.append(_case(name, seqs, opts, vllm, copy_bw, mm))
        print(rows[-1], flush=True)
    rows.append(host_overhead_row(vllm))
    print(rows[-1], flush=True)
    return rows


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cases = [r for r in rows if r.get("seqs")]
    fig, ax = plt.subplots(figsize=(10, 4))
    x = np.arange(len(cases))
    ax.bar(x - 0.2, [r.get("%roofline", 0) for r in cases], 0.4, label="ours (torch)")
    ax.bar(x + 0.2, [100 * r.get("vllm_TB/s", r.get("vllm_TFLOP/s", 0)) /
                     (r.get("TB/s") or r.get("TFLOP/s") or np.inf) * r.get("%roofline", 0)
                     if r.get("%roofline") else 0 for r in cases], 0.4, label="vLLM 0.33")
    ax.set_xticks(x, [r["name"] for r in cases], rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("% of roofline (copy BW: decode; bf16 matmul: prefill)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# --------------------------------------------------------------------------- CPU smoke
SMOKE_MODEL = dict(hq=4, hkv=2, d=32, block_size=16)
SMOKE_SHAPES = (("decode-B3", [(1, 40), (1, 17), (1, 64)], {}),
                ("prefill-B2", [(20, 52), (16, 16)], {}),
                ("mixed", [(8, 40), (1, 33), (1, 5)], {}))


def smoke() -> int:
    """Tiny shapes on the CPU (Triton's interpreter; float16, which the interpreter
    computes correctly): inputs, accounting and the reference, vLLM's kernel
    through the shim, ours where it runs. Returns 1 on a failed check."""
    import torch
    try:
        vllm, source = vllm_unified()
    except Exception as e:  # noqa: BLE001
        vllm, source = None, repr(e)
    print("vLLM:", source)
    bad = 0
    for name, seqs, opts in SMOKE_SHAPES:
        inp = make_inputs(seqs, opts, device="cpu", model=SMOKE_MODEL, dtype="float16")
        m = SMOKE_MODEL
        assert useful_flops(seqs, m["hq"], m["d"]) == 4 * m["hq"] * m["d"] * sum(
            (kv - q + i + 1) for q, kv in seqs for i in range(q))
        line = dict(name=name, flops=useful_flops(seqs, m["hq"], m["d"]),
                    kv_bytes=kv_bytes(seqs, m["hkv"], m["d"], 2))
        outs = {}
        for label, make in (("vllm", (lambda o: vllm_call(vllm, inp, o)) if vllm else None),
                            ("ours", lambda o: torch_call(inp, o))):
            if make is None:
                continue
            o = torch.full_like(inp["q"], float("nan"))
            try:
                make(o)()
            except Exception as e:  # noqa: BLE001 - ours may not be there yet
                line[label] = f"{type(e).__name__}: {e}"[:120]
                continue
            errs = [reference_error(inp, o, i) for i in range(len(seqs))]
            line[label + "_max_err"] = max(errs)
            bad += max(errs) > 2e-3
            outs[label] = o
        if len(outs) == 2:
            line["max_diff_vllm"] = float((outs["ours"].float() - outs["vllm"].float()).abs().max())
        print(line)
    return 1 if bad else 0


if __name__ == "__main__":
    if "--smoke" in sys.argv:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        sys.exit(smoke())
    print(__doc__)
