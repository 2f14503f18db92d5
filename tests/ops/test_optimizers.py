"""The fused optimizer ops against float64 oracles written out plainly here.

Each op is called through its public entry point (so the kernel when one is built, else the
reference) for a few steps; every step is compared with one step of the oracle started from the op's
own inputs, so the half-precision rounding of params does not accumulate into the comparison. Also:
a found_inf step changes no bit, grads scaled by grad_scale give the unscaled result, and bad
arguments raise.
"""
import math

import pytest
import torch

from _tolerances import TOL
from mp_wrappers import ops
from mp_wrappers.ops import reference

SHAPES = [(7,), (33, 5), (1,), (3, 4, 11)]
# (param dtype, grad dtype, model copy dtype or None): plain fp32, fp32 masters with half grads and
# model copies (the fused mixed-precision step), and half params stepped directly.
DTYPES = [
    (torch.float32, torch.float32, None),
    (torch.float32, torch.float16, torch.float16),
    (torch.float32, torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16, None),
    (torch.bfloat16, torch.bfloat16, None),
]
SCALE = 1024.0  # a power of two: scaling the grads is exact


def f64(ts):
    return [t.to(torch.float64) for t in ts]


# ---- float64 oracles: one update, written out the obvious way ----------------------------------------

def adam_oracle(p, g, m, v, t, lr, b1, b2, eps, wd, adam_w, bias_correction):
    if not adam_w:
        g = g + wd * p
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    bc1 = 1 - b1 ** t if bias_correction else 1.0
    bc2 = 1 - b2 ** t if bias_correction else 1.0
    update = (m / bc1) / (torch.sqrt(v / bc2) + eps)
    if adam_w:
        update = update + wd * p
    return p - lr * update, m, v


def sgd_oracle(p, g, buf, t, lr, momentum, dampening, wd, nesterov, wd_after):
    if not wd_after:
        g = g + wd * p
    if momentum != 0:
        buf = g.clone() if t == 1 else momentum * buf + (1 - dampening) * g
        g = g + momentum * buf if nesterov else buf
    if wd_after:
        g = g + wd * p
    return p - lr * g, buf


def lamb_oracle(p, g, m, v, t, lr, b1, b2, eps, wd, adam_w, bias_correction, grad_averaging,
                max_grad_norm, use_nvlamb, global_norm):
    if max_grad_norm > 0 and global_norm > max_grad_norm:
        g = g / (global_norm / max_grad_norm)
    if not adam_w:
        g = g + wd * p
    beta3 = 1 - b1 if grad_averaging else 1.0
    m = b1 * m + beta3 * g
    v = b2 * v + (1 - b2) * g * g
    bc1 = 1 - b1 ** t if bias_correction else 1.0
    bc2 = 1 - b2 ** t if bias_correction else 1.0
    update = (m / bc1) / (torch.sqrt(v / bc2) + eps)
    if adam_w:
        update = update + wd * p
    ratio = lr
    if use_nvlamb or wd != 0:
        p_norm, u_norm = p.norm().item(), update.norm().item()
        if p_norm != 0 and u_norm != 0:
            ratio = lr * p_norm / u_norm
    return p - ratio * update, m, v


def adagrad_oracle(p, g, h, lr, eps, wd, w_mode):
    if not w_mode:
        g = g + wd * p
    h = h + g * g
    update = g / (torch.sqrt(h) + eps)
    if w_mode:
        update = update + wd * p
    return p - lr * update, h


def novograd_oracle(p, g, m, norm, t, lr, b1, b2, eps, wd, bias_correction, grad_averaging,
                    reg_inside, norm_type, init_zero):
    n = g.norm().item() if norm_type == 2 else g.abs().max().item()
    if t == 1 and not init_zero:
        norm = n
    elif norm_type == 2:
        norm = math.sqrt(b2 * norm ** 2 + (1 - b2) * n ** 2)
    else:
        norm = b2 * norm + (1 - b2) * n
    bc1 = 1 - b1 ** t if bias_correction else 1.0
    bc2 = math.sqrt(1 - b2 ** t) if bias_correction else 1.0
    beta3 = 1 - b1 if grad_averaging else 1.0
    denom = norm / bc2 + eps
    if reg_inside:
        m = b1 * m + beta3 * (g / denom + wd * p)
        p = p - lr * m / bc1
    else:
        m = b1 * m + beta3 * g
        p = p - lr * (m / bc1 / denom + wd * p)
    return p, m, norm


# ---- cases: how to build the state, call the op and the oracle ---------------------------------------

class Case:
    """One op with one set of hyperparameters."""

    def __init__(self, name, hp):
        self.name, self.hp = name, hp

    def __repr__(self):
        return f'{self.name}-' + '-'.join(f'{k}={v}' for k, v in self.hp.items())

    def init_state(self, params):
        z = [torch.zeros(p.shape) for p in params]
        if self.name in ('adam', 'lamb'):
            return dict(m=z, v=[torch.zeros(p.shape) for p in params])
        if self.name == 'sgd':
            return dict(buf=z if self.hp['momentum'] != 0 else [])
        if self.name == 'adagrad':
            return dict(h=[torch.full(p.shape, 0.1) for p in params])
        return dict(m=z, norms=torch.zeros(len(params)))

    def call(self, params, grads, state, model, step, grad_scale, found_inf, global_norm=None):
        h = self.hp
        if self.name == 'adam':
            ops.multi_tensor_adam(params, grads, state['m'], state['v'], model, step, h['lr'], 0.9,
                                  0.99, 1e-8, h['wd'], h['adam_w'], h['bc'], grad_scale, found_inf)
        elif self.name == 'sgd':
            ops.multi_tensor_sgd(params, grads, state['buf'], model, step, h['lr'], h['momentum'],
                                 h['dampening'], h['wd'], h['nesterov'], h['wd_after'],
                                 grad_scale, found_inf)
        elif self.name == 'lamb':
            ops.multi_tensor_lamb(params, grads, state['m'], state['v'], model, step, h['lr'], 0.9,
                                  0.99, 1e-6, h['wd'], h['adam_w'], True, h['avg'], h['max_norm'],
                                  h['nvlamb'], global_norm, grad_scale, found_inf)
        elif self.name == 'adagrad':
            ops.multi_tensor_adagrad(params, grads, state['h'], model, step, h['lr'], 1e-10,
                                     h['wd'], h['w_mode'], grad_scale, found_inf)
        else:
            ops.multi_tensor_novograd(params, grads, state['m'], state['norms'], model, step,
                                      h['lr'], 0.9, 0.98, 1e-8, h['wd'], h['bc'], h['avg'],
                                      h['reg_inside'], h['norm_type'], h['init_zero'],
                                      grad_scale, found_inf)

    def oracle(self, params, grads, state, t, global_norm):
        """Float64 results of one update: (params, state) with the same structure as the inputs."""
        h = self.hp
        ps, gs = f64(params), f64(grads)
        if self.name == 'adam':
            out = [adam_oracle(p, g, m, v, t, h['lr'], 0.9, 0.99, 1e-8, h['wd'], h['adam_w'],
                               h['bc']) for p, g, m, v in zip(ps, gs, f64(state['m']),
                                                              f64(state['v']))]
            return [o[0] for o in out], dict(m=[o[1] for o in out], v=[o[2] for o in out])
        if self.name == 'sgd':
            bufs = f64(state['buf']) or [None] * len(ps)
            out = [sgd_oracle(p, g, b, t, h['lr'], h['momentum'], h['dampening'], h['wd'],
                              h['nesterov'], h['wd_after']) for p, g, b in zip(ps, gs, bufs)]
            return [o[0] for o in out], dict(buf=[o[1] for o in out] if state['buf'] else [])
        if self.name == 'lamb':
            out = [lamb_oracle(p, g, m, v, t, h['lr'], 0.9, 0.99, 1e-6, h['wd'], h['adam_w'], True,
                               h['avg'], h['max_norm'], h['nvlamb'], global_norm)
                   for p, g, m, v in zip(ps, gs, f64(state['m']), f64(state['v']))]
            return [o[0] for o in out], dict(m=[o[1] for o in out], v=[o[2] for o in out])
        if self.name == 'adagrad':
            out = [adagrad_oracle(p, g, s, h['lr'], 1e-10, h['wd'], h['w_mode'])
                   for p, g, s in zip(ps, gs, f64(state['h']))]
            return [o[0] for o in out], dict(h=[o[1] for o in out])
        out = [novograd_oracle(p, g, m, n, t, h['lr'], 0.9, 0.98, 1e-8, h['wd'], h['bc'],
                               h['avg'], h['reg_inside'], h['norm_type'], h['init_zero'])
               for p, g, m, n in zip(ps, gs, f64(state['m']), state['norms'].double().tolist())]
        return [o[0] for o in out], dict(m=[o[1] for o in out],
                                         norms=torch.tensor([o[2] for o in out]))


CASES = [
    Case('adam', dict(lr=1e-2, wd=0.1, adam_w=True, bc=True)),
    Case('adam', dict(lr=1e-2, wd=0.1, adam_w=False, bc=True)),
    Case('adam', dict(lr=1e-3, wd=0.0, adam_w=True, bc=False)),
    Case('sgd', dict(lr=0.1, momentum=0.9, dampening=0.0, wd=1e-2, nesterov=True,
                     wd_after=False)),
    Case('sgd', dict(lr=0.1, momentum=0.8, dampening=0.3, wd=1e-2, nesterov=False,
                     wd_after=True)),
    Case('sgd', dict(lr=0.1, momentum=0.0, dampening=0.0, wd=1e-2, nesterov=False,
                     wd_after=False)),
    Case('lamb', dict(lr=1e-2, wd=0.01, adam_w=True, avg=True, max_norm=1.0, nvlamb=False)),
    Case('lamb', dict(lr=1e-2, wd=0.0, adam_w=True, avg=False, max_norm=0.0, nvlamb=False)),
    Case('lamb', dict(lr=1e-2, wd=0.0, adam_w=True, avg=True, max_norm=1e4, nvlamb=True)),
    Case('lamb', dict(lr=1e-2, wd=0.05, adam_w=False, avg=True, max_norm=1.0, nvlamb=False)),
    Case('adagrad', dict(lr=1e-2, wd=0.1, w_mode=False)),
    Case('adagrad', dict(lr=1e-2, wd=0.1, w_mode=True)),
    Case('novograd', dict(lr=1e-2, wd=0.01, bc=True, avg=True, reg_inside=False, norm_type=2,
                          init_zero=False)),
    Case('novograd', dict(lr=1e-2, wd=0.01, bc=True, avg=False, reg_inside=True, norm_type=0,
                          init_zero=False)),
    Case('novograd', dict(lr=1e-2, wd=0.0, bc=False, avg=True, reg_inside=False, norm_type=2,
                          init_zero=True)),
]


def make_inputs(case, dtypes, seed):
    p_dtype, g_dtype, m_dtype = dtypes
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen).to(p_dtype) for s in SHAPES]
    model = [p.to(m_dtype) for p in params] if m_dtype is not None else []
    return params, model, case.init_state(params), gen


def global_norm_of(grads, scale):
    return math.sqrt(sum(float((g.double() / scale).pow(2).sum()) for g in grads))


def assert_close(actual, expected, dtype, what):
    torch.testing.assert_close(actual.double(), expected.to(dtype).double(), **TOL[dtype],
                               msg=lambda m: f'{what}: {m}')


@pytest.mark.parametrize('scaled', [False, True], ids=['unscaled', 'grad_scale'])
@pytest.mark.parametrize('dtypes', DTYPES, ids=lambda d: '-'.join(str(x)[6:] for x in d))
@pytest.mark.parametrize('case', CASES, ids=repr)
def test_op_matches_float64_oracle(case, dtypes, scaled, cpu_isa):
    params, model, state, gen = make_inputs(case, dtypes, seed=0)
    step = torch.zeros(1)
    scale = SCALE if scaled else 1.0
    for t in range(1, 4):
        # Gradients of different magnitudes so LAMB's clipping is both on and off across steps.
        grads = [(torch.randn(p.shape, generator=gen) * (0.3 * t)).to(dtypes[1]) for p in params]
        unscaled = [g.double() for g in grads]
        fed = [(g.double() * scale).to(dtypes[1]) for g in grads]
        gnorm_value = global_norm_of(unscaled, 1.0)
        gnorm = torch.tensor([gnorm_value], dtype=torch.float32)
        exp_p, exp_state = case.oracle(params, unscaled, state, t, gnorm_value)
        case.call(params, fed, state, model, step, torch.tensor([scale]) if scaled else None,
                  None, gnorm)
        assert step.item() == t
        for i, (p, e) in enumerate(zip(params, exp_p)):
            assert_close(p, e, p.dtype, f'step {t} param {i}')
            if model:
                assert_close(model[i], e, model[i].dtype, f'step {t} model param {i}')
                # The model copy is the fp32 master rounded once, bit for bit.
                assert torch.equal(model[i], p.to(model[i].dtype))
        for key, values in exp_state.items():
            got = state[key]
            if isinstance(values, torch.Tensor):
                assert_close(got, values, torch.float32, f'step {t} {key}')
            else:
                for i, (a, e) in enumerate(zip(got, values)):
                    assert_close(a, e, torch.float32, f'step {t} {key}[{i}]')


@pytest.mark.parametrize('dtypes', [DTYPES[0], DTYPES[1], DTYPES[4]],
                         ids=lambda d: '-'.join(str(x)[6:] for x in d))
@pytest.mark.parametrize('case', CASES, ids=repr)
def test_found_inf_changes_no_bit(case, dtypes):
    params, model, state, gen = make_inputs(case, dtypes, seed=1)
    step = torch.zeros(1)
    gnorm = torch.ones(1)
    grads = [torch.randn(p.shape, generator=gen).to(dtypes[1]) for p in params]
    case.call(params, grads, state, model, step, None, None, gnorm)  # a normal step first
    grads[0].view(-1)[0] = float('inf')
    grads[-1].view(-1)[-1] = float('nan')
    before = [t.clone() for t in params + model + [step] + _state_tensors(state)]
    case.call(params, grads, state, model, step, torch.tensor([SCALE]), torch.ones(1), gnorm)
    after = params + model + [step] + _state_tensors(state)
    for b, a in zip(before, after):
        assert torch.equal(b, a)
    # A cleared flag (0) is the same as no flag.
    flagged = [t.clone() for t in params]
    grads = [torch.randn(p.shape, generator=gen).to(dtypes[1]) for p in params]
    state2 = {k: ([t.clone() for t in v] if isinstance(v, list) else v.clone())
              for k, v in state.items()}
    step2 = step.clone()
    case.call(params, grads, state, model, step, None, torch.zeros(1), gnorm)
    case.call(flagged, grads, state2, [], step2, None, None, gnorm)
    for a, b in zip(params, flagged):
        assert torch.equal(a, b)


def _state_tensors(state):
    out = []
    for v in state.values():
        out.extend(v if isinstance(v, list) else [v])
    return out


def test_first_skipped_step_keeps_sgd_and_novograd_first_step_semantics():
    # A skipped first step must not make the next applied step a "later" one: the momentum buffer
    # is still initialised to the gradient (some fused SGDs advance momentum on skipped steps).
    p = [torch.randn(10)]
    buf = [torch.zeros(10)]
    step = torch.zeros(1)
    g = [torch.randn(10)]
    ops.multi_tensor_sgd(p, g, buf, [], step, 0.1, 0.9, 0.5, 0.0, False, False,
                         found_inf=torch.ones(1))
    assert step.item() == 0 and torch.equal(buf[0], torch.zeros(10))
    ops.multi_tensor_sgd(p, g, buf, [], step, 0.1, 0.9, 0.5, 0.0, False, False)
    assert torch.equal(buf[0], g[0])


def test_reference_signatures_match_schema():
    # The references are the executable definition of the schemas in bindings.cpp: same names.
    import inspect
    import pathlib
    src = (pathlib.Path(reference.__file__).parents[2] / 'csrc' / 'bindings.cpp').read_text()
    for name in ('multi_tensor_adam_', 'multi_tensor_sgd_', 'multi_tensor_lamb_',
                 'multi_tensor_adagrad_', 'multi_tensor_novograd_', 'multi_tensor_adam8bit_',
                 'multi_tensor_adam8bit_lean_', 'multi_tensor_sgd8bit_',
                 'multi_tensor_sgd8bit_lean_'):
        start = src.index(f'"{name}(')
        schema = src[start:src.index('-> ()', start)]
        args = [a.strip().split()[-1].split('=')[0] for a in
                ''.join(schema.replace('"', '').split('\n')).split('(', 1)[1].rsplit(')', 1)[0]
                .split(',')]
        assert list(inspect.signature(getattr(reference, name)).parameters) == args, name


@pytest.mark.parametrize('bad, match', [
    (dict(lr=-1.0), 'learning rate'),
    (dict(beta1=1.0), 'beta parameter at index 0'),
    (dict(beta2=-0.1), 'beta parameter at index 1'),
    (dict(eps=-1e-8), 'eps'),
    (dict(weight_decay=-0.1), 'weight_decay'),
    (dict(state_dtype=torch.float16), 'float32'),
    (dict(mixed=True), 'mixes dtypes'),
    (dict(step=torch.zeros(1, dtype=torch.int64)), 'step'),
    (dict(found_inf=torch.zeros(2)), 'found_inf'),
    (dict(short_state=True), 'parallel'),
])
def test_adam_op_rejects_bad_arguments(bad, match):
    params = [torch.randn(4), torch.randn(3)]
    if bad.get('mixed'):
        params[1] = params[1].half()
    grads = [torch.randn_like(p) for p in params]
    dtype = bad.get('state_dtype', torch.float32)
    m = [torch.zeros(p.shape, dtype=dtype) for p in params]
    v = [torch.zeros(p.shape, dtype=dtype) for p in params]
    if bad.get('short_state'):
        v = v[:1]
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    hp.update({k: val for k, val in bad.items() if k in hp})
    with pytest.raises((ValueError, TypeError), match=match):
        ops.multi_tensor_adam(params, grads, m, v, [], bad.get('step', torch.zeros(1)), hp['lr'],
                              hp['beta1'], hp['beta2'], hp['eps'], hp['weight_decay'], True, True,
                              None, bad.get('found_inf'))


def test_other_ops_reject_bad_arguments():
    p, g = [torch.randn(4)], [torch.randn(4)]
    with pytest.raises(ValueError, match='nesterov'):
        ops.multi_tensor_sgd(p, g, [torch.zeros(4)], [], torch.zeros(1), 0.1, 0.0, 0.0, 0.0, True,
                             False)
    with pytest.raises(ValueError, match='momentum_buffers'):
        ops.multi_tensor_sgd(p, g, [], [], torch.zeros(1), 0.1, 0.9, 0.0, 0.0, False, False)
    with pytest.raises(ValueError, match='norm_type'):
        ops.multi_tensor_novograd(p, g, [torch.zeros(4)], torch.zeros(1), [], torch.zeros(1), 0.1,
                                  0.9, 0.9, 1e-8, 0.0, True, True, False, 1, False)
    with pytest.raises(ValueError, match='exp_avg_sq_norms'):
        ops.multi_tensor_novograd(p, g, [torch.zeros(4)], torch.zeros(2), [], torch.zeros(1), 0.1,
                                  0.9, 0.9, 1e-8, 0.0, True, True, False, 2, False)
    with pytest.raises(TypeError, match='global_grad_norm'):
        ops.multi_tensor_lamb(p, g, [torch.zeros(4)], [torch.zeros(4)], [], torch.zeros(1), 0.1,
                              0.9, 0.9, 1e-6, 0.0, True, True, True, 1.0, False, None)
    with pytest.raises(ValueError, match='max_grad_norm'):
        ops.multi_tensor_lamb(p, g, [torch.zeros(4)], [torch.zeros(4)], [], torch.zeros(1), 0.1,
                              0.9, 0.9, 1e-6, 0.0, True, True, True, -1.0, False, torch.ones(1))
    with pytest.raises(ValueError, match='eps'):
        ops.multi_tensor_adagrad(p, g, [torch.zeros(4)], [], torch.zeros(1), 0.1, -1.0, 0.0, False)
