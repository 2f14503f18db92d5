"""The one per-dtype tolerance table of the test suite (STYLE rule 10).

fp32: results of the same math in a different order or precision (kernel vs reference, float32 vs a
float64 oracle). fp16/bf16: one rounding step apart (an ulp is 2**-10 and 2**-7 relative).
"""
import torch

TOL = {
    torch.float32: dict(rtol=1e-6, atol=1e-6),
    torch.float16: dict(rtol=1e-3, atol=1e-5),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-5),
}
