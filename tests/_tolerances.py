"""The one tolerance table of the test suite, per dtype (STYLE rule 10)."""
import torch

TOL = {
    torch.float64: dict(rtol=1e-12, atol=1e-12),
    torch.float32: dict(rtol=1e-6, atol=1e-6),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
}

# A model trained for a few steps in half precision against its fp32 twin: parameters drift by the
# half type's rounding at every step, so the bound is looser than one op's.
TRAIN_TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-6),
    torch.bfloat16: dict(rtol=5e-2, atol=5e-2),
    torch.float16: dict(rtol=1e-2, atol=1e-2),
}
