# sklearn's bundled 8x8 digits: 1437 train / 360 val images, stratified, fixed split.
# default_collate batches the per-sample dicts into {'inputs': [N, 1, 8, 8], 'labels': [N]}.
train_dataloader = dict(
    batch_size=32,
    num_workers=0,  # the whole dataset is a 460 KB tensor; worker processes would only cost time
    dataset=dict(type='mp_wrappers.DigitsDataset', split='train'),
    sampler=dict(type='DefaultSampler', shuffle=True),
    collate_fn=dict(type='default_collate'))
val_dataloader = dict(
    batch_size=120,
    num_workers=0,
    dataset=dict(type='mp_wrappers.DigitsDataset', split='val'),
    sampler=dict(type='DefaultSampler', shuffle=False),
    collate_fn=dict(type='default_collate'))
val_evaluator = dict(type='mp_wrappers.DigitsAccuracy')
