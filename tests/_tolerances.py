"""The one per-dtype tolerance table of the test suite (docs/semantics.md section 10).

TOL: results of the same math in a different order or precision (kernel vs reference, float32 vs a
float64 oracle); fp16/bf16 entries are one rounding step apart (an ulp is 2**-10 and 2**-7 relative).
TRAIN_TOL: a model trained for a few steps in half precision against its fp32 twin: parameters drift
by the half type's rounding at every step, so the bound is looser than one op's.
KAHAN_TOL: the fp32 value a lean 'kahan' weight stands for (bf16 weight + bf16 compensation), kernel
against reference: the compensation is rounded to bf16, so a one-ulp difference in the fp32 update
can move it by one of its own ulps, up to 2**-16 of the weight.
"""
import torch

TOL = {
    torch.float64: dict(rtol=1e-12, atol=1e-12),
    torch.float32: dict(rtol=1e-6, atol=1e-6),
    torch.float16: dict(rtol=1e-3, atol=1e-5),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-5),
}

TRAIN_TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-6),
    # bf16: 20 SGD steps (momentum 0.9) of a small CNN drift by up to 0.035-0.060 in some element
    # against fp32, over 6 seeds, whether the masters start from the rounded or the exact fp32
    # weights (measured 2026-11-23): 5e-2 sat inside that spread.
    torch.bfloat16: dict(rtol=5e-2, atol=7e-2),
    torch.float16: dict(rtol=1e-2, atol=1e-2),
}

# torch's CPU sqrt (the references') is not correctly rounded: on an AMD EPYC (Zen 4, torch 2.13,
# AVX512 dispatch) 16% of fp32 inputs came out one ulp off the float64 oracle (measured 2026-11-24),
# and 12-20 of 65K compensations differed from the kernel's by 1-8 of their ulps after 3 Adam steps:
# at most 1.3e-5 of the weight. 2**-15 is one flip at the weight's own scale, carried one step on.
KAHAN_TOL = dict(rtol=2.0 ** -15, atol=1e-6)
