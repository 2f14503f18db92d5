# DDP, ApexOptimWrapper O2 bf16: every rank holds the whole model, its fp32 masters and the optimizer
# state; gradients are all-reduced. On CPU or GPU:
#   torchrun --nproc_per_node 2 tools/train.py configs/digits/cnn_ddp_apex_O2_bf16.py --launcher pytorch
# The model must be cast *before* DDP wraps it (casting afterwards silently stops gradient all-reduce):
# the line below does it; tools/train.py would add it by itself for O2/O3. See docs/distributed.md.
_base_ = ['./cnn_apex_O2_bf16.py']
model_wrapper_cfg = dict(
    type='mp_wrappers.MixedPrecisionDistributedDataParallel', dtype='bfloat16',
    keep_batchnorm_fp32=True, broadcast_buffers=False)
