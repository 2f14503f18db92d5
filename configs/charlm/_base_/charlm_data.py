# Byte windows of Python's own stdlib source (no download): 10282 train / 1142 val windows of 64 bytes
# on CPython 3.11 (corpus sha256 c609f5f69aef..., printed by the dataset's repr; another Python
# version ships other source, so compare results only within one Python version).
seq_len = 64
train_dataloader = dict(
    batch_size=32,
    num_workers=0,  # indexing a tensor in memory: worker processes would only cost time
    dataset=dict(type='mp_wrappers.CharLMDataset', split='train', seq_len=seq_len),
    sampler=dict(type='InfiniteSampler', shuffle=True),
    collate_fn=dict(type='default_collate'))
val_dataloader = dict(
    batch_size=128,
    num_workers=0,
    dataset=dict(type='mp_wrappers.CharLMDataset', split='val', seq_len=seq_len),
    sampler=dict(type='DefaultSampler', shuffle=False),
    collate_fn=dict(type='default_collate'))
val_evaluator = dict(type='mp_wrappers.CharLMMetric')
