"""vltrain's error types, in a module of their own so that every module can import them without importing the
package's __init__ (which offers `vltrain.load`, and so imports the modules that import this)."""


class TrainError(RuntimeError):
    """A run that cannot go on (non-finite loss, nothing to resume, too little data); the message is one line."""


class PeerFailed(TrainError):
    """Under torchrun: this process stopped because another one failed; that one's error is the line to read."""


class CheckpointError(ValueError):
    """A file that is not a vltrain checkpoint or export, or one that does not fit the model or the run; one line."""
