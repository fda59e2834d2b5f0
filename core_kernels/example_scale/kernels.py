"""The example op's kernel: out = x * scale, elementwise (ADDING_AN_OP.md)."""
import triton.language as tl

from .._triton_utils import jit


@jit
def _example_scale_kernel(
    # input pointers
    x_ptr, scale_ptr,
    # runtime scalars
    num_elements,
    # output pointers
    out_ptr,
    # constexprs
    BLOCK: tl.constexpr,
):
    """out[i] = x[i] * scale over the flat contiguous arrays; program p takes
    elements [p * BLOCK, (p + 1) * BLOCK). ``scale`` is device data (one fp32
    element: a new value never recompiles); the product is computed in fp32
    and rounded once to out's dtype."""
    o_n = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)   # [BLOCK] element ids
    m_n = o_n < num_elements
    scale = tl.load(scale_ptr).to(tl.float32)
    b_x = tl.load(x_ptr + o_n, mask=m_n, other=0.0).to(tl.float32)     # [BLOCK]
    tl.store(out_ptr + o_n, (b_x * scale).to(out_ptr.dtype.element_ty), mask=m_n)

