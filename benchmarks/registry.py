"""Named shapes from real models, shared by benchmarks and GPU tests."""

# merge_attn_states: (tokens, heads, head_dim) per model
MERGE_MODELS = {"llama8b": (32, 128), "llama70b": (64, 128), "mla": (128, 128)}
MERGE_TOKENS = (1, 64, 4096, 16384)
MERGE_DTYPES = ("bfloat16", "float16", "float32")


def merge_shapes():
    for model, (h, d) in MERGE_MODELS.items():
        for n in MERGE_TOKENS:
            for dtype in MERGE_DTYPES:
                yield dict(name=f"{model}-N{n}-{dtype}", n=n, h=h, d=d, dtype=dtype)


# blocksparse_attention: Phi-3-small (Hq=32, Hkv=8, D=128, block 64, local 16, stride 8, per-head)
BLOCKSPARSE_MODEL = dict(hq=32, hkv=8, d=128, block_size=64, local_blocks=16, vert_stride=8,
                         homo_head=False)
# (name, lens_k, lens_q or None for decode-only)
BLOCKSPARSE_SHAPES = (
    ("prefill-1x16384", [16384], [16384]),
    ("prefill-4x4096", [4096] * 4, [4096] * 4),
    ("decode-1x16384", [16384], None),
    ("decode-64x4096", [4096] * 64, None),
    ("mixed-2pf2048+2ctx4096q512+28dec4096", [2048] * 2 + [4096] * 2 + [4096] * 28,
     [2048] * 2 + [512] * 2 + [1] * 28),
)


# prefix_prefill (context_attention_fwd): Llama-8B heads (Hq=32, Hkv=8, D=128), paged
# cache block 16. (name, [(query_len, context_len), ...], dtype, options)
PREFIX_PREFILL_MODEL = dict(hq=32, hkv=8, d=128, block_size=16)
PREFIX_PREFILL_SHAPES = (
    ("B4-q1024-ctx4096-fp16", [(1024, 4096)] * 4, "float16", {}),
    ("B4-q1024-ctx4096-bf16", [(1024, 4096)] * 4, "bfloat16", {}),
    ("B16-q256-ctx2048-bf16", [(256, 2048)] * 16, "bfloat16", {}),
    ("B1-q8192-ctx0-bf16", [(8192, 0)], "bfloat16", {}),
    ("B4-q1024-ctx4096-bf16-fp8kv", [(1024, 4096)] * 4, "bfloat16", {"kv_cache_dtype": "fp8"}),
    ("B4-q1024-ctx16384-bf16-window4096", [(1024, 16384)] * 4, "bfloat16", {"sliding_window": 4096}),
    ("B4-q1024-ctx16384-bf16", [(1024, 16384)] * 4, "bfloat16", {}),
    ("B4-q1024-ctx4096-fp32", [(1024, 4096)] * 4, "float32", {}),
)


# lightning attention (MiniMax-Text-01 / M1: 64 heads, D = E = 128)
LIGHTNING_PREFILL = [
    dict(name=f"prefill-B{b}-H{h}-N{n}-{dt}" + ("-final" if fso else ""), b=b, h=h, n=n, d=128, e=128,
         dtype=dt, fso=fso, jnp_baseline=(b, h, n, fso) == (1, 64, 4096, False) and dt != "float16")
    for (b, h, n) in ((1, 64, 4096), (1, 8, 65536), (4, 64, 1024))
    for dt in ("float32", "bfloat16", "float16")
    for fso in (False, True)
    if dt != "float16" or (b, h, n, fso) == (1, 64, 4096, False)
]
LIGHTNING_DECODE = [
    dict(name=f"decode-B{b}-{dt}", b=b, h=64, d=128, dtype=dt, baselines=b == 64 and dt == "bfloat16")
    for b in (1, 64, 256) for dt in ("bfloat16", "float32")
]


# lightning attention over packed sequences (lightning_attention_varlen, MiniMax heads):
# (name, sequence lengths); every case runs in bf16 and fp32, with a slot cache
LIGHTNING_VARLEN_LENS = {
    # the issue-22 batch: 16 sequences of 256-8192 tokens, mixed (51,409 tokens)
    "B16-mixed256-8192": [8192, 256, 4096, 512, 1024, 7000, 300, 2048, 6000, 256, 3000, 5000, 1500,
                          700, 8192, 3333],
    "B64-mixed64-1024": [64 + (i * 389) % 961 for i in range(64)],
    "B2-32768": [32768, 32768],
}
LIGHTNING_VARLEN = [
    dict(name=f"varlen-{name}-{dt}", lens=lens, h=64, d=128, e=128, dtype=dt,
         sweep=name == "B16-mixed256-8192")
    for name, lens in LIGHTNING_VARLEN_LENS.items() for dt in ("bfloat16", "float32")
]


# unified_attention (vLLM's TRITON_ATTN kernel): Llama-8B heads (Hq=32, Hkv=8, D=128), bf16,
# vLLM's flash cache layout [num_blocks, 16, Hkv, D]. (name, [(query_len, kv_len), ...],
# options); kv_len = seqused_k counts the new tokens (prefill "q1024 over ctx4096": 5120).
# vLLM 0.33's kernel on the H200 (2026-11-27): 290, 351, 658, 4289, 7470 and 4706 us.
UNIFIED_MODEL = dict(hq=32, hkv=8, d=128, block_size=16)
UNIFIED_SHAPES = (
    ("decode-B64-ctx4096-bf16", [(1, 4096)] * 64, {}),
    ("decode-B64-ctx4096-bf16-fp8kv", [(1, 4096)] * 64, {"kv_fp8": True}),
    ("decode-B1-ctx131072-bf16", [(1, 131072)], {}),
    ("prefill-B4-q1024-ctx4096-bf16", [(1024, 5120)] * 4, {}),
    ("prefill-B1-q8192-ctx0-bf16", [(8192, 8192)], {}),
    ("mixed-q2048-ctx8192+127dec-ctx4096-bf16", [(2048, 10240)] + [(1, 4096)] * 127, {}),
)
