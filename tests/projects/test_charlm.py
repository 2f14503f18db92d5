"""The byte-level language model workload: corpus determinism, every opt level, a short Runner run."""
import math
import os

import pytest
import torch
from mmengine.config import Config
from mmengine.runner import Runner

from mp_wrappers import ApexOptimWrapper, FP16OptimWrapper
from projects.charlm import CharLMDataset, CharLMMetric, CharTransformerLM, stdlib_corpus

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = dict(d_model=32, n_layers=1, n_heads=2, max_len=16)


@pytest.fixture(scope='module')
def train_set():
    return CharLMDataset('train', seq_len=16)


def test_dataset_is_deterministic(train_set):
    again = CharLMDataset('train', seq_len=16)
    assert again.sha256 == train_set.sha256 and len(again) == len(train_set)
    for i in (0, 7, len(train_set) - 1):
        assert torch.equal(again[i]['inputs'], train_set[i]['inputs'])
    item = train_set[3]
    assert item['inputs'].dtype == torch.int64 and item['inputs'].shape == (16,)
    # targets are the next bytes: window i+1 starts where window i's targets end
    assert torch.equal(item['targets'][:-1], item['inputs'][1:])
    assert item['targets'][-1] == train_set[4]['inputs'][0]
    val = CharLMDataset('val', seq_len=16)
    assert val.sha256 == train_set.sha256
    total = sum(len(t) for t in stdlib_corpus())
    assert train_set.num_bytes + val.num_bytes == total
    assert 0.08 < val.num_bytes / total < 0.12
    assert train_set.metainfo['corpus_sha256'] == train_set.sha256


def test_dataset_errors(train_set):
    with pytest.raises(ValueError, match="split='test' is not supported"):
        CharLMDataset('test')
    with pytest.raises(ValueError, match='expected_sha256=.0000'):
        CharLMDataset('val', expected_sha256='0000')
    assert CharLMDataset('val', seq_len=16, expected_sha256=train_set.sha256).sha256
    with pytest.raises(ValueError, match="module 'sys' has no Python source"):
        CharLMDataset('val', modules=['sys'])
    with pytest.raises(IndexError):
        train_set[len(train_set)]


def _batch(ds, n=8):
    return (torch.stack([ds[i]['inputs'] for i in range(n)]),
            torch.stack([ds[i]['targets'] for i in range(n)]))


def test_model_modes_and_metric(train_set):
    model = CharTransformerLM(**SMALL)
    x, t = _batch(train_set)
    assert model(x).shape == (8, 16, 256)
    loss = model(x, t, mode='loss')['loss']
    assert loss.dtype == torch.float32 and abs(loss.item() - math.log(256)) < 0.3  # ~uniform at init
    preds = model(x, t, mode='predict')
    metric = CharLMMetric()
    metric.process({}, preds)
    out = metric.compute_metrics(metric.results)
    assert out['val_ce'] == pytest.approx(loss.item(), rel=1e-5)
    assert out['bpc'] == pytest.approx(loss.item() / math.log(2), rel=1e-5)
    with pytest.raises(ValueError, match='exceeds max_len=16'):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match='n_heads=3 must divide d_model=32'):
        CharTransformerLM(d_model=32, n_heads=3)


def test_dtype_option_keeps_layernorm_fp32(train_set):
    model = CharTransformerLM(**SMALL, dtype='bfloat16')
    assert model.blocks[0].qkv.weight.dtype == torch.bfloat16
    assert model.ln_f.weight.dtype == torch.float32 and model.blocks[0].ln1.bias.dtype == torch.float32
    x, t = _batch(train_set)
    assert model(x).dtype == torch.bfloat16
    wrapper = FP16OptimWrapper(torch.optim.AdamW(model.parameters(), lr=3e-3))
    losses = []
    for _ in range(5):
        with wrapper.optim_context(model):
            loss = model(x, t, mode='loss')['loss']
        wrapper.update_params(loss)
        losses.append(loss.item())
    assert losses[-1] < losses[0]


@pytest.mark.filterwarnings('ignore:ApexOptimWrapper.*dtype=float16 on a CPU')
@pytest.mark.parametrize('level', ['O0', 'O1', 'O2', 'O3'])
@pytest.mark.parametrize('dtype', ['bfloat16', 'float16'])
def test_every_opt_level_trains(train_set, level, dtype):
    model = CharTransformerLM(**SMALL)
    # Pure fp16 (O3, no masters) steps Adam on fp16 state: eps=1e-8 rounds to 0 in fp16 and the
    # never-used embedding rows get 0/0 = nan. apex O3 had the same trap; eps must be >= ~6e-8.
    eps = 1e-4 if (level, dtype) == ('O3', 'float16') else 1e-8
    wrapper = ApexOptimWrapper(torch.optim.AdamW(model.parameters(), lr=3e-3, eps=eps),
                               opt_level=level,
                               dtype=dtype, verbosity=0)
    # fp16 matmuls are ~100x slower on this CPU: keep the fp16 batch tiny.
    x, t = _batch(train_set, 8 if dtype == 'bfloat16' else 2)
    losses = []
    for _ in range(4):
        with wrapper.optim_context(model):
            loss = model(x, t, mode='loss')['loss']
        wrapper.update_params(loss)
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    half = getattr(torch, dtype)
    expect = {'O0': torch.float32, 'O1': torch.float32, 'O2': half, 'O3': half}[level]
    assert model.blocks[0].qkv.weight.dtype == expect
    # O2 keeps LayerNorm fp32 (keep_batchnorm_fp32 covers norm layers); O3 casts everything.
    ln = {'O2': torch.float32, 'O3': half}.get(level, torch.float32)
    assert model.ln_f.weight.dtype == ln


def test_short_runner_run(tmp_path):
    cfg = Config.fromfile(os.path.join(REPO, 'configs', 'charlm', 'lm_apex_O1_bf16.py'))
    cfg.model.update(d_model=32, n_layers=1, n_heads=2)
    cfg.train_cfg = dict(type='IterBasedTrainLoop', max_iters=6, val_interval=6)
    cfg.val_dataloader.dataset.update(modules=['textwrap'])  # a small validation set
    cfg.default_hooks.logger.interval = 3
    cfg.default_hooks.checkpoint = dict(type='CheckpointHook', interval=100)
    cfg.param_scheduler = None
    cfg.work_dir = str(tmp_path)
    cfg.experiment_name = 'test_charlm_runner'
    threads = torch.get_num_threads()
    try:
        runner = Runner.from_cfg(cfg)
        runner.train()
    finally:
        torch.set_num_threads(threads)
    (log,) = tmp_path.glob('*/*.log')
    text = log.read_text()
    assert 'Iter(train) [6/6]' in text and 'amp_scale: 1.0000' in text
    assert 'val_ce:' in text and 'bpc:' in text
