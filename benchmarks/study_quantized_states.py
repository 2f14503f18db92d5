"""Which 8-bit code and block size for Adam's moments: round-trip and trajectory errors (not a test).

Compares, for the first moment m (signed) and the second moment v (non-negative):

* ``dynamic``: bitsandbytes' dynamic tree map (sign, run of zeros = decimal exponent, linear
  fraction), nearest code by search;
* ``linear``: 256 evenly spaced values; ``quantile``: the normal distribution's quantiles (m) or
  those of a chi-square(1) (v), each scaled to absmax 1;
* ``E4M3`` / ``E3M4`` (m) and ``E5M3`` / ``E4M4`` (v): the minifloat codes of
  :mod:`mp_wrappers.ops.reference.quant`; ``sqrtE4M4`` stores sqrt(v) as E4M4.

Metrics: the round-trip error of the Adam update direction ``m / (sqrt(v) + eps)`` for moments
built from heavy-tailed gradients, and the distance of an Adam trajectory with quantized states from
the fp32 one (relative to how far fp32 moved), plus the final loss ratio, on an MLP regression and on
a bag-of-embeddings model with rarely updated rows. Usage::

    PYTHONPATH=. python benchmarks/study_quantized_states.py [--steps 300]
"""
import argparse
import math

import torch

from mp_wrappers.ops.reference import quant as rq


def dynamic_map(signed: bool) -> torch.Tensor:
    """bitsandbytes' create_dynamic_map(signed, max_exponent_bits=7, total_bits=8), sorted."""
    data = [0.0, 1.0]
    for i in range(7):
        items = 2 ** i + 1 if signed else 2 ** (i + 1) + 1
        bounds = torch.linspace(0.1, 1, items, dtype=torch.float64)
        means = ((bounds[:-1] + bounds[1:]) / 2.0 * 10 ** (i - 6)).tolist()
        data += means + ([-x for x in means] if signed else [])
    assert len(data) == 256
    return torch.tensor(sorted(data), dtype=torch.float32)


def table_code(values: torch.Tensor):
    values = values.sort().values

    def q(x, block):
        flat = x.reshape(-1)
        pad = (-flat.numel()) % block
        b = torch.cat([flat, flat.new_zeros(pad)]).view(-1, block)
        am = b.abs().amax(1, keepdim=True).clamp_min(1e-38)
        n = b / am
        mid = (values[1:] + values[:-1]) / 2
        idx = torch.bucketize(n, mid)
        return (values[idx] * am).reshape(-1)[:flat.numel()].view(x.shape)
    return q


def mini_code(code: rq.Minifloat, sqrt: bool = False):
    def q(x, block):
        old = rq.BLOCK_SIZE
        rq.BLOCK_SIZE = block
        try:
            y = torch.sqrt(x) if sqrt else x
            c, am = rq.quantize_blockwise(y, code)
            r = rq.dequantize_blockwise(c, am, code)
            return r * r if sqrt else r
        finally:
            rq.BLOCK_SIZE = old
    return q


def quantile_table(signed: bool) -> torch.Tensor:
    p = torch.linspace(0, 1, 258, dtype=torch.float64)[1:-1]
    if signed:
        v = torch.distributions.Normal(0., 1.).icdf(p.float())
        v = torch.cat([v[:127], torch.zeros(1), v[-128:]])
    else:
        v = torch.distributions.Normal(0., 1.).icdf((0.5 + p / 2).float()) ** 2
        v = torch.cat([torch.zeros(1), v[:255]])
    return (v / v.abs().max()).float()


M_CODES = {
    'dynamic': table_code(dynamic_map(True)),
    'linear': table_code(torch.linspace(-1, 1, 255)),
    'quantile': table_code(quantile_table(True)),
    'E4M3': mini_code(rq.Minifloat(4, 3, True)),
    'E3M4': mini_code(rq.Minifloat(3, 4, True)),
}
V_CODES = {
    'dynamic': table_code(dynamic_map(False)),
    'linear': table_code(torch.linspace(0, 1, 256)),
    'quantile': table_code(quantile_table(False)),
    'E5M3': mini_code(rq.Minifloat(5, 3, False)),
    'E4M4': mini_code(rq.Minifloat(4, 4, False)),
    'sqrtE4M4': mini_code(rq.Minifloat(4, 4, False), sqrt=True),
}


def heavy_moments(n=1 << 18, steps=50, seed=0):
    """m, v after `steps` Adam EMA steps of gradients with per-row lognormal scales (sigma 1.5) and
    10% of rows receiving no gradient at most steps (rarely used features)."""
    gen = torch.Generator().manual_seed(seed)
    rows = n // 64
    scale = torch.exp(1.5 * torch.randn(rows, 1, generator=gen))
    rare = torch.rand(rows, 1, generator=gen) < 0.1
    m = torch.zeros(rows, 64)
    v = torch.zeros(rows, 64)
    for t in range(steps):
        g = torch.randn(rows, 64, generator=gen) * scale
        g = torch.where(rare & (torch.rand(rows, 1, generator=gen) < 0.9), 0., g)
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
    return m.reshape(-1), v.reshape(-1)


def roundtrip(block):
    m, v = heavy_moments()
    eps = 1e-8
    ref = m / (v.sqrt() + eps)
    out = {}
    for mn, mq in M_CODES.items():
        out[('m', mn)] = ((mq(m, block) - m).norm() / m.norm()).item()
    for vn, vq in V_CODES.items():
        out[('v', vn)] = ((m / (vq(v, block).sqrt() + eps) - ref).norm() / ref.norm()).item()
    return out


def adam_run(task, steps, mq=None, vq=None, block=256, lr=1e-3, seed=0):
    torch.manual_seed(seed)
    params, loss_fn = task()
    state = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]
    b1, b2, eps = 0.9, 0.999, 1e-8
    start = [p.detach().clone() for p in params]
    for t in range(1, steps + 1):
        for p in params:
            p.grad = None
        loss = loss_fn(t)
        loss.backward()
        with torch.no_grad():
            for p, (m, v) in zip(params, state):
                m.mul_(b1).add_(p.grad, alpha=1 - b1)
                v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                upd = (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps)
                p.sub_(lr * upd)
                if mq is not None and p.numel() >= 4096:
                    m.copy_(mq(m, block))
                    v.copy_(vq(v, block))
    with torch.no_grad():
        final = loss_fn(steps + 1).item()
    return [p.detach() for p in params], start, final


def mlp_task():
    gen = torch.Generator().manual_seed(1)
    teacher = torch.randn(64, 16, generator=gen)
    xs = torch.randn(4096, 64, generator=gen) * torch.exp(torch.randn(64, generator=gen))
    ys = torch.tanh(xs @ teacher)
    w1 = (torch.randn(64, 256) * 0.1).requires_grad_()
    w2 = (torch.randn(256, 16) * 0.1).requires_grad_()

    def loss(t):
        idx = torch.randint(0, 4096, (128,), generator=torch.Generator().manual_seed(t))
        return ((torch.relu(xs[idx] @ w1) @ w2 - ys[idx]) ** 2).mean()
    return [w1, w2], loss


def embedding_task():
    """Zipf-distributed token ids: most rows of the table see a gradient rarely."""
    gen = torch.Generator().manual_seed(2)
    vocab, dim = 2048, 32
    target = torch.randn(vocab, generator=gen)
    probs = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    emb = (torch.randn(vocab, dim) * 0.1).requires_grad_()
    head = (torch.randn(dim) * 0.1).requires_grad_()

    def loss(t):
        ids = torch.multinomial(probs, 256, replacement=True,
                                generator=torch.Generator().manual_seed(t))
        return ((emb[ids] @ head - target[ids]) ** 2).mean()
    return [emb, head], loss


def trajectory(task, steps, mq, vq, block):
    ref, start, ref_loss = adam_run(task, steps)
    got, _, loss = adam_run(task, steps, mq, vq, block)
    moved = math.sqrt(sum(((r - s) ** 2).sum().item() for r, s in zip(ref, start)))
    dist = math.sqrt(sum(((g - r) ** 2).sum().item() for g, r in zip(got, ref)))
    return dist / moved, loss / ref_loss


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--steps', type=int, default=300)
    args = ap.parse_args()
    print('## round-trip error of m (rel. L2) and of m/(sqrt(v)+eps) through v, heavy-tailed')
    for block in (64, 256, 2048):
        r = roundtrip(block)
        print(f'block {block:5d}: ' + '  '.join(f'{k[0]}:{k[1]}={v:.4f}' for k, v in r.items()))
    print('## Adam trajectory: |p - p_fp32| / |p_fp32 - p0|, final loss / fp32 loss')
    pairs = [('dynamic', 'dynamic'), ('linear', 'linear'), ('quantile', 'quantile'),
             ('E4M3', 'E5M3'), ('E3M4', 'E5M3'), ('E4M3', 'E4M4'), ('E4M3', 'sqrtE4M4')]
    for block in (64, 256, 2048):
        for mn, vn in pairs:
            cells = []
            for name, task in (('mlp', mlp_task), ('emb', embedding_task)):
                d, lr_ = trajectory(task, args.steps, M_CODES[mn], V_CODES[vn], block)
                cells.append(f'{name}: dist {d:.4f} loss {lr_:.3f}')
            print(f'block {block:5d} m={mn:8s} v={vn:8s} ' + ' | '.join(cells), flush=True)


if __name__ == '__main__':
    main()
