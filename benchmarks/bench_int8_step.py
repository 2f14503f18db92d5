"""One optimizer step of ``FusedAdam(state_dtype='int8')`` against torch's fused fp32 AdamW (not a test);
with ``--optimizer sgd``, ``FusedSGD(state_dtype='int8')`` against torch's fused fp32 SGD.

The smallest comparison behind issue 27's "at most torch's fused fp32 step": 25M fp32 params in 8
tensors (few tensors, so the per-tensor host work of the 202-tensor model in
``bench_quantized_states.py`` stays out of it), AdamW with weight decay, ``step()`` timed by the
wall clock. The three optimizers (ours with int8 and with fp32 states, torch's fused) step in
interleaved rounds in one process, so load and memory placement hit all alike; medians of the
rounds. Builds are compared by running this script alternately against each (``--repo``), in both
orders: two processes of the same build can differ by a few percent in memory placement.

Each optimizer's resident bytes per param after its steps (params, grads and every state tensor) are
printed beside its time. SGD: momentum 0.9, Nesterov, weight decay; torch's peers are its fused and
its foreach SGD.

Run: ``python benchmarks/bench_int8_step.py [--optimizer adam|sgd] [--threads 1] [--rounds 21]
[--repo PATH]``, and with
``MP_WRAPPERS_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2`` for the AVX2 kernels (ours and torch's).
"""
import argparse
import os
import statistics
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--optimizer', choices=('adam', 'sgd'), default='adam')
    ap.add_argument('--threads', type=int, default=1)
    ap.add_argument('--rounds', type=int, default=21)
    ap.add_argument('--params', type=int, default=25_000_000)
    ap.add_argument('--tensors', type=int, default=8)
    ap.add_argument('--repo', default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                    help='the checkout whose mp_wrappers (and built extension) to time')
    args = ap.parse_args(argv)
    sys.path.insert(0, args.repo)
    import torch
    from mp_wrappers.ops import backend
    from mp_wrappers.optim import FusedAdam, FusedSGD
    torch.set_num_threads(args.threads)

    def params():
        g = torch.Generator().manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(args.params // args.tensors, generator=g))
              for _ in range(args.tensors)]
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g) * 1e-2
        return ps

    if args.optimizer == 'adam':
        hp = dict(lr=1e-3, weight_decay=0.01)
        peer = 'torch AdamW fused'
        opts = {'FusedAdam int8': FusedAdam(params(), adam_w_mode=True, state_dtype='int8', **hp),
                peer: torch.optim.AdamW(params(), fused=True, **hp),
                'FusedAdam fp32': FusedAdam(params(), adam_w_mode=True, **hp)}
    else:
        hp = dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-4)
        peer = 'torch SGD fused'
        opts = {'FusedSGD int8': FusedSGD(params(), state_dtype='int8', **hp),
                peer: torch.optim.SGD(params(), fused=True, **hp),
                'torch SGD foreach': torch.optim.SGD(params(), foreach=True, **hp),
                'FusedSGD fp32': FusedSGD(params(), **hp)}
    for o in opts.values():
        for _ in range(3):  # states allocated, caches warm
            o.step()
    times = {k: [] for k in opts}
    for _ in range(args.rounds):
        for k, o in opts.items():
            start = time.perf_counter()
            o.step()
            times[k].append(time.perf_counter() - start)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    torch_ms = med[peer]
    print(f"{args.params / 1e6:.0f}M params in {args.tensors} tensors, {args.threads} thread(s), "
          f"kernels {backend()['cpu']}, ATen {torch.backends.cpu.get_cpu_capability()}, "
          f"medians of {args.rounds} rounds")
    for k, ms in med.items():
        print(f'  {k:18s} {ms:7.2f} ms  {ms / torch_ms:5.2f}x torch fused  '
              f'{_resident_bytes(opts[k]) / args.params:5.2f} B/param resident')
    return 0


def _resident_bytes(opt) -> int:
    """Bytes of the params, their grads and every optimizer-state tensor (storages counted once)."""
    import torch
    seen = {}
    for group in opt.param_groups:
        for p in group['params']:
            for t in [p, p.grad] + [v for v in opt.state.get(p, {}).values()
                                    if isinstance(v, torch.Tensor)]:
                if t is not None:
                    seen[(t.untyped_storage().data_ptr(), t.dtype)] = t.numel() * t.element_size()
    return sum(seen.values())


if __name__ == '__main__':
    sys.exit(main())
