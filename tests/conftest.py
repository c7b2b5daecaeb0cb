import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image


def image_bytes(w: int = 48, h: int = 32, fmt: str = "PNG", seed: int = 0, mode: str = "RGB") -> bytes:
    """A small random image encoded as `fmt`."""
    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 255, size=(h, w, len(mode)), dtype=np.uint8)
    im = Image.fromarray(arr[..., 0] if mode == "L" else arr, mode)
    buf = io.BytesIO()
    im.save(buf, format=fmt)
    return buf.getvalue()


@pytest.fixture
def image_folder(tmp_path: Path) -> Path:
    """12 images (png and jpg) with captions in a nested folder."""
    root = tmp_path / "imgs"
    (root / "sub").mkdir(parents=True)
    for i in range(12):
        fmt, ext = ("JPEG", "jpg") if i % 3 == 0 else ("PNG", "png")
        d = root / "sub" if i % 2 else root
        (d / f"img{i:02d}.{ext}").write_bytes(image_bytes(40 + i, 30 + i, fmt, seed=i))
        (d / f"img{i:02d}.txt").write_text(f"a picture  of thing {i}\n")
    return root
