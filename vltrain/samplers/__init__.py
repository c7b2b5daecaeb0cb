"""Index-based batch samplers: the TOnICS ontology curriculum and GRIT grouped mini-batches.

Both feed a DataLoader `batch_sampler` with lists of *positions* into the training instances (samples, or
triplets in TOnICS' triplet mode); `vltrain.data.indexed.InstanceView` turns a position into a sample read through wids.
A sampler's order depends only on (seed, epoch, its state), and its state goes into checkpoints.

The samplers, one module per paper: vltrain.samplers.tonics and vltrain.samplers.grit. The trainer builds them from
its config in vltrain.trainset (`index_data`).
"""

from vltrain.samplers.grit import GritSampler, grit_order, grit_orders
from vltrain.samplers.tonics import TonicsBatchSampler, TonicsCurriculum, default_ontology, tonics_instances

__all__ = ["TonicsCurriculum", "TonicsBatchSampler", "tonics_instances", "default_ontology", "grit_order",
           "grit_orders", "GritSampler"]
