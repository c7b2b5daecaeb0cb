"""vltrain: a compact trainer for vision-language alignment on vlprep shards (ITC, ITM, MLM, curricula)."""

__version__ = "0.1.0"
