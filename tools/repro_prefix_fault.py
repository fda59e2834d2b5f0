"""Reproducer of an open bug: context_attention_fwd faults on the GPU (illegal
memory access, torch adapter) for one case drawn by tests/test_properties.py's
"ci" profile on the H200 (2026-11-24, commit after 14ec55c). The same case runs
clean under Triton's interpreter on the CPU, also with the H200's plan.

    python -m tools.repro_prefix_fault            # GPU: faults while the bug is open
    compute-sanitizer --tool memcheck python -m tools.repro_prefix_fault
    python -m tools.repro_prefix_fault x=8 'config=PrefixPrefillConfig(64, 64, num_stages=1)'
    python -m tools.repro_prefix_fault --bisect   # each variant below in its own process

memcheck (H200): "Out-of-range shared or local address" at the K-tile load of
_attend (kernels.py:178), program (0, 0, 0): a shared-memory access, not a global one.
Offline sm_90 compile (tools/offline_compile.py) of the H200 plan: bf16 3 stages,
16 KB shared memory; the same case in fp32 plans 2 stages, 20 KB.
Arguments ``key=value`` override entries of CASE (values are Python expressions).
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


# one change each from CASE: which option the fault needs
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
    for change in VARIANTS:
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


def main():
    if sys.argv[1:] == ["--bisect"]:
        bisect()
        return
    c = dict(CASE)
    for arg in sys.argv[1:]:
        key, value = arg.split("=", 1)
        c[key] = eval(value)  # noqa: S307  (a developer's command line)
    if not tp.GPU:
        c["dtype"] = "float32"  # the interpreter's bf16 arithmetic is not meaningful
    a, opts, keep, _, mil = tp.prefix_inputs(c)
    t = {n: None if a[n] is None else tp.as_torch(a[n], c["views"].get(n, ("contiguous",)))
         for n in tp.PP_ARRAYS}
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
    print("max |out - ref|", float(np.nanmax(np.abs(out - ref))))


if __name__ == "__main__":
    main()
