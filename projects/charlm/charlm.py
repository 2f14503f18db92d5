"""A byte-level transformer language model trained on Python's own standard-library source.

Nothing is downloaded: the text is the source of a fixed list of pure-Python stdlib modules, found
with ``importlib.util.find_spec`` and read as bytes, so every machine with the same Python version
trains on the same bytes (:attr:`CharLMDataset.sha256` records the content hash; pass
``expected_sha256`` to insist on it). A vocabulary of the 256 byte values means no tokenizer and no
vocabulary drift between Python versions, only a different text.

* :class:`CharLMDataset` (``DATASETS``): fixed-length windows ``inputs``/``targets`` (shifted by one
  byte), train/val split per module (first 90% / last 10% of every file).
* :class:`CharTransformerLM` (``MODELS``): pre-LayerNorm GPT-style decoder with causal self-attention
  written as matmul + softmax, so precision policies act on the softmax: O1 runs it in fp32
  (apex's policy, via :func:`mp_wrappers.float_function`), O2/O3 in the half type.
* :class:`CharLMMetric` (``METRICS``): validation cross-entropy per byte (``val_ce``, nats) and bits
  per byte (``bpc``).
"""
import hashlib
import importlib.util
import math
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from mmengine.evaluator import BaseMetric
from mmengine.model import BaseModel
from torch import nn
from torch.utils.data import Dataset

from mp_wrappers.autocast import float_function
from mp_wrappers.casting import cast_model, parse_dtype
from mp_wrappers.registry import DATASETS, METRICS, MODELS

__all__ = ['CharLMDataset', 'CharTransformerLM', 'CharLMMetric', 'DEFAULT_MODULES',
           'stdlib_corpus']

# Pure-Python modules present in every CPython 3 install (~730 KB of source on 3.11). Changing this
# list changes the corpus hash.
DEFAULT_MODULES: Tuple[str, ...] = (
    'argparse', 'bisect', 'calendar', 'colorsys', 'configparser', 'copy', 'dataclasses', 'difflib',
    'enum', 'fnmatch', 'functools', 'gettext', 'glob', 'heapq', 'json.decoder', 'json.encoder',
    'json.scanner', 'operator', 'pprint', 'random', 'shlex', 'statistics', 'string', 'textwrap',
    'tokenize')
_SPLITS = ('train', 'val')
VOCAB_SIZE = 256


def stdlib_corpus(modules: Sequence[str] = DEFAULT_MODULES) -> List[bytes]:
    """The source bytes of each module, in the given order.

    Raises:
        ValueError: a module is not found or is not pure-Python source (a C extension, a frozen or
            built-in module): its bytes would not be text.
    """
    texts = []
    for name in modules:
        spec = importlib.util.find_spec(name)
        origin = getattr(spec, 'origin', None)
        if origin is None or not origin.endswith('.py'):
            raise ValueError(f'CharLMDataset: module {name!r} has no Python source file '
                             f'(origin={origin!r}); list pure-Python stdlib modules only')
        with open(origin, 'rb') as f:
            texts.append(f.read())
    return texts


@DATASETS.register_module()
class CharLMDataset(Dataset):
    """Byte windows of Python standard-library source for next-byte prediction.

    Every module's source is split at 90% (``1 - val_fraction``): the head goes to ``train``, the tail
    to ``val``; the parts are concatenated in module order and cut into non-overlapping windows of
    ``seq_len + 1`` bytes. Item ``i`` is ``{'inputs': int64 [seq_len], 'targets': int64 [seq_len]}``
    with ``targets`` the inputs shifted by one byte.

    Args:
        split: ``'train'`` or ``'val'``.
        seq_len: Context length in bytes. Defaults to 64.
        modules: The stdlib modules whose source forms the corpus. Defaults to
            :data:`DEFAULT_MODULES`.
        val_fraction: Tail fraction of each module held out for ``val``, in (0, 1). Defaults to 0.1.
        expected_sha256: If set, the SHA-256 of the whole corpus (all modules, before the split)
            must equal it, or a ``ValueError`` names both hashes (another Python version ships
            other source).

    Examples:
        >>> train_dataloader = dict(
        ...     batch_size=32,
        ...     dataset=dict(type='mp_wrappers.CharLMDataset', split='train', seq_len=64),
        ...     sampler=dict(type='InfiniteSampler', shuffle=True),
        ...     collate_fn=dict(type='default_collate'))
    """

    def __init__(self, split: str = 'train', seq_len: int = 64,
                 modules: Sequence[str] = DEFAULT_MODULES, val_fraction: float = 0.1,
                 expected_sha256: Optional[str] = None) -> None:
        if split not in _SPLITS:
            raise ValueError(f'CharLMDataset: split={split!r} is not supported; '
                             f'allowed: {", ".join(repr(s) for s in _SPLITS)}')
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f'CharLMDataset: seq_len={seq_len!r} must be a positive integer')
        if not 0.0 < float(val_fraction) < 1.0:
            raise ValueError(f'CharLMDataset: val_fraction={val_fraction!r} must be in (0, 1)')
        texts = stdlib_corpus(modules)
        corpus = b''.join(texts)
        self.sha256 = hashlib.sha256(corpus).hexdigest()
        if expected_sha256 is not None and expected_sha256 != self.sha256:
            import sys
            raise ValueError(f'CharLMDataset: the corpus hash is {self.sha256} but '
                             f'expected_sha256={expected_sha256!r}; this Python '
                             f'({sys.version.split()[0]}) ships different source for the modules')
        parts = []
        for text in texts:
            cut = int(round(len(text) * (1.0 - float(val_fraction))))
            parts.append(text[:cut] if split == 'train' else text[cut:])
        data = torch.frombuffer(bytearray(b''.join(parts)), dtype=torch.uint8).long()
        n = (len(data) - 1) // seq_len
        if n < 1:
            raise ValueError(f'CharLMDataset: the {split} split has {len(data)} bytes, fewer than '
                             f'seq_len + 1 = {seq_len + 1}')
        self.split = split
        self.seq_len = seq_len
        self.modules = tuple(modules)
        self.num_bytes = len(data)
        self._data = data[:n * seq_len + 1]
        self._n = n

    @property
    def metainfo(self) -> Dict[str, object]:
        """Plain data for checkpoints: the corpus hash and shape of the task."""
        return dict(corpus_sha256=self.sha256, vocab_size=VOCAB_SIZE, seq_len=self.seq_len)

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        if not -self._n <= index < self._n:
            raise IndexError(f'CharLMDataset index {index} out of range for {self._n} windows')
        start = (index % self._n) * self.seq_len
        chunk = self._data[start:start + self.seq_len + 1]
        return {'inputs': chunk[:-1], 'targets': chunk[1:]}

    def __repr__(self) -> str:
        return (f'{type(self).__name__}(split={self.split!r}, seq_len={self.seq_len}, '
                f'windows={self._n}, sha256={self.sha256[:12]}...)')


@float_function
def _attention_softmax(scores: torch.Tensor) -> torch.Tensor:
    # apex O1 puts softmax on its fp32 list; CPU autocast would keep it in half (see autocast.py).
    return scores.softmax(dim=-1)


class _Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, n_heads: int, max_len: int, n_layers: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)
        # GPT-2: residual projections scaled down so the residual stream's variance does not grow
        # with depth.
        for layer in (self.proj, self.out):
            nn.init.normal_(layer.weight, std=0.02 / math.sqrt(2 * n_layers))
        mask = torch.ones(max_len, max_len, dtype=torch.bool).triu(1)
        self.register_buffer('causal_mask', mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h = self.n_heads
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, h, c // h).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(c // h))
        scores = scores.masked_fill(self.causal_mask[:t, :t], float('-inf'))
        att = _attention_softmax(scores)
        y = att.to(v.dtype) @ v  # O1's fp32 probabilities meet half values, as autocast would do
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


@MODELS.register_module()
class CharTransformerLM(BaseModel):
    """A small GPT-style byte-level language model (pre-LayerNorm, causal self-attention).

    With ``dtype`` set, the model is cast in its constructor with LayerNorm kept fp32 (see
    :func:`mp_wrappers.casting.cast_model`), before mmengine wraps it in DDP, for use with
    ``FP16OptimWrapper``. With ``ApexOptimWrapper`` leave ``dtype=None``: the wrapper applies its
    opt level. The loss is computed in fp32 from fp32 logits.

    Args:
        d_model: Width of the residual stream. Defaults to 128.
        n_layers: Transformer blocks. Defaults to 3.
        n_heads: Attention heads (must divide ``d_model``). Defaults to 4.
        max_len: Longest context (the dataset's ``seq_len``). Defaults to 64.
        dtype: ``None`` (fp32), ``'float16'`` or ``'bfloat16'``.
        data_preprocessor: mmengine data preprocessor config.
        init_cfg: mmengine weight-initialisation config.

    Examples:
        >>> model = dict(type='mp_wrappers.CharTransformerLM', d_model=128, n_layers=3,
        ...              n_heads=4, max_len=64, dtype='bfloat16')
    """

    _MODES = ('tensor', 'loss', 'predict')

    def __init__(self, d_model: int = 128, n_layers: int = 3, n_heads: int = 4, max_len: int = 64,
                 dtype: Union[str, torch.dtype, None] = None,
                 data_preprocessor: Optional[dict] = None,
                 init_cfg: Optional[dict] = None) -> None:
        super().__init__(data_preprocessor=data_preprocessor, init_cfg=init_cfg)
        for name, value in (('d_model', d_model), ('n_layers', n_layers), ('n_heads', n_heads),
                            ('max_len', max_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f'CharTransformerLM: {name}={value!r} must be a positive integer')
        if d_model % n_heads:
            raise ValueError(f'CharTransformerLM: n_heads={n_heads} must divide d_model={d_model}')
        self.dtype = parse_dtype(dtype, option='CharTransformerLM(dtype)')
        self.max_len = max_len
        self.tok = nn.Embedding(VOCAB_SIZE, d_model)
        self.pos = nn.Parameter(torch.zeros(1, max_len, d_model))
        self.blocks = nn.ModuleList(_Block(d_model, n_heads, max_len, n_layers)
                                    for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB_SIZE, bias=False)
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos, std=0.02)
        nn.init.normal_(self.head.weight, std=0.02)
        if self.dtype is not None:
            cast_model(self, self.dtype, keep_norm_fp32=True)

    def forward(self, inputs: torch.Tensor, targets: Optional[torch.Tensor] = None,
                mode: str = 'tensor') -> Union[torch.Tensor, Dict[str, torch.Tensor], List[dict]]:
        """Run the model on ``inputs`` ``[N, T]`` (int64 bytes).

        Args:
            inputs: Byte ids ``[N, T]`` with ``T <= max_len`` (or a list of ``[T]`` tensors).
            targets: Next-byte ids ``[N, T]``; needed for ``'loss'`` and ``'predict'``.
            mode: ``'tensor'`` returns logits ``[N, T, 256]`` in the model dtype; ``'loss'``
                returns ``{'loss': mean cross-entropy}`` (fp32); ``'predict'`` returns one dict
                per sequence with ``nll_sum`` (fp32, nats) and ``num_tokens``.
        """
        if mode not in self._MODES:
            raise ValueError(f'CharTransformerLM.forward: mode={mode!r} is not supported; '
                             f'allowed: {", ".join(repr(m) for m in self._MODES)}')
        x = torch.stack(list(inputs)) if not isinstance(inputs, torch.Tensor) else inputs
        t = x.shape[1]
        if t > self.max_len:
            raise ValueError(f'CharTransformerLM: input length {t} exceeds max_len={self.max_len}')
        h = self.tok(x) + self.pos[:, :t]
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.ln_f(h))
        if mode == 'tensor':
            return logits
        if targets is None:
            raise ValueError(f"CharTransformerLM.forward: mode={mode!r} needs targets")
        if not isinstance(targets, torch.Tensor):
            targets = torch.stack(list(targets))
        targets = targets.to(logits.device)
        # Softmax/log in fp32: half-precision cross-entropy loses the small probabilities.
        nll = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction='none')
        if mode == 'loss':
            return {'loss': nll.mean()}
        per_seq = nll.view(targets.shape).detach().sum(dim=1)
        return [{'nll_sum': s, 'num_tokens': t} for s in per_seq]


@METRICS.register_module()
class CharLMMetric(BaseMetric):
    """Validation cross-entropy per byte (``val_ce``, nats) and bits per byte (``bpc``).

    The names avoid ``loss``: mmengine's LogProcessor prints keys containing ``loss`` as a mean over
    its window of recent values, which for a validation metric would average several evaluations.

    Args:
        collect_device: ``'cpu'`` or ``'gpu'``, where results are gathered across ranks.
        prefix: Optional prefix of the metric names.

    Examples:
        >>> val_evaluator = dict(type='mp_wrappers.CharLMMetric')
    """

    default_prefix: Optional[str] = ''

    def process(self, data_batch, data_samples: Sequence[dict]) -> None:
        """Store ``(nll_sum, num_tokens)`` per sequence as plain numbers."""
        for sample in data_samples:
            self.results.append((float(sample['nll_sum']), int(sample['num_tokens'])))

    def compute_metrics(self, results: List[tuple]) -> Dict[str, float]:
        """Token-weighted mean cross-entropy over all gathered sequences."""
        tokens = sum(n for _, n in results)
        if not tokens:
            raise ValueError('CharLMMetric: no results to evaluate (empty validation set?)')
        ce = sum(s for s, _ in results) / tokens
        return {'val_ce': ce, 'bpc': ce / math.log(2)}
