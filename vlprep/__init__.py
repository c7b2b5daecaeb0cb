"""vlprep: turn image-caption collections into WebDataset shards and derive datasets from them."""

import functools

__version__ = "0.1.0"

MIN_SIZE = 32  # every trunk here downsamples by 32: smaller images give no token grid
MAX_SIZE = 1024  # 32 x 32 = 1,024 tokens an image; --size 100000 would allocate 120 GB for one probe image


def versions() -> dict[str, str | None]:
    """What made an output: this project's version and the installed torch and transformers (None: not installed).
    meta.json and vltrain checkpoints record it; `vlprep --version` and `vltrain --version` print it."""
    return dict(_versions())


@functools.cache  # reading a package's metadata parses its METADATA file (1-2 ms for torch's); it cannot change
def _versions() -> tuple[tuple[str, str | None], ...]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"vlprep-vltrain": __version__}
    for name in ("torch", "transformers"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return tuple(out.items())


def version_line(prog: str) -> str:
    """`prog 0.1.0 (torch 2.15.0, transformers 5.23.0)`."""
    v = versions()
    return f"{prog} {__version__} (torch {v['torch']}, transformers {v['transformers']})"


def cut(text: str, limit: int = 80) -> str:
    """`text` cut to `limit` characters with an ellipsis: an error message never quotes a whole (possibly huge) value.
    Both CLIs and vltrain's errors use it."""
    return text if len(text) <= limit else text[:limit - 1] + "…"


class VlprepError(Exception):
    """A user mistake (bad path, missing column, bad option): the CLI prints it as one line."""
