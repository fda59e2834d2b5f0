"""Minimal stand-in for einops (our code), used only when einops is not installed.

It implements exactly the pattern vLLM's lightning_attn.py uses and refuses any other."""

__version__ = "0+peer-check-shim"


def rearrange(tensor, pattern: str, **axes_lengths):
    if " ".join(pattern.split()) == "b h n d -> b n (h d)" and not axes_lengths:
        b, h, n, d = tensor.shape
        return tensor.permute(0, 2, 1, 3).reshape(b, n, h * d)
    raise NotImplementedError(f"peer-check einops shim: pattern {pattern!r} not implemented")
