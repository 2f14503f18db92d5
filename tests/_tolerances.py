"""The one per-dtype tolerance table of the test suite (STYLE rule 10).

TOL: results of the same math in a different order or precision (kernel vs reference, float32 vs a
float64 oracle); fp16/bf16 entries are one rounding step apart (an ulp is 2**-10 and 2**-7 relative).
TRAIN_TOL: a model trained for a few steps in half precision against its fp32 twin: parameters drift
by the half type's rounding at every step, so the bound is looser than one op's.
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
