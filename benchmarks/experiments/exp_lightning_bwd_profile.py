"""Where the time of lightning forward + backward through torch autograd goes
(B1 H64 N4096, D = E = 128, final state, ed constant, as bench_lightning_backward):
torch.profiler's CUDA kernel table for ours and for fla's chunk_simple_gla
(if importable), and the host time per call with the GPU synchronised.

    PYTHONPATH=.:/path/to/fla python benchmarks/experiments/exp_lightning_bwd_profile.py
"""
import time

import torch

import adapters.torch as at


def main():
    from torch.profiler import ProfilerActivity, profile
    for dtype in (torch.bfloat16,):
        b, h, n, d = 1, 64, 4096, 128
        g = torch.Generator(device="cpu").manual_seed(0)
        q, k, v = (torch.randn(b, h, n, d, generator=g).mul(0.3).to("cuda", dtype).requires_grad_()
                   for _ in range(3))
        ed = torch.rand(h, generator=g).mul(0.5).add(0.01).to("cuda")
        do = torch.randn(b, h, n, d, generator=g).to("cuda", dtype)
        dkv = torch.randn(b, h, d, d, generator=g).to("cuda")

        def ours():
            o, kv = at.lightning_attention(q, k, v, ed, 256, None, True)
            return torch.autograd.grad((o * do).sum() + (kv * dkv).sum(), (q, k, v))
        fns = {"ours": ours}
        try:
            from fla.ops.simple_gla import chunk_simple_gla
            qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
            dot = do.transpose(1, 2).contiguous()

            def fla():
                o, st = chunk_simple_gla(qt, kt, vt, g_gamma=-ed, scale=1.0, output_final_state=True)
                return torch.autograd.grad((o * dot).sum() + (st * dkv).sum(), (qt, kt, vt))
            fns["fla"] = fla
        except Exception as exc:  # noqa: BLE001 - benchmark-only dependency
            print(f"fla not importable: {exc}")
        for name, fn in fns.items():
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")  # any synchronising call in fn warns
            fn()
            torch.cuda.set_sync_debug_mode(0)
            # ours: host time of the forward and of the backward, GPU idle before each (enqueue only)
            if name == "ours":
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = at.lightning_attention(q, k, v, ed, 256, None, True)
                t1 = time.perf_counter()
                loss = (out[0] * do).sum() + (out[1] * dkv).sum()
                torch.cuda.synchronize()
                t2 = time.perf_counter()
                torch.autograd.grad(loss, (q, k, v))
                t3 = time.perf_counter()
                torch.cuda.synchronize()
                print(f"{name}: forward enqueue {(t1 - t0) * 1e6:.0f} us, backward enqueue {(t3 - t2) * 1e6:.0f} us")
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(20):
                fn()
            host = (time.perf_counter() - t0) / 20
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / 20
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    fn()
                torch.cuda.synchronize()
            print(f"== {name} {str(dtype)[6:]}: host {host * 1e6:.0f} us/call to enqueue, wall {wall * 1e6:.0f} us/call")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))


if __name__ == "__main__":
    main()
