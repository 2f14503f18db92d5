# dtype=None trains in fp32; the half-precision configs override it. The model casts itself in its
# constructor, before mmengine wraps it in DDP (a cast after wrapping silently stops grad all-reduce).
model = dict(type='mp_wrappers.DigitsCNN', num_classes=10, width=32, dtype=None)
