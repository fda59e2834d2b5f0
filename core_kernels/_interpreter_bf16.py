"""bf16 under Triton's interpreter (the CPU path), as the GPU computes it.

Triton 3.6's interpreter stores bf16 values as raw uint16 bits and
 - multiplies those bits as integers in ``tl.dot`` (garbage results), and
 - rounds fp32 -> bf16 toward zero, where the GPU rounds to nearest even.
Our kernels load bf16, compute in fp32 and cast to bf16 only for MMA operands
and stores, so these two places are all bf16 needs. ``install`` patches the
interpreter's builder once: a bf16 operand of ``tl.dot`` is widened to fp32
(exact) and multiplied there with fp32 accumulation, as the tensor cores do,
and fp32 -> bf16 rounds to nearest even (NaN stays a quiet NaN). Nothing
changes for any other dtype, nor on the GPU (the patch is installed only when
the interpreter runs the kernels).
"""
from __future__ import annotations

import numpy as np


def _bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even fp32 -> bf16, as bits (uint16)."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    return np.where(nan, ((bits >> 16) | np.uint32(0x40)).astype(np.uint16), rounded)


def install() -> None:
    import triton.language as tl
    from triton.runtime import interpreter as ti

    builder = ti.InterpreterBuilder
    if getattr(builder, "_tandem_bf16", False):
        return
    plain_dot, plain_cast = builder.create_dot, builder.cast_impl

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16 or b.dtype.scalar == tl.bfloat16:
            a = ti.TensorHandle(_bf16_bits_to_f32(a.data) if a.dtype.scalar == tl.bfloat16
                                else a.data.astype(np.float32), tl.float32)
            b = ti.TensorHandle(_bf16_bits_to_f32(b.data) if b.dtype.scalar == tl.bfloat16
                                else b.data.astype(np.float32), tl.float32)
        return plain_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):
        if dst_type.scalar == tl.bfloat16 and src.dtype.scalar == tl.float32:
            return ti.TensorHandle(_f32_to_bf16_bits(src.data), tl.bfloat16)
        return plain_cast(self, src, dst_type)

    builder.create_dot, builder.cast_impl = create_dot, cast_impl
    # (create_fp_trunc and the other cast entries call self.cast_impl: they get this one)
    builder._tandem_bf16 = True
