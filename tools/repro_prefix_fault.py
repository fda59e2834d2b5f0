"""Reproducer of a Triton 3.6 miscompile of context_attention_fwd, found by
tests/test_properties.py's "ci" profile on the H200 (2026-11-24): bf16 q, an
x = 1 K cache, an interleaved V cache of pack factor 1, packed GQA heads,
BLOCK_M = BLOCK_N = 64, cache block 32, D 24. With the block-id constancy hint
(the plan's ID_RUN = 32) the kernel faults (illegal shared-memory access at the
K-tile load, kernels.py:178, with 2-3 stages) or is off by 0.2-0.6 (one stage);
the same case is clean under Triton's interpreter. The planner now drops the
hint for that V layout (see the ID_RUN NOTE in core_kernels/prefix_prefill/plan.py);
``id_run=32`` forces it back, to show the miscompile:

    python -m tools.repro_prefix_fault                 # GPU: correct (the planner's ID_RUN 1)
    python -m tools.repro_prefix_fault id_run=32       # GPU: faults
    python -m tools.repro_prefix_fault id_run=32 'config=PrefixPrefillConfig(64, 64, num_stages=1)'
    compute-sanitizer --tool memcheck python -m tools.repro_prefix_fault id_run=32
    python -m tools.repro_prefix_fault --bisect        # one-change variants, each in its own process
    python -m tools.repro_prefix_fault --probe         # where the output is wrong, per variant

Bisect (H200, id_run as planned before the fix): faults or wrong with 1-3
stages, D 24 or 32, fp16 or bf16, cache block 16 or 32, skip_decode either way,
k / v given or not; correct with BLOCK_N 32, the gathered path, GQA packing off,
x = 8, the standard V layout, or pack factor 8 (test_gpu_cache_layout_matrix).
Arguments ``key=value`` override entries of CASE (values are Python
expressions); ``id_run`` (the ID_RUN forced) holds for the whole process, as
plans are cached.
"""
import sys

import numpy as np

sys.path.insert(0, "tests")

import core_kernels  # noqa: E402,F401  (before triton: the CPU path)
import test_properties as tp  # noqa: E402

import adapters.torch as at  # noqa: E402
from core_kernels.prefix_prefill import PrefixPrefillConfig, context_attention_reference  # noqa: E402,F401

CASE = {'hq': 2, 'hkv': 1, 'd': 24, 'x': 1, 'bs': 32, 'seqs': [(12, 158), (31, 0), (0, 0)],
        'dtype': 'bfloat16', 'cache_fmt': 'float8_e4m3fn', 'kv_cache_dtype': 'auto', 'as_uint8': False,
        'k_scale': 0.5, 'v_scale': 1.5204818855572941, 'window': 0, 'alibi': False, 'causal': True,
        'cache_new': True, 'sinks': False, 'sm_scale': 0.05, 'skip_decode': True, 'out_scale': None,
        'v_pack': 1, 'extra_len': 1, 'table_dtype': 'int32', 'config': None,
        'views': {'q': ('contiguous',), 'k': ('contiguous',), 'v': ('contiguous',), 'o': ('contiguous',),
                  'k_cache': ('contiguous',), 'b_loc': ('pad', 1), 'v_cache': ('perm', (1, 0))},
        'jit': True, 'seed': 65307}


# one change each from CASE: which option the fault needs (run with id_run=32)
VARIANTS = [
    [],
    ["config=PrefixPrefillConfig(64, 64, num_stages=1)"],
    ["config=PrefixPrefillConfig(64, 64, num_stages=2)"],  # the H200 plan has 3 (bf16)
    ["config=PrefixPrefillConfig(64, 64, prefetch_ids=0)"],
    ["config=PrefixPrefillConfig(64, 32)"],
    ["config=PrefixPrefillConfig(64, 64, gather=True)"],
    ["config=PrefixPrefillConfig(64, 64, pack_gqa=False)"],
    ["x=8"], ["v_pack=0"], ["cache_fmt=None"], ["d=32"], ["cache_new=False"],
    ["skip_decode=False"], ["dtype='float16'"], ["bs=16"],
]


def bisect() -> None:
    """Run every VARIANTS entry in its own process (a device fault poisons the
    process) and print one line each: ok (with the error vs the reference),
    FAULT, or the error."""
    import subprocess
    for change in [["id_run=None"]] + [["id_run=32", *v] for v in VARIANTS]:
        res = subprocess.run([sys.executable, "-m", "tools.repro_prefix_fault", *change],
                             capture_output=True, text=True, timeout=300)
        text = res.stdout + res.stderr
        if "illegal memory access" in text:
            verdict = "FAULT"
        elif "max |out - ref|" in text:
            verdict = "ok " + text.split("max |out - ref|")[1].split()[0]
        else:
            verdict = "error: " + (text.strip().splitlines() or ["?"])[-1][:160]
        print(f"{' '.join(change) or '(the case as drawn)':60s} {verdict}", flush=True)


PROBES = [
    [],
    ["config=PrefixPrefillConfig(64, 64, num_stages=1)"],
    ["config=PrefixPrefillConfig(64, 64, num_stages=1)", "id_run=1"],
    ["id_run=1"],
    ["config=PrefixPrefillConfig(64, 64, num_stages=1, num_warps=8)"],
    ["config=PrefixPrefillConfig(64, 64, num_stages=1)", "d=32"],
    ["config=PrefixPrefillConfig(64, 64, num_stages=1)", "hq=1"],
    ["config=PrefixPrefillConfig(64, 64, num_stages=1)", "seqs=[(12, 158)]"],
    ["config=PrefixPrefillConfig(64, 64, num_stages=1)", "seqs=[(31, 0)]"],
    ["config=PrefixPrefillConfig(64, 64, num_stages=1)", "v_pack=0"],
    ["config=PrefixPrefillConfig(64, 64, num_stages=1)", "x=8"],
    ["config=PrefixPrefillConfig(64, 64, num_stages=1)", "cache_fmt=None"],
    ["config=PrefixPrefillConfig(64, 64, num_stages=1)", "cache_new=False"],
    ["config=PrefixPrefillConfig(64, 64, num_stages=1)", "skip_decode=False"],
    ["seqs=[(12, 158)]"],
    ["seqs=[(31, 0)]"],
]


def probe() -> None:
    """Every PROBES entry in its own process: the full report of each (where the
    output is wrong, NaN, or the fault)."""
    import os
    import subprocess
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
    for change in [["id_run=None"]] + [["id_run=32", *v] for v in PROBES]:
        res = subprocess.run([sys.executable, "-m", "tools.repro_prefix_fault", *change],
                             capture_output=True, text=True, timeout=300, env=env)
        lines = (res.stdout + res.stderr).strip().splitlines()
        keep = [ln for ln in lines if ln.startswith(("NaN", "worst", "tokens", "max"))]
        if not keep:
            keep = ["FAULT" if "illegal memory access" in res.stderr else "error: " + (lines or ["?"])[-1][:200]]
        print("==", " ".join(change) or "(the case as drawn)", flush=True)
        for ln in keep:
            print("   ", ln[:300], flush=True)


_ID_RUN = [None]   # a forced ID_RUN (the block-id constancy hint), None: the plan's


def _patch_id_run():
    from core_kernels.prefix_prefill import plan
    if getattr(plan._id_run, "forced", False):
        return
    planned = plan._id_run

    def forced(p, config):
        return planned(p, config) if _ID_RUN[0] is None else _ID_RUN[0]
    forced.forced = True
    plan._id_run = forced


def run_case(c, verbose=False):
    """Run one case through the torch adapter; (max error, NaN count where the
    reference is finite, per-(token, head) errors)."""
    _patch_id_run()
    _ID_RUN[0] = c.get("id_run")
    if not tp.GPU:
        c = dict(c, dtype="float32")  # the interpreter's bf16 arithmetic is not meaningful
    a, opts, keep, _, mil = tp.prefix_inputs(c)
    t = {n: None if a[n] is None else tp.as_torch(a[n], c["views"].get(n, ("contiguous",)))
         for n in tp.PP_ARRAYS}
    if verbose:
        print("b_loc", a["b_loc"].tolist(), "strides", t["b_loc"].stride())
        print({n: (tuple(x.shape), x.stride(), str(x.dtype)) for n, x in t.items() if x is not None})
    o = tp.as_torch(keep, c["views"]["o"])
    at.context_attention_fwd(
        t["q"], t["k"], t["v"], o, opts["kv_cache_dtype"], t["k_cache"], t["v_cache"], t["b_loc"],
        t["b_start_loc"], t["b_seq_len"], 0, mil, tp.scalar_tensor(opts["k_scale"]),
        tp.scalar_tensor(opts["v_scale"]), None, opts["sliding_window"], opts["sm_scale"],
        opts["skip_decode"], None, None, False, opts["interleaved_v_pack_factor"], opts["causal"],
        config=c["config"])
    out = tp.torch_to_numpy(o).astype(np.float64)
    ref = context_attention_reference(*(a[n] for n in tp.PP_ARRAYS), output=keep, **opts)
    err = np.abs(out - ref)
    lost = np.isnan(out) & ~np.isnan(ref)
    return float(np.nanmax(err)), lost, err


def main():
    if sys.argv[1:] == ["--bisect"]:
        bisect()
        return
    if sys.argv[1:] == ["--probe"]:
        probe()
        return
    c = dict(CASE, id_run=None)
    for arg in sys.argv[1:]:
        key, value = arg.split("=", 1)
        c[key] = eval(value)  # noqa: S307  (a developer's command line)
    e, lost, err = run_case(c, verbose=True)
    print("NaN where the reference is finite:", int(lost.sum()),
          "at (token, head):", sorted({(int(i), int(j)) for i, j, _ in zip(*np.nonzero(lost))})[:12])
    per = np.nanmax(np.where(np.isnan(err), -1.0, err), axis=2)   # [T, Hq]
    worst = np.dstack(np.unravel_index(np.argsort(-per, axis=None)[:8], per.shape))[0]
    print("worst (token, head, err):", [(int(i), int(j), round(float(per[i, j]), 4)) for i, j in worst])
    print("tokens with err > 0.1:", sorted({int(i) for i in np.nonzero(per > 0.1)[0]}))
    print("max |out - ref|", e)


if __name__ == "__main__":
    main()
