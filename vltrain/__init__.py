"""vltrain: a compact trainer for vision-language alignment on vlprep shards (ITC, ITM, MLM, curricula).

`vltrain.load(path)` gives a trained model as a Python object (vltrain.api, docs/API.md)."""

from vltrain.errors import TrainError  # noqa: F401 (`from vltrain import TrainError` keeps working)

__version__ = "0.1.0"


def load(path, device: str = "auto"):
    """A trained model from a `vltrain run` checkpoint or a `vltrain export` folder: `vltrain.api.Model`, with
    encode_images, encode_texts, zero_shot, match and the eval `transform` (docs/API.md). Imported on first use, so
    that `import vltrain` stays cheap."""
    from vltrain.api import load as load_model

    return load_model(path, device)
