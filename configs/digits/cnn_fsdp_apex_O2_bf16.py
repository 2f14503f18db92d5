# FSDP1 through mmengine's FlexibleRunner, ApexOptimWrapper O2 bf16, on CPU (gloo) or GPU (nccl):
#   torchrun --nproc_per_node 2 tools/train.py configs/digits/cnn_fsdp_apex_O2_bf16.py --launcher pytorch
# The model stays fp32 and is sharded; FSDP's mixed precision (param_dtype=bfloat16, filled in by the
# strategy from opt_level/dtype) makes the bf16 copies for forward and backward, and the fp32 shards
# are the master weights FusedAdam steps: one fp32 copy of each weight in the whole job. The overflow
# flag and the clip_grad norm are global across ranks; accumulation skips the reduce-scatter (no_sync).
# See docs/distributed.md.
_base_ = ['./_base_/digits_data.py', './_base_/cnn_model.py', './_base_/schedule_20e.py',
          './_base_/default_runtime.py']
runner_type = 'FlexibleRunner'
strategy = dict(
    type='mp_wrappers.MixedPrecisionFSDPStrategy',
    # use_orig_params=True (mmengine's default): the optimizer sees every original parameter (its
    # local 1-D shard), so param-wise options and FSDP's optimizer state dicts keep parameter names.
    model_wrapper=dict(use_orig_params=True),
    # 'full': rank 0 saves one ordinary checkpoint (fp32 weights, optimizer state and our wrapper
    # state), loadable on any number of ranks and by mp_wrappers' weights_only loader. 'local': each
    # rank writes its own shards (rank{i}.pth of torch ShardedTensors, no gathering: less memory on
    # rank 0), which resume bitwise on the same number of ranks only (docs/distributed.md).
    state_dict_cfg='full')
optim_wrapper = dict(
    _delete_=True,
    type='mp_wrappers.ApexOptimWrapper', opt_level='O2', dtype='bfloat16',
    optimizer=dict(type='mp_wrappers.FusedAdam', lr=2e-3, weight_decay=1e-4),
    clip_grad=dict(max_norm=5.0))
