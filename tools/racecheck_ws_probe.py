"""Does compute-sanitizer's racecheck report hazards for Triton 3.6's
warp_specialize itself? The smallest Gluon kernel with the shape of
_gluon_prefill_tf32_kernel's hand-over: a value made before the partitions
(captured by the default partition), a worker partition that only stores to
global memory, and a layout conversion through shared memory after the join.
It touches no shared memory of its own, so any hazard racecheck reports is in
the code Triton generates around the partitions.

    compute-sanitizer --tool racecheck python -m tools.racecheck_ws_probe

H200 result: see benchmarks/RESULTS.md (racecheck section).
"""
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def _default_partition(x):
    return (x * 2.0 + 1.0,)


@gluon.jit
def _worker_partition(w_ptr, BLOCK: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    offs = gl.arange(0, BLOCK, layout=layout)
    gl.store(w_ptr + offs, gl.full([BLOCK], 3.0, gl.float32, layout))


@gluon.jit
def _probe_kernel(in_ptr, out_ptr, w_ptr, BLOCK: gl.constexpr):
    rows: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
    cols: gl.constexpr = gl.BlockedLayout([4, 1], [8, 4], [1, 4], [0, 1])
    r = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, rows))
    c = gl.arange(0, BLOCK, layout=gl.SliceLayout(0, rows))
    x = gl.load(in_ptr + r[:, None] * BLOCK + c[None, :])
    y = gl.warp_specialize([(_default_partition, (x,)), (_worker_partition, (w_ptr, BLOCK))],
                           [4], [24])[0]
    y = gl.convert_layout(y, cols)   # through shared memory, after the join
    r2 = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, cols))
    c2 = gl.arange(0, BLOCK, layout=gl.SliceLayout(0, cols))
    gl.store(out_ptr + r2[:, None] * BLOCK + c2[None, :], y)


def main():
    n = 32
    x = torch.randn(n, n, device="cuda")
    out = torch.empty_like(x)
    w = torch.empty(n, device="cuda")
    for _ in range(3):
        _probe_kernel[(4,)](x, out, w, BLOCK=n, num_warps=4)
    torch.cuda.synchronize()
    ok = torch.equal(out, x * 2.0 + 1.0) and bool((w == 3.0).all())
    print("probe", "ok" if ok else "WRONG")


if __name__ == "__main__":
    main()
