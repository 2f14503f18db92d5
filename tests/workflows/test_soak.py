"""Long-run stability (slow): 20,000 steps of ApexOptimWrapper O2 fp16 on a tiny model.

Run it with:  python -m pytest -m slow tests/workflows/test_soak.py -s

Checks that the resident memory (RSS) stops growing after warm-up (no per-step leak in the scalers,
the gradient stash, the fused step or the MessageHub publication) and that the dynamic loss scale
stays within [min_loss_scale, max_loss_scale] while it backs off from injected overflows (one every
997 steps) and grows back. Prints the duration, steps/s and the RSS figures.
"""
import os
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mp_wrappers
from mp_wrappers import ApexOptimWrapper

STEPS = 20_000
WARMUP = 2_000
RSS_GROWTH_LIMIT = 2**20  # bytes allowed after warm-up: allocator noise, not a per-step leak
MIN_SCALE, MAX_SCALE = 2.**4, 2.**20


def _rss() -> int:
    with open('/proc/self/statm') as f:
        return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')


@pytest.mark.slow
@pytest.mark.filterwarnings('ignore:ApexOptimWrapper.*without native fp16:UserWarning')
def test_soak_o2_fp16_20000_steps():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        # fp16 matmuls are ~100x slower than fp32 on this CPU: keep the model tiny.
        model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 4))
        wrapper = ApexOptimWrapper(mp_wrappers.FusedAdam(model.parameters(), lr=1e-3),
                                   opt_level='O2', dtype='float16', verbosity=0, scale_window=200,
                                   min_loss_scale=MIN_SCALE, max_loss_scale=MAX_SCALE,
                                   init_scale=2.**16)
        data = [(torch.randn(16, 8), torch.randn(16, 4)) for _ in range(64)]
        scales, rss = [], {}
        start = time.perf_counter()
        for step in range(STEPS):
            x, y = data[step % len(data)]
            with wrapper.optim_context(model):
                loss = F.mse_loss(model(x).float(), y)
            handle = None
            if step % 997 == 996:
                handle = model[0].weight.register_hook(lambda g: g * float('inf'))
            wrapper.update_params(loss)
            if handle is not None:
                handle.remove()
                assert wrapper.last_step_skipped
            if step % 100 == 0:
                scales.append(wrapper.loss_scale)
            if step % 1000 == 999:
                # Without a Runner the amp_* scalars are published every step, and mmengine's
                # HistoryBuffer keeps up to 10**6 values per key by design (~1.3 MiB over this run,
                # measured): mmengine's log history, not state of ours. Drop it so the RSS shows ours.
                wrapper.message_hub._log_scalars.clear()
            if step + 1 in (WARMUP, STEPS // 2, STEPS):
                rss[step + 1] = _rss()
        elapsed = time.perf_counter() - start
        skipped = wrapper.loss_scalers[0].skipped_steps
        growth = rss[STEPS] - rss[WARMUP]
        print(f'\nsoak: {STEPS} steps of O2 fp16 in {elapsed:.1f} s ({STEPS / elapsed:.0f} steps/s); '
              f'RSS {rss[WARMUP] / 2**20:.1f} MiB after {WARMUP} steps, '
              f'{rss[STEPS // 2] / 2**20:.1f} MiB at {STEPS // 2}, {rss[STEPS] / 2**20:.1f} MiB at '
              f'the end (growth {growth / 2**10:.0f} KiB); {skipped} skipped steps; scale range '
              f'[{min(scales)}, {max(scales)}]')
        assert growth <= RSS_GROWTH_LIMIT, growth
        assert all(MIN_SCALE <= s <= MAX_SCALE for s in scales), (min(scales), max(scales))
        # Every injected overflow was skipped; the rest are the scaler's own probes: it grows every
        # 200 clean steps until fp16 overflows naturally, then halves (apex's behaviour).
        assert STEPS // 997 <= skipped <= STEPS // 100, skipped
        assert max(scales) > min(scales) and scales[-1] >= min(scales)
        assert all(torch.isfinite(p).all() for p in wrapper.master_params())
    finally:
        torch.set_num_threads(threads)
