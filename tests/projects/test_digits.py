"""DigitsDataset, DigitsCNN and DigitsAccuracy: splits, casting, loss precision, metric arithmetic."""
import pytest
import torch
from mmengine.dataset import default_collate, pseudo_collate

from mp_wrappers.registry import DATASETS, METRICS, MODELS
from projects.digits import DigitsAccuracy, DigitsCNN, DigitsDataset

DTYPES = {None: torch.float32, 'float16': torch.float16, 'bfloat16': torch.bfloat16}


@pytest.fixture(scope='module')
def splits():
    return DigitsDataset('train'), DigitsDataset('val')


def test_split_sizes_disjoint_and_complete(splits):
    train, val = splits
    assert (len(train), len(val)) == (1437, 360)
    assert set(train.indices.tolist()).isdisjoint(val.indices.tolist())
    assert len(train) + len(val) == 1797


def test_split_is_stratified(splits):
    train, val = splits
    train_counts = torch.bincount(train.labels, minlength=10).float()
    val_counts = torch.bincount(val.labels, minlength=10).float()
    ratio = val_counts / (train_counts + val_counts)
    assert torch.all((ratio - 0.2).abs() < 0.02), ratio


def test_split_is_deterministic_and_seeded(splits):
    train, _ = splits
    again = DigitsDataset('train')
    assert torch.equal(train.images, again.images) and torch.equal(train.labels, again.labels)
    other = DigitsDataset('train', split_seed=1)
    assert not torch.equal(train.labels, other.labels)


def test_item_format_and_normalisation(splits):
    train, val = splits
    item = train[0]
    assert item['inputs'].shape == (1, 8, 8) and item['inputs'].dtype == torch.float32
    assert item['labels'].dtype == torch.int64 and item['labels'].dim() == 0
    assert abs(train.images.mean().item()) < 1e-4 and abs(train.images.std().item() - 1) < 1e-3
    # Both splits use the training split's statistics.
    assert (train.mean, train.std) == (val.mean, val.std)
    assert train.metainfo['classes'] == tuple('0123456789')


@pytest.mark.parametrize('kwargs, option', [(dict(split='test'), "split='test'"),
                                            (dict(val_fraction=1.5), 'val_fraction=1.5')])
def test_bad_arguments_name_option_and_value(kwargs, option):
    with pytest.raises(ValueError, match=option.replace('(', r'\(')):
        DigitsDataset(**kwargs)


def test_registered_under_scope():
    assert DATASETS.get('DigitsDataset') is DigitsDataset
    assert MODELS.get('DigitsCNN') is DigitsCNN
    assert METRICS.get('DigitsAccuracy') is DigitsAccuracy
    from mmengine.registry import MODELS as ROOT_MODELS
    assert ROOT_MODELS.get('mp_wrappers.DigitsCNN') is DigitsCNN


@pytest.mark.parametrize('dtype', list(DTYPES))
def test_model_cast_and_fp32_loss(splits, dtype):
    torch.manual_seed(0)
    model = DigitsCNN(dtype=dtype)
    half = DTYPES[dtype]
    conv, bn = model.features[0], model.features[1]
    assert conv.weight.dtype == half and model.head.weight.dtype == half
    assert bn.weight.dtype == torch.float32 and bn.running_mean.dtype == torch.float32
    batch = default_collate([splits[0][i] for i in range(16)])
    logits = model(**batch, mode='tensor')
    assert logits.shape == (16, 10) and logits.dtype == half
    loss = model(**batch, mode='loss')['loss']
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()
    assert conv.weight.grad.dtype == half and bn.weight.grad.dtype == torch.float32
    preds = model(**batch, mode='predict')
    assert len(preds) == 16 and preds[0]['scores'].dtype == torch.float32
    assert int(preds[0]['gt_label']) == int(batch['labels'][0])


def test_model_accepts_pseudo_collate_and_data_preprocessor(splits):
    model = DigitsCNN()
    batch = pseudo_collate([splits[0][i] for i in range(4)])
    data = model.data_preprocessor(batch, True)
    assert model(**data, mode='loss')['loss'].dim() == 0


def test_model_bad_arguments():
    with pytest.raises(ValueError, match="dtype.*'int8'"):
        DigitsCNN(dtype='int8')
    with pytest.raises(ValueError, match="mode='train'"):
        DigitsCNN()(torch.zeros(1, 1, 8, 8), mode='train')
    with pytest.raises(ValueError, match='needs labels'):
        DigitsCNN()(torch.zeros(1, 1, 8, 8), mode='loss')


def test_metric_on_hand_made_batch():
    metric = DigitsAccuracy()
    # 3 of 4 right, ground truth carried in the predictions.
    metric.process({}, [{'pred_label': torch.tensor(p), 'gt_label': torch.tensor(g)}
                        for p, g in [(1, 1), (2, 2), (3, 0), (4, 4)]])
    # 1 of 2 right, ground truth taken from the data batch.
    metric.process({'labels': torch.tensor([5, 6])},
                   [{'pred_label': torch.tensor(5)}, {'pred_label': torch.tensor(7)}])
    assert metric.evaluate(size=6) == {'accuracy': pytest.approx(100 * 4 / 6)}


def test_metric_without_ground_truth_raises():
    with pytest.raises(KeyError, match='gt_label'):
        DigitsAccuracy().process({}, [{'pred_label': torch.tensor(1)}])
