"""Global-memory traffic of every CUDA kernel, counted by host execution (no GPU needed).

Every global load and store of the kernels goes through the helpers of
mp_wrappers/csrc/include/mp_wrappers/cuda/multi_tensor_apply.cuh; the host-execution build
(tests/cuda_host.py, real launch geometry) counts the bytes each launch reads and writes.
For every op this prints bytes per parameter against the minimum (each tensor the op must read read
once, each tensor it must write written once), and for the fused O2 Adam step (a read-only inf/norm
pass over the half grads, then one update pass writing the fp32 master, moments and the half model)
against docs/semantics.md section 7: fp32 Adam 28 B/param, fused O2 ~30, the composed torch pipeline
~44; and the same with 8-bit moments (``multi_tensor_adam8bit_``: 16.06 B/param at least), also on
lean bf16 masters (``multi_tensor_adam8bit_lean_``: 14.06 B/param with a 'kahan' compensation, 10.06
with 'stochastic' rounding), and SGD's 8-bit momentum (``multi_tensor_sgd8bit_``: 14.03 against fp32
momentum's 20). The implied step time uses the H100 SXM's *nominal* HBM3 bandwidth
(3.35 TB/s), not a measurement: a real kernel reaches some fraction of it.

Usage: python benchmarks/bench_cuda_traffic.py [--params N]   (builds the 'real' variant if needed)
"""
import argparse
import os
import sys
from collections import defaultdict

import torch

# The host-execution harness is test code (tests/cuda_host.py), not part of the package.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, 'tests')]
import cuda_host  # noqa: E402

H100_NOMINAL_BYTES_PER_S = 3.35e12
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def _sizes(total, chunk):
    """A few tensors of about `total` elements: several chunks, a ragged tail, a small one."""
    big = max(total // 2 // chunk, 1) * chunk + 100
    return [big, max(total - big - 1000, 1), 1000]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--params', type=int, default=400_000,
                        help='parameters per op call (bytes/param does not depend on it)')
    parser.add_argument('--model-params', type=float, default=25.3e6,
                        help='model size for the implied H100 step time')
    args = parser.parse_args()
    mod = cuda_host.build('real')
    ops = getattr(torch.ops, mod.namespace)
    sizes = _sizes(args.params, mod.geometry['chunk_size'])
    n = sum(sizes)

    def t(dtype, fill=0.5):
        return [torch.full((s,), fill, dtype=dtype) for s in sizes]

    def step():
        return torch.zeros(1)

    one, zero = torch.ones(1), torch.zeros(1)

    def moments8():
        # codes of 0.5-ish moments (any codes do: the traffic does not depend on the values)
        codes = [torch.full((s,), 60, dtype=torch.uint8) for s in sizes]
        blocks = [torch.full(((s + 255) // 256,), 0.5) for s in sizes]
        return [codes, blocks, [c.clone() for c in codes], [b.clone() for b in blocks]]

    def adam8bit(param_dtype, grad_dtype, model_dtype):
        return lambda: ops.multi_tensor_adam8bit_(
            t(param_dtype), t(grad_dtype), *moments8(), t(model_dtype) if model_dtype else [],
            step(), 1e-3, 0.9, 0.999, 1e-8, 0.01, True, True, one, zero)

    def adam8bit_lean(storage):
        aux = t(BF16, 0.0) if storage == 'kahan' else []
        return lambda: ops.multi_tensor_adam8bit_lean_(
            t(BF16), aux, t(BF16), *moments8(), step(), 1e-3, 0.9, 0.999, 1e-8, 0.01, True, True,
            storage, 0, one, zero)

    # 8-bit moments: 1 byte per moment read and written, one fp32 absmax per 256 elements and
    # moment read and written (2 x 2 x 4 / 256 = 0.0625 B/param)
    eight_bit = 0.0625
    cases = [
        # (name, minimum bytes per param, call)
        ('scale fp32->fp32', 8, lambda: ops.multi_tensor_scale_(t(F32), t(F32), one, zero)),
        ('scale fp16->fp32 (unscale)', 6,
         lambda: ops.multi_tensor_scale_(t(F16), t(F32), one, zero)),
        ('axpby fp32', 12,
         lambda: ops.multi_tensor_axpby_(t(F32), t(F32), t(F32), 1.0, 2.0, -1, zero)),
        ('l2norm fp32', 4, lambda: ops.multi_tensor_l2norm(t(F32), True)),
        ('unscale_l2norm fp16', 2,
         lambda: ops.multi_tensor_unscale_l2norm(t(F16), one, zero, True)),
        ('adam fp32', 28,
         lambda: ops.multi_tensor_adam_(t(F32), t(F32), t(F32), t(F32), [], step(), 1e-3, 0.9,
                                        0.999, 1e-8, 0.01, True, True, one, zero)),
        ('adam O2 update (bf16 grad, bf16 model)', 28,
         lambda: ops.multi_tensor_adam_(t(F32), t(BF16), t(F32), t(F32), t(BF16), step(), 1e-3,
                                        0.9, 0.999, 1e-8, 0.01, True, True, one, zero)),
        ('adam 8-bit states fp32', 16 + eight_bit, adam8bit(F32, F32, None)),
        ('adam 8-bit O2 update (bf16 grad, bf16 model)', 16 + eight_bit,
         adam8bit(F32, BF16, BF16)),
        # lean bf16 masters: the bf16 param (2 + 2), its compensation (2 + 2), the bf16 grad
        ('adam 8-bit lean kahan (bf16 grad)', 14 + eight_bit, adam8bit_lean('kahan')),
        ('adam 8-bit lean stochastic (bf16 grad)', 10 + eight_bit, adam8bit_lean('stochastic')),
        ('sgd momentum fp32', 20,
         lambda: ops.multi_tensor_sgd_(t(F32), t(F32), t(F32), [], step(), 0.1, 0.9, 0.0, 0.0,
                                       False, False, one, zero)),
        # 8-bit momentum: 1 byte read (not on the first update) and written, one fp32 absmax per
        # 256 elements read and written (2 x 4 / 256 = 0.03125 B/param); step 1: a later update
        ('sgd 8-bit momentum fp32', 14 + eight_bit / 2,
         lambda: ops.multi_tensor_sgd8bit_(t(F32), t(F32), *moments8()[:2], [],
                                           torch.ones(1), 0.1, 0.9, 0.0, 0.0, False, False, one,
                                           zero)),
        ('adagrad fp32', 20,
         lambda: ops.multi_tensor_adagrad_(t(F32), t(F32), t(F32), [], step(), 0.01, 1e-10, 0.0,
                                           False, one, zero)),
        # Two-pass ops: the trust ratio / running grad norm needs a whole tensor before any
        # update, so their minimum is that of the two passes (pass 1 writes the moments, pass 2
        # reads them back); the one-pass bound would be 28 / 20.
        ('lamb fp32 (trust ratio, 2 passes)', 40,
         lambda: ops.multi_tensor_lamb_(t(F32), t(F32), t(F32), t(F32), [], step(), 1e-3, 0.9,
                                        0.999, 1e-6, 0.01, True, True, True, 1.0, False, one,
                                        one, zero)),
        ('novograd fp32 (2 passes)', 24,
         lambda: ops.multi_tensor_novograd_(t(F32), t(F32), t(F32), torch.zeros(len(sizes)), [],
                                            step(), 1e-3, 0.95, 0.98, 1e-8, 0.0, True, True,
                                            False, 2, False, one, zero)),
    ]
    print(f'host-execution traffic count, real geometry, {n} params in {len(sizes)} tensors')
    print(f'{"op":44s} {"B/param":>8s} {"minimum":>8s} {"ratio":>6s}  kernels (B/param)')
    results = {}
    for name, minimum, call in cases:
        mod.traffic_reset()
        call()
        per_kernel = defaultdict(int)
        for kernel, _, _, read, written in mod.traffic_log():
            per_kernel[kernel] += read + written
        total = sum(per_kernel.values()) / n
        results[name] = total
        detail = ', '.join(f'{k} {v / n:.2f}' for k, v in per_kernel.items())
        print(f'{name:44s} {total:8.2f} {minimum:8.2f} {total / minimum:6.3f}  {detail}')
    o2 = results['unscale_l2norm fp16'] + results['adam O2 update (bf16 grad, bf16 model)']
    print()
    print('fused O2 Adam step (unscale_l2norm over fp16 grads + one update pass):')
    print(f'  {o2:.2f} B/param; docs/semantics.md section 7: minimum ~30, composed torch pipeline ~44')
    o2_8bit = results['unscale_l2norm fp16'] + results['adam 8-bit O2 update (bf16 grad, bf16 model)']
    print(f'fused O2 Adam step with 8-bit states: {o2_8bit:.2f} B/param')
    for label, bpp in (('fp32 Adam', results['adam fp32']), ('fused O2 Adam', o2),
                       ('8-bit Adam, fp32 params', results['adam 8-bit states fp32']),
                       ('fused O2 Adam, 8-bit states', o2_8bit),
                       ('lean kahan masters, 8-bit states (update)',
                        results['adam 8-bit lean kahan (bf16 grad)']),
                       ('lean stochastic masters, 8-bit states (update)',
                        results['adam 8-bit lean stochastic (bf16 grad)']),
                       ('fp32 momentum SGD', results['sgd momentum fp32']),
                       ('8-bit momentum SGD, fp32 params', results['sgd 8-bit momentum fp32']),
                       ('composed torch O2 (docs/semantics.md)', 44.0)):
        ms = bpp * args.model_params / H100_NOMINAL_BYTES_PER_S * 1e3
        print(f'  implied H100 time, {args.model_params / 1e6:.1f}M params, {label}: {ms:.3f} ms '
              '(nominal 3.35 TB/s HBM3, not measured)')


if __name__ == '__main__':
    main()
