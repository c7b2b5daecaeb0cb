"""vltrain's error types, in a module of their own so that every module can import them without importing the
package's __init__ (which offers `vltrain.load`, and so imports the modules that import this)."""

from vlprep import cut


class TrainError(RuntimeError):
    """A run that cannot go on (non-finite loss, nothing to resume, too little data); the message is one line."""


class PeerFailed(TrainError):
    """Under torchrun: this process stopped because another one failed; that one's error is the line to read."""


class CheckpointError(ValueError):
    """A file that is not a vltrain checkpoint or export, or one that does not fit the model or the run; one line."""


def check_version(found, reads: int, name: str, where, path) -> None:
    """A file's format version is one this vltrain reads (an int from 1 to `reads`); one-line CheckpointError
    otherwise. `name` is what the version counts ("checkpoint format", "export version"), `where` the file it came
    from and `path` what the user gave."""
    if not isinstance(found, int) or isinstance(found, bool) or found < 1:
        raise CheckpointError(f"{where}: {name} {cut(repr(found))} is not a version this vltrain reads (it reads {reads})")
    if found > reads:
        raise CheckpointError(f"{path}: written by a newer vltrain ({name} {found}, this version reads {reads})")
