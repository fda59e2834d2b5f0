"""@gluon.jit helpers shared by several ops' Gluon kernels (imported only where those run)."""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def exp2_ftz(x):
    """2^x as one MUFU.EX2 (ex2.approx.ftz): results below fp32's normal range are
    flushed to 0. gl.exp2 / gl.exp compile to the non-ftz form, which ptxas
    wraps in a range check and two rescaling multiplies (6 instructions)."""
    return gl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=gl.float32,
                                     is_pure=True, pack=1)
