"""VLModel.pixel_tokens: a features-trained model given pixels (vltrain.api, `vltrain eval`) runs the recorded frozen
encoder as `vlprep features` runs it, so its tokens are the cached tokens' bytes, not only equal to float16 rounding.

The re-derivation is the stage itself: `vlprep features` over the same pixel dataset (the fixture of
tests/vlprep/test_embed_tokens.py: 10 samples, a random MobileNetV3-Small at 64 px, float16 tokens), whose npy
members the model's tokens must equal bit for bit, whatever the batch (10 images: calls of 4, 4 and a padded 2).
"""

import io

import numpy as np
import pytest
import torch

from tests.vlprep.test_embed_tokens import world  # noqa: F401  (the module's fixture)
from vlprep.dataset import iter_samples
from vlprep.embed import decode

pytestmark = pytest.mark.slow  # the fixture's features run and checkpoints take about 5 s on 2 cores


def test_pixel_tokens_are_the_cached_tokens_bit_for_bit(world):  # noqa: F811
    import vltrain

    model = vltrain.load(world["ckpt"], device="cpu")
    stored = {s["__key__"]: np.load(io.BytesIO(s["npy"])) for s in iter_samples(world["feat"], decode=False)}
    raws = list(iter_samples(world["pix"], decode=False))
    want = np.stack([stored[r["__key__"]] for r in raws])
    assert want.dtype == np.float16 and len(raws) == 10
    px = model.pixels([decode(r)[0] for r in raws])  # the eval transform a user's pixels go through
    threads = torch.get_num_threads()
    model.net.pixel_tokens(px[:1])  # builds the frozen encoder
    calls = []  # each encoder call's batch and intra-op threads: the stage's fixed shape of 4, on one thread
    model.net._pixel_encoder.register_forward_pre_hook(lambda m, a: calls.append((len(a[0]), torch.get_num_threads())))
    for rows in (slice(0, 10), slice(3, 10), slice(0, 1)):
        calls.clear()
        got = model.net.pixel_tokens(px[rows])
        assert got.dtype == torch.float32 and np.array_equal(got.numpy().astype(np.float16), want[rows])
        n = len(range(10)[rows])
        assert calls == [(4, 1)] * -(-n // 4)
    assert torch.get_num_threads() == threads  # the one-thread calls give the caller's count back
    with torch.autocast("cpu", dtype=torch.bfloat16):  # an evaluation's autocast leaves the frozen encoder float32
        got = model.net.pixel_tokens(px)
    assert np.array_equal(got.numpy().astype(np.float16), want)
