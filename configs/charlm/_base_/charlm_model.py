# 0.67M parameters: 3 pre-LayerNorm blocks, d_model 128, 4 heads, context 64 bytes. dtype=None: the
# ApexOptimWrapper configs let the opt level decide the model's precision.
model = dict(type='mp_wrappers.CharTransformerLM', d_model=128, n_layers=3, n_heads=4, max_len=64,
             dtype=None)
