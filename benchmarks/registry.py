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
