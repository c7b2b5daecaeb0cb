"""vltrain: a compact trainer for vision-language alignment on vlprep shards (ITC, ITM, MLM, curricula)."""

__version__ = "0.1.0"


class TrainError(RuntimeError):
    """A run that cannot go on (non-finite loss, nothing to resume, too little data); the message is one line."""
