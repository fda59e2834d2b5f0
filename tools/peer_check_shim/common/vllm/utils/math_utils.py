"""Shim of vllm.utils.math_utils: the integer helpers the fetched files use."""


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n < 1)."""
    return 1 if n < 1 else 1 << (n - 1).bit_length()


def round_up(x: int, y: int) -> int:
    return cdiv(x, y) * y
