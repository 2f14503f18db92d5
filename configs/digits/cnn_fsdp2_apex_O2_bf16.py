# FSDP2 (torch.distributed.fsdp.fully_shard) under mmengine's Runner, ApexOptimWrapper O2 bf16:
#   torchrun --nproc_per_node 2 tools/train.py configs/digits/cnn_fsdp2_apex_O2_bf16.py --launcher pytorch
# mp_wrappers.FullyShardedModel shards every layer and the root with MixedPrecisionPolicy(
# param_dtype=bfloat16, reduce_dtype=float32); BatchNorm keeps fp32 weights. Parameters, gradients and
# Adam moments are DTensor shards; FusedAdam steps the local shards, the fp32 shards are the masters.
# See docs/distributed.md.
_base_ = ['./_base_/digits_data.py', './_base_/cnn_model.py', './_base_/schedule_20e.py',
          './_base_/default_runtime.py']
# FullyShardedRunner: mmengine's Runner minus its init-and-broadcast of the weights, which
# FullyShardedModel does before sharding (a broadcast cannot take DTensors).
runner_type = 'mp_wrappers.FullyShardedRunner'
model_wrapper_cfg = dict(type='mp_wrappers.FullyShardedModel', dtype='bfloat16')
optim_wrapper = dict(
    _delete_=True,
    type='mp_wrappers.ApexOptimWrapper', opt_level='O2', dtype='bfloat16',
    optimizer=dict(type='mp_wrappers.FusedAdam', lr=2e-3, weight_decay=1e-4),
    clip_grad=dict(max_norm=5.0))
# Checkpoints: FullyShardedRunner writes them from every rank as torch.distributed.checkpoint
# directories (epoch_N.pth/, each rank's shards); `--resume` continues bitwise on the same rank count
# and re-slices for another; tools/consolidate_checkpoint.py makes one ordinary file of the weights.
