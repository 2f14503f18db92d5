"""New 8-bit Adam moments exactly halfway between two codes, for the kernels' tie tests (Note [ties
away from zero] in mp_wrappers/ops/reference/quant.py): random data almost never ties.

With beta1 = 0.5 and a block absmax that stays MAX (one MAX code per block, its grad MAX too), the
decode factor is 1 and m_new = (code value + g) / 2 exactly. Per 8 elements: normal codes tying
up in magnitude, positive and negative; subnormal ones at 2.5 and 0.5 code steps; a value just
below half a step, which rounds down.
"""
import torch

SUBNORMAL_STEP = 2.0 ** -17  # exp_avg's (E4M3, bias 15) subnormal code step with absmax = MAX
MAX = 1.875


def tie_moments(n, max_at):
    """(exp_avg codes, grads, the codes the update must write) for ``n`` elements, MAX at the
    indices ``max_at`` (one per block)."""
    step = SUBNORMAL_STEP
    codes = torch.full((n,), 0x78, dtype=torch.uint8)  # 1.0
    codes[1::8] = 0x79  # 1.125
    codes[2::8] = 0xF8  # -1.0
    codes[4::8] = codes[5::8] = codes[6::8] = 0  # 0.0
    codes[max_at] = 0x7F  # MAX: the absmax, decode factor 1
    g = torch.full((n,), 1.125)  # m_new = 1.0625, between 1.0 and 1.125: up
    g[1::8] = 1.25  # 1.1875, between 1.125 and 1.25: up
    g[2::8] = -1.125  # -1.0625: up in magnitude
    g[4::8] = 5 * step  # 2.5 steps: code 3
    g[5::8] = step  # half a step: code 1
    g[6::8] = (1 - 2.0 ** -24) * step  # just below half a step: code 0
    g[max_at] = MAX  # the absmax stays MAX
    want = torch.full((n,), 0x79, dtype=torch.uint8)
    want[1::8], want[2::8], want[4::8], want[5::8], want[6::8] = 0x7A, 0xF9, 3, 1, 0
    want[max_at] = 0x7F
    return codes, g, want
