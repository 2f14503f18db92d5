"""The 8-bit AdamW op's time per element with its data in cache, against torch's fused AdamW op (not
a test): both ops called directly on one fp32 tensor of each size, the time of a 256-element call
subtracted (what a call costs beside its elements), fastest of 7 rounds. Where
``bench_int8_step.py`` times ``step()`` on 25M params (DRAM), this isolates the kernels'
arithmetic: docs/quantized_states.md, "What bounds the 8-bit step on AVX2".

Run: ``python benchmarks/bench_int8_in_cache.py [sizes ...] [--threads 1]``, with
``MP_WRAPPERS_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2`` for the AVX2 kernels (ours and torch's).
"""
import argparse
import os
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('sizes', nargs='*', type=int, default=[262144, 1048576])
    ap.add_argument('--threads', type=int, default=1)
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import torch
    from mp_wrappers.ops import backend
    import mp_wrappers._C  # noqa: F401  (the ops)
    torch.set_num_threads(args.threads)
    ours_op = torch.ops.mp_wrappers.multi_tensor_adam8bit_

    def ours(n):
        g = torch.Generator().manual_seed(0)
        p, gr = torch.randn(n, generator=g), torch.randn(n, generator=g) * 1e-2
        nb = (n + 255) // 256
        mc, vc = torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
        ma, va, step = torch.zeros(nb), torch.zeros(nb), torch.zeros(())
        return lambda: ours_op([p], [gr], [mc], [ma], [vc], [va], [], step, 1e-3, 0.9, 0.999, 1e-8,
                               0.01, True, True, None, None, None)

    def torch_fused(n):
        g = torch.Generator().manual_seed(0)
        p, gr = torch.randn(n, generator=g), torch.randn(n, generator=g) * 1e-2
        m, v, step = torch.zeros(n), torch.zeros(n), torch.zeros(())
        return lambda: torch._fused_adamw_([p], [gr], [m], [v], [], [step], lr=1e-3, beta1=0.9,
                                           beta2=0.999, weight_decay=0.01, eps=1e-8,
                                           amsgrad=False, maximize=False)

    def seconds(call, reps):
        for _ in range(20):  # states settle (codes normal), caches warm
            call()
        best = float('inf')
        for _ in range(7):
            start = time.perf_counter()
            for _ in range(reps):
                call()
            best = min(best, (time.perf_counter() - start) / reps)
        return best

    base = {k: seconds(f(256), 2000) for k, f in (('ours', ours), ('torch', torch_fused))}
    print(f"{args.threads} thread(s), kernels {backend()['cpu']}, "
          f"ATen {torch.backends.cpu.get_cpu_capability()}; ns per element, a 256-element call "
          f"({base['ours'] * 1e6:.1f} / {base['torch'] * 1e6:.1f} us) subtracted")
    for n in args.sizes:
        reps = max(5, int(2e8 / n / 1000))
        a = (seconds(ours(n), reps) - base['ours']) / n * 1e9
        b = (seconds(torch_fused(n), reps) - base['torch']) / n * 1e9
        print(f'  {n:>9} elements: FusedAdam int8 op {a:.3f}  torch fused AdamW op {b:.3f}  '
              f'{a / b:.2f}x')
    return 0


if __name__ == '__main__':
    sys.exit(main())
