"""vlprep: turn image-caption collections into WebDataset shards and derive datasets from them."""

__version__ = "0.1.0"


class VlprepError(Exception):
    """A user mistake (bad path, missing column, bad option): the CLI prints it as one line."""
