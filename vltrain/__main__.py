"""`python -m vltrain ...`, which is what `torchrun --nproc_per_node=N -m vltrain run SHARDS ...` starts."""

from vltrain.cli import main

main()
