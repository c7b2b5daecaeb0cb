"""Training data: `shards` lists dataset folders and splits them by key hash, `samples` decodes one
sample, `stream` streams shards (ShardStream), `indexed` reads samples by index for the index samplers
(IndexedShards, InstanceView), `collate` makes batches, and `feed` hands the training loop its batches,
epoch after epoch."""
