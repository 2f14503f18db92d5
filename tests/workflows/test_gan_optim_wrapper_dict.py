"""GANs in an ``OptimWrapperDict`` through mmengine's Runner: each wrapper touches only its own parameters.

A tiny GAN (generator with BatchNorm, discriminator) trains like mmagic's ``BaseGAN.train_step``: a
discriminator step (the generator makes the fakes under ``no_grad``), then a generator step with the
discriminator frozen. Each wrapper's ``optim_context`` gets either the submodule it trains (mmagic)
or the whole model; both must train the same, bit for bit:

* a wrapper casts only the modules whose parameters all belong to its own optimizer, and casts
  their inputs where they are called (``self.generator(noise)`` never runs the top ``forward``);
* every pair of opt levels resumes bitwise: the wrappers prepare the model before the first
  iteration (their lifecycle hook's ``before_train``, Note [wrapper lifecycle], with no hook of
  ours in the config), so the generator's forward inside the first discriminator step of a resumed
  run sees the same dtype as in an uninterrupted run. The wrappers are built either by the Runner
  from a config (through a multi-optimizer constructor, as mmagic's configs do) or by hand and
  handed to it (then they meet the runner at their first forward).
* 8-bit optimizer states (FusedSGD's momentum buffer, FusedAdam's moments) are made for each
  wrapper's own params only and resume bitwise, the config run by our tools/train.py and by a
  toolbox's train script.
"""
import itertools
from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from mmengine.model import BaseModel
from mmengine.optim import DefaultOptimWrapperConstructor, OptimWrapperDict
from mmengine.registry import DATASETS, MODELS, OPTIM_WRAPPER_CONSTRUCTORS
from mmengine.runner import Runner
from torch import nn
from torch.utils.data import Dataset

import mp_wrappers
from _workflow import load as secure_torch_load  # the weights_only loader where torch has it
from _workflow import runner_from_cfg

LEVELS = ('O0', 'O1', 'O2', 'O3')
HALF = (torch.float16, torch.bfloat16)


@DATASETS.register_module(force=True)
class _GANData(Dataset):
    """Real samples and the noise used with them (fixed per index, so a resumed run replays it)."""

    def __init__(self, n: int = 32) -> None:
        g = torch.Generator().manual_seed(1)
        self.real = torch.randn(n, 4, generator=g) * 0.5 + 1.0
        self.noise = torch.randn(n, 4, generator=g)

    def __len__(self) -> int:
        return len(self.real)

    def __getitem__(self, i):
        return dict(inputs=self.real[i], noise=self.noise[i])


def _set_requires_grad(module: nn.Module, flag: bool) -> None:
    for p in module.parameters():
        p.requires_grad_(flag)


@MODELS.register_module(force=True)
class _TinyGAN(BaseModel):
    def __init__(self, whole_model: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.generator = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(),
                                       nn.Linear(16, 4))
        self.discriminator = nn.Sequential(nn.Linear(4, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
        self.whole_model = whole_model
        self.seen = []  # dtypes of (generator input, generator output, discriminator weight)

    def forward(self, inputs, noise=None, mode='tensor'):
        return self.generator(noise)

    def train_step(self, data, optim_wrapper):
        data = self.data_preprocessor(data, True)
        real, noise = data['inputs'], data['noise']
        d_w, g_w = optim_wrapper['discriminator'], optim_wrapper['generator']
        with d_w.optim_context(self if self.whole_model else self.discriminator):
            with torch.no_grad():
                fake = self.generator(noise)
            loss_d = (F.softplus(-self.discriminator(real)).mean()
                      + F.softplus(self.discriminator(fake)).mean())
        d_w.update_params(loss_d.float())
        _set_requires_grad(self.discriminator, False)
        with g_w.optim_context(self if self.whole_model else self.generator):
            fake = self.generator(noise)
            loss_g = F.softplus(-self.discriminator(fake)).mean()
        g_w.update_params(loss_g.float())
        _set_requires_grad(self.discriminator, True)
        self.seen.append((fake.dtype, self.discriminator[0].weight.dtype))
        return dict(loss_d=loss_d.detach().float(), loss_g=loss_g.detach().float())


def _wrapper(module: nn.Module, level: str, dtype: str):
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-2, betas=(0.5, 0.9))
    return mp_wrappers.ApexOptimWrapper(optimizer=optimizer, opt_level=level, dtype=dtype,
                                        verbosity=0)


_RUNS = [0]


@OPTIM_WRAPPER_CONSTRUCTORS.register_module(force=True)
class _GANOptimWrapperConstructor:
    """mmagic's MultiOptimWrapperConstructor in small: one wrapper per named submodule."""

    def __init__(self, optim_wrapper_cfg: dict, paramwise_cfg=None) -> None:
        self.cfgs = {k: v for k, v in optim_wrapper_cfg.items() if isinstance(v, dict)}

    def __call__(self, model: nn.Module) -> OptimWrapperDict:
        model = model.module if hasattr(model, 'module') else model
        return OptimWrapperDict(**{
            name: DefaultOptimWrapperConstructor(dict(cfg))(getattr(model, name))
            for name, cfg in self.cfgs.items()})


def _wrapper_cfg(level: str, dtype: str, optimizer: Optional[dict] = None) -> dict:
    return dict(type='mp_wrappers.ApexOptimWrapper', opt_level=level, dtype=dtype, verbosity=0,
                optimizer=optimizer or dict(type='Adam', lr=1e-2, betas=(0.5, 0.9)))


def _runner(work_dir, g_level, d_level, dtype='bfloat16', whole_model=False, max_iters=4,
            resume_from=None, built_by='runner', hooks=(), optimizers=None, launcher=None):
    """``built_by='runner'``: a config's wrappers (a toolbox's way), their optimizers torch's Adam
    or ``optimizers[name]``; ``'hand'``: wrapper objects. ``launcher``: the Runner built from the
    config as that launcher does (Note [two launchers] in tests/_workflow.py); by default
    ``Runner(...)`` itself."""
    if built_by == 'hand':
        model = _TinyGAN(whole_model)
        optim_wrapper = OptimWrapperDict(
            generator=_wrapper(model.generator, g_level, dtype),
            discriminator=_wrapper(model.discriminator, d_level, dtype))
    else:
        model = dict(type='_TinyGAN', whole_model=whole_model)
        optimizers = optimizers or {}
        optim_wrapper = dict(
            constructor='_GANOptimWrapperConstructor',
            generator=_wrapper_cfg(g_level, dtype, optimizers.get('generator')),
            discriminator=_wrapper_cfg(d_level, dtype, optimizers.get('discriminator')))
    _RUNS[0] += 1
    cfg = dict(
        model=model, work_dir=str(work_dir), experiment_name=f'test_gan_{_RUNS[0]}',
        train_dataloader=dict(dataset=dict(type='_GANData'), batch_size=4, num_workers=0,
                              sampler=dict(type='DefaultSampler', shuffle=False),
                              collate_fn=dict(type='default_collate')),
        train_cfg=dict(by_epoch=False, max_iters=max_iters, val_interval=1000),
        optim_wrapper=optim_wrapper,
        default_hooks=dict(checkpoint=dict(type='CheckpointHook', interval=2, by_epoch=False),
                           logger=dict(type='LoggerHook', interval=1)),
        custom_hooks=list(hooks),
        randomness=dict(seed=0, deterministic=True),
        load_from=resume_from, resume=resume_from is not None,
        default_scope='mmengine', log_level='WARNING')
    return Runner(**cfg) if launcher is None else runner_from_cfg(cfg, launcher)


def _train(runner):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: threads only add synchronisation
    try:
        runner.train()
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(False)
    return runner


def _leaves(obj, prefix=''):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, f'{prefix}/{k}')
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _leaves(v, f'{prefix}/{i}')
    else:
        yield prefix, obj


def _differences(a: dict, b: dict):
    """Keys whose values differ (tensors bit for bit), over state_dict and optimizer state."""
    bad = []
    for part in ('state_dict', 'optimizer'):
        left, right = dict(_leaves(a[part])), dict(_leaves(b[part]))
        if left.keys() != right.keys():
            bad.append(f'{part}: keys {sorted(left.keys() ^ right.keys())}')
        for k in left.keys() & right.keys():
            x, y = left[k], right[k]
            same = (isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)) \
                if isinstance(x, torch.Tensor) else x == y
            if not same:
                bad.append(f'{part}{k}')
    return sorted(bad)


@pytest.mark.parametrize('g_level,d_level', [('O2', 'O1'), ('O1', 'O2'), ('O3', 'O0')])
def test_each_wrapper_casts_only_its_own_modules_however_the_model_is_passed(
        tmp_path, g_level, d_level):
    runs = {}
    for whole in (True, False):
        runner = _train(_runner(tmp_path / str(whole), g_level, d_level, whole_model=whole))
        model = runner.model
        for name, level in (('generator', g_level), ('discriminator', d_level)):
            module = getattr(model, name)
            for pname, p in module.named_parameters():
                in_bn = isinstance(module[int(pname.split('.')[0])], nn.BatchNorm1d)
                want = torch.bfloat16 if level in ('O2', 'O3') and not (
                    in_bn and level == 'O2') else torch.float32
                assert p.dtype == want, (whole, name, pname, p.dtype)
            wrapper = runner.optim_wrapper[name]
            has_masters = any(m is not None for row in wrapper._master_params().model_params
                              for m in row)
            assert has_masters == (level == 'O2')
        # O2/O3 cast the generator's output back to fp32 wherever it is called from; O1's
        # autocast leaves a matmul's output in bf16.
        want_fake = torch.bfloat16 if g_level == 'O1' else torch.float32
        assert {fake for fake, _ in model.seen} == {want_fake}
        runs[whole] = {k: v.clone() for k, v in model.state_dict().items()}
    for k in runs[True]:
        assert torch.equal(runs[True][k], runs[False][k]), k


def _resume(tmp_path, g_level, d_level, **kwargs):
    """An uninterrupted 4-iteration run, its last checkpoint, and that of the same run resumed
    from its iteration-2 checkpoint."""
    full = _train(_runner(tmp_path / 'full', g_level, d_level, **kwargs))
    _train(_runner(tmp_path / 'resumed', g_level, d_level,
                   resume_from=str(tmp_path / 'full' / 'iter_2.pth'), **kwargs))
    return (full, secure_torch_load(str(tmp_path / 'full' / 'iter_4.pth')),
            secure_torch_load(str(tmp_path / 'resumed' / 'iter_4.pth')))


def _resume_differences(tmp_path, g_level, d_level, **kwargs):
    return _differences(*_resume(tmp_path, g_level, d_level, **kwargs)[1:])


@pytest.mark.parametrize('g_level,d_level', list(itertools.product(LEVELS, LEVELS)))
def test_gan_resume_is_bitwise_for_every_pair_of_levels(tmp_path, g_level, d_level):
    """A toolbox's config: the Runner builds the wrappers, no hook of ours is listed."""
    assert _resume_differences(tmp_path, g_level, d_level) == []


@pytest.mark.parametrize('hooks', [(), (dict(type='mp_wrappers.MixedPrecisionHook'),)],
                         ids=['no_hook', 'MixedPrecisionHook'])
@pytest.mark.parametrize('g_level,d_level', [('O2', 'O0'), ('O3', 'O2')])
def test_gan_resume_is_bitwise_with_wrappers_built_by_hand(tmp_path, g_level, d_level, hooks):
    """Wrapper objects handed to the Runner meet it only at their first forward."""
    assert _resume_differences(tmp_path, g_level, d_level, built_by='hand', hooks=hooks) == []


def test_gan_resume_is_bitwise_with_fp16_loss_scaling(tmp_path):
    """fp16 loss scaling state (one dynamic scaler per wrapper) resumes bitwise too."""
    _train(_runner(tmp_path / 'full', 'O2', 'O1', dtype='float16'))
    _train(_runner(tmp_path / 'resumed', 'O2', 'O1', dtype='float16',
                   resume_from=str(tmp_path / 'full' / 'iter_2.pth')))
    full = secure_torch_load(str(tmp_path / 'full' / 'iter_4.pth'))
    resumed = secure_torch_load(str(tmp_path / 'resumed' / 'iter_4.pth'))
    assert _differences(full, resumed) == []
    scalers = full['optimizer']['generator']['mp_wrappers']['loss_scalers']
    assert scalers[0]['dynamic'] and scalers[0]['steps'] == 4


# 8-bit optimizer states (docs/quantized_states.md) in a GAN's wrappers: FusedSGD's momentum buffer
# for the generator, FusedAdam's moments or torch's float32 Adam for the discriminator. The
# modules are small: min_8bit_size=0 makes every param's state 8-bit.
_SGD_8BIT = dict(type='mp_wrappers.FusedSGD', lr=1e-2, momentum=0.9, weight_decay=1e-4,
                 state_dtype='int8', min_8bit_size=0)
_ADAM_8BIT = dict(type='mp_wrappers.FusedAdam', lr=1e-2, betas=(0.5, 0.9), state_dtype='int8',
                  min_8bit_size=0)
_8BIT_KEYS = {'mp_wrappers.FusedSGD': ('momentum_buffer',),
              'mp_wrappers.FusedAdam': ('exp_avg', 'exp_avg_sq')}


def _stepped(wrapper, module: nn.Module):
    """What ``wrapper``'s optimizer steps for ``module``'s params: their fp32 masters where it
    keeps them, the params themselves otherwise."""
    masters = wrapper.full_precision_weights()
    return [masters.get(id(p), p) for p in module.parameters()]


@pytest.mark.parametrize('d_level,d_optimizer', [('O1', _ADAM_8BIT), ('O0', None)],
                         ids=['FusedAdam-int8', 'Adam-float32'])
def test_gan_with_8bit_states_keeps_them_apart_and_resumes_bitwise(tmp_path, launcher, d_level,
                                                                   d_optimizer):
    """The generator's ApexOptimWrapper O2 bf16 over FusedSGD(state_dtype='int8') and the
    discriminator's over FusedAdam(state_dtype='int8') at O1, or torch's Adam at O0, under our
    tools/train.py and a toolbox's own train script. Each optimizer holds state for exactly the
    tensors it steps for its own submodule (the generator's fp32 masters and BatchNorm params, the
    discriminator's params): 8-bit codes laid out like them with a float32 absmax per block of
    256, or no 8-bit state at all for torch's Adam. A run resumed from its iteration-2 checkpoint
    saves at iteration 4 what the uninterrupted run saves, bit for bit: weights, masters, loss
    scales and both optimizers' states, the codes and absmaxes included."""
    optimizers = dict(generator=_SGD_8BIT, discriminator=d_optimizer)
    full, saved, resumed = _resume(tmp_path, 'O2', d_level, launcher=launcher,
                                   optimizers=optimizers)
    for name, optimizer in optimizers.items():
        wrapper = full.optim_wrapper[name]
        own = _stepped(wrapper, getattr(full.model, name))
        state = wrapper.optimizer.state
        assert {id(t) for t in state} == {id(t) for t in own}, name
        keys = _8BIT_KEYS[optimizer['type']] if optimizer else ()
        for t in own:
            for key in keys:
                assert state[t][key].dtype == torch.uint8 and state[t][key].shape == t.shape
                absmax = state[t][key + '_absmax']
                assert absmax.dtype == torch.float32 and absmax.numel() == -(-t.numel() // 256)
        codes = [v for st in saved['optimizer'][name]['state'].values() for v in st.values()
                 if isinstance(v, torch.Tensor) and v.dtype == torch.uint8]
        assert len(codes) == len(own) * len(keys), name
    assert _differences(saved, resumed) == []


def test_a_wrapper_owning_no_whole_module_warns_that_nothing_is_cast():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    wrapper = mp_wrappers.ApexOptimWrapper(
        optimizer=torch.optim.SGD([model[0].weight], lr=0.1), opt_level='O2', dtype='bfloat16',
        verbosity=0)
    with pytest.warns(UserWarning, match=r"found no submodule of Sequential whose parameters all "
                                         r'belong to its optimizer'):
        wrapper.initialize(model)
    assert all(p.dtype == torch.float32 for p in model.parameters())
