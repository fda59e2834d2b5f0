"""reshape_and_cache_flash on the GPU: our kernel (torch and JAX) against the
device-to-device copy bandwidth measured in the same run, and against what a user
writes instead: torch's ``index_copy_`` into the flattened cache (after the fp8
quantisation in torch for the fp8 case) and jnp's ``.at[slots].set`` under
``jax.jit`` with the caches donated.

Shapes: BENCH_CASES (Llama-8B kv heads: 8 x 128; cache blocks of 16 tokens, twice
the room the tokens need, the tokens' blocks shuffled as a paged allocator leaves
them). Bytes moved = N·Hkv·D·(2·key itemsize + 2·cache itemsize) + 8·N (slots).
torch_us: do_bench (cold L2); graph_us: CUDA graph over cold input sets (no host
time). JAX and torch are also timed as back-to-back calls (pipelined, caches
threaded through the donated jit), for the JAX/torch ratio. ``sweep-*`` rows time
the tile alternatives of the planner's NOTE (TILE_ELEMENTS, NUM_WARPS), loads
that wait for the slots (early_loads=False) and the interpreter's software fp8
rounding on the GPU (soft_round=True). copy_us: torch ``copy_`` of key and value
into contiguous buffers of their dtype (the same rows, no scatter, no quantisation).
"""
from __future__ import annotations

import gc

from benchmarks import timing

COLUMNS = ["name", "torch_us", "GB/s", "%copy", "copy_us", "vs_copy", "graph_us", "jax_us", "torch_pipe_us",
           "jax/torch", "index_put_us", "vs_index_put", "jnp_us", "vs_jnp", "bitwise"]
BENCH_CASES = (  # (name, tokens, kv heads, head size, key dtype, kv_cache_dtype)
    ("N8192-H8-D128-bf16", 8192, 8, 128, "bfloat16", "auto"),
    ("N8192-H8-D128-bf16-fp8", 8192, 8, 128, "bfloat16", "fp8"),
    ("N64-H8-D128-bf16", 64, 8, 128, "bfloat16", "auto"),   # a decode batch: latency, not bandwidth
)
BLOCK = 16
SCALE = 0.05


def _inputs(n, h, d, dtype, kv_cache_dtype, seed=0):
    import torch
    g = torch.Generator(device="cuda").manual_seed(seed)
    tdt = getattr(torch, dtype)
    cdt = torch.float8_e4m3fn if kv_cache_dtype == "fp8" else tdt
    num_blocks = max(2, 2 * n // BLOCK)
    key, value = (torch.randn(n, h, d, device="cuda", dtype=tdt, generator=g) for _ in range(2))
    key_cache, value_cache = (torch.zeros(num_blocks, BLOCK, h, d, device="cuda", dtype=cdt) for _ in range(2))
    blocks = torch.randperm(num_blocks, device="cuda", generator=g)[:(n + BLOCK - 1) // BLOCK]
    t = torch.arange(n, device="cuda")
    slots = blocks[t // BLOCK] * BLOCK + t % BLOCK
    scale = torch.tensor([SCALE], device="cuda")
    return key, value, key_cache, value_cache, slots.to(torch.int64), scale


def _nbytes(key, key_cache):
    return key.numel() * (2 * key.element_size() + 2 * key_cache.element_size()) + 8 * key.shape[0]


def _index_put(key, value, key_cache, value_cache, slots, kv_cache_dtype):
    """What a torch user writes: quantise (fp8) and index_copy_ into the flattened caches."""
    import torch
    h, d = key.shape[1:]
    for x, cache in ((key, key_cache), (value, value_cache)):
        if kv_cache_dtype == "fp8":   # index_copy_ has no fp8 kernel: copy the bytes
            x = (x.float() / SCALE).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
            cache = cache.view(torch.uint8)
        cache.view(-1, h, d).index_copy_(0, slots, x)


def _jnp_update(key, value, key_cache, value_cache, slots, kv_cache_dtype):
    import jax.numpy as jnp
    h, d = key.shape[1:]
    out = []
    for x, cache in ((key, key_cache), (value, value_cache)):
        if kv_cache_dtype == "fp8":
            x = jnp.clip(x.astype(jnp.float32) / SCALE, -448.0, 448.0).astype(cache.dtype)
        out.append(cache.reshape(-1, h, d).at[slots].set(x).reshape(cache.shape))
    return tuple(out)


def sweep(copy_bw):
    """The tile alternatives (block_t tokens x all 8 heads, warps) at N = 8192."""
    import adapters.torch as at
    from core_kernels.reshape_and_cache_flash import ReshapeAndCacheConfig
    rows = []
    for name, n, h, d, dtype, kvd in BENCH_CASES[:2]:
        key, value, kc, vc, slots, scale = _inputs(n, h, d, dtype, kvd)
        nbytes = _nbytes(key, kc)
        configs = {f"t{bt}-w{w}": ReshapeAndCacheConfig(bt, 8, w) for bt in (1, 2, 4, 8) for w in (2, 4, 8)}
        configs["t2-w4-late-loads"] = ReshapeAndCacheConfig(2, 8, 4, early_loads=False)
        if kvd != "auto":
            configs["t2-w4-soft-round"] = ReshapeAndCacheConfig(2, 8, 4, soft_round=True)
            configs["t1-w4-soft-round"] = ReshapeAndCacheConfig(1, 8, 4, soft_round=True)
        for label, cfg in configs.items():
            t = timing.kernel_time_torch(
                lambda: at.reshape_and_cache_flash(key, value, kc, vc, slots, kvd, scale, scale, config=cfg))
            rows.append(dict(name=f"sweep-{name}-{label}", torch_us=t * 1e6,
                             **{"GB/s": nbytes / t / 1e9, "%copy": 100 * nbytes / t / copy_bw}))
        del key, value, kc, vc
        gc.collect()
    return rows


def run():
    import jax
    import numpy as np
    import torch
    import adapters.jax as aj
    import adapters.torch as at
    copy_bw = timing.copy_bandwidth()
    rows = [dict(name="copy-bandwidth", **{"GB/s": copy_bw / 1e9})]
    ours_jit = jax.jit(aj.reshape_and_cache_flash, donate_argnums=(2, 3), static_argnames=("kv_cache_dtype",))
    jnp_jit = jax.jit(_jnp_update, donate_argnums=(2, 3), static_argnums=(5,))
    for name, n, h, d, dtype, kvd in BENCH_CASES:
        key, value, kc, vc, slots, scale = _inputs(n, h, d, dtype, kvd)
        nbytes = _nbytes(key, kc)

        def ours():
            at.reshape_and_cache_flash(key, value, kc, vc, slots, kvd, scale, scale)

        t_torch = timing.kernel_time_torch(ours)
        t_index = timing.kernel_time_torch(lambda: _index_put(key, value, kc, vc, slots, kvd))
        kd, vd = torch.empty_like(key), torch.empty_like(value)
        t_copy = timing.kernel_time_torch(lambda: (kd.copy_(key), vd.copy_(value)))   # the rows, contiguous
        sets = [_inputs(n, h, d, dtype, kvd, seed=1 + i) for i in range(timing.cold_sets(nbytes))]
        t_graph = timing.graph_cold_time_torch(
            lambda i: at.reshape_and_cache_flash(*sets[i][:5], kvd, sets[i][5], sets[i][5]), nbytes)
        del sets
        t_pipe = timing.pipelined_time([lambda: ours() or kc], "torch")
        # JAX: the caches threaded through the donated jit, back to back
        jk, jv, jscale = (jax.dlpack.from_dlpack(x) for x in (key, value, scale))
        js = jax.numpy.asarray(slots.cpu().numpy().astype(np.int32))
        cdt = jax.numpy.dtype(str(kc.dtype).replace("torch.", ""))
        state = [jax.numpy.zeros(kc.shape, cdt), jax.numpy.zeros(vc.shape, cdt)]
        kw = dict(kv_cache_dtype=kvd, k_scale=jscale, v_scale=jscale)

        def jax_call():
            state[0], state[1] = ours_jit(jk, jv, state[0], state[1], js, **kw)
            return state[1]
        t_jax = timing.pipelined_time([jax_call], "jax")
        jstate = [jax.numpy.zeros(kc.shape, cdt), jax.numpy.zeros(vc.shape, cdt)]

        def jnp_call():
            jstate[0], jstate[1] = jnp_jit(jk, jv, jstate[0], jstate[1], js, kvd)
            return jstate[1]
        t_jnp = timing.pipelined_time([jnp_call], "jax")
        # bitwise: torch's caches (zeroed, one call) against JAX's (zeros, one call)
        kc.zero_()
        vc.zero_()
        ours()
        jkc, jvc = ours_jit(jk, jv, jax.numpy.zeros(kc.shape, cdt), jax.numpy.zeros(vc.shape, cdt), js, **kw)
        bitwise = all(np.array_equal(t.view(torch.uint8).cpu().numpy(), np.asarray(j).view(np.uint8).reshape(-1))
                      for t, j in ((kc.reshape(-1), jkc), (vc.reshape(-1), jvc)))
        rows.append(dict(name=name, n=n, h=h, d=d, dtype=dtype, kv_cache_dtype=kvd, torch_us=t_torch * 1e6,
                         **{"GB/s": nbytes / t_torch / 1e9, "%copy": 100 * nbytes / t_torch / copy_bw},
                         copy_us=t_copy * 1e6, vs_copy=t_copy / t_torch, graph_us=t_graph * 1e6,
                         jax_us=t_jax * 1e6, torch_pipe_us=t_pipe * 1e6,
                         **{"jax/torch": t_jax / t_pipe}, index_put_us=t_index * 1e6,
                         vs_index_put=t_index / t_torch, jnp_us=t_jnp * 1e6, vs_jnp=t_jnp / t_jax,
                         baseline="torch index_copy_", baseline_us=t_index * 1e6, bitwise=bitwise))
        del key, value, kc, vc, kd, vd, state, jstate, jk, jv, js, jkc, jvc
        gc.collect()
        torch.cuda.empty_cache()
    rows += sweep(copy_bw)
    assert np.isfinite([r["torch_us"] for r in rows if "torch_us" in r]).all()
    return rows
