"""Batches: captions tokenised and padded (`Collate`), noun spans as word-piece masks, to_device."""

import re

import torch

from vltrain.data.samples import JpegView, decode_on_device
from vltrain.errors import TrainError


def span_mask(offsets: torch.Tensor, spans: torch.Tensor) -> torch.Tensor:
    """Word pieces overlapping each character span: offsets (B, L, 2), spans (B, 2) -> bool (B, L).

    Special and padding tokens have empty offsets and never match.
    """
    start = spans[:, None, 0]
    end = spans[:, None, 1]
    return (offsets[..., 0] < end) & (offsets[..., 1] > start) & (offsets[..., 1] > offsets[..., 0])


class TokenLengths:
    """Captions -> their token counts as Collate tokenises them (with [CLS] / [SEP], cut at max_len); a class, not a
    closure, so that a DataLoader worker started by spawn can receive it."""

    def __init__(self, tokenizer, max_len: int):
        self.tokenizer, self.max_len = tokenizer, max_len

    def __call__(self, captions: list[str]) -> list[int]:
        if not captions:
            return []
        ids = self.tokenizer(captions, truncation=True, max_length=self.max_len)["input_ids"]
        return [len(x) for x in ids]


class Collate:
    """Batch of (x, caption, key[, position[, span]]) -> {'images' | 'features', 'input_ids', 'attention_mask',
    'keys', 'captions'[, 'index'[, 'noun_mask']]}; noun_mask (B, L) marks the word pieces of each span.

    Samples loaded with every caption (a tuple each, for evaluation) give one row of input_ids per caption and
    'caption_owner' (T,): the batch position of each caption's image. uint8 images (train_transform's) stay uint8,
    and the batch carries 'pixel_norm' (2, 3): the `norm` (mean, std) that `to_device` applies on the device.

    JpegViews (data.decode gpu) travel as 'jpeg' (`pack_jpegs`), 'images' then holding only the samples decoded on
    the worker (m, 3, S, S); `to_device` decodes the rest and puts every view back in its batch position."""

    def __init__(self, tokenizer, max_len: int, use_features: bool = False, norm: tuple | None = None):
        self.tokenizer, self.max_len, self.use_features, self.norm = tokenizer, max_len, use_features, norm

    def __call__(self, batch: list[tuple | None]) -> dict | None:
        batch = [b for b in batch if b is not None]  # undecodable samples (counted where they were read)
        if not batch:
            return None
        xs, captions, keys, *extra = zip(*batch)
        owner = None
        if isinstance(captions[0], tuple):  # every caption of each sample
            owner = torch.tensor([i for i, caps in enumerate(captions) for _ in caps], dtype=torch.long)
            captions = [c for caps in captions for c in caps]
        spans = len(extra) > 1
        extra_args = {"return_offsets_mapping": True} if spans else {}  # fast tokenizers only: triplets need it
        tok = self.tokenizer(list(captions), padding="longest", truncation=True, max_length=self.max_len,
                             return_tensors="pt", **extra_args)
        jpeg = None
        if any(isinstance(x, JpegView) for x in xs):
            jpeg, xs = pack_jpegs(xs)
        x = torch.stack(xs) if xs else torch.empty((0, 3, jpeg["size"], jpeg["size"]), dtype=torch.uint8)
        out = {"features" if self.use_features else "images": x, "input_ids": tok["input_ids"],
               "attention_mask": tok["attention_mask"], "keys": list(keys), "captions": list(captions)}
        if x.dtype == torch.uint8:
            if self.norm is None:
                raise ValueError("uint8 images and no normalisation to apply on the device: give Collate "
                                 "norm=(mean, std) (train_transform's .norm)")
            out["pixel_norm"] = torch.tensor(self.norm, dtype=torch.float32)
        if jpeg is not None:
            out["jpeg"] = jpeg
        if owner is not None:
            out["caption_owner"] = owner
        if extra:
            out["index"] = torch.tensor(extra[0], dtype=torch.long)
        if spans:
            out["noun_mask"] = span_mask(tok["offset_mapping"], torch.tensor(extra[1], dtype=torch.long))
        return out


def pack_jpegs(xs) -> tuple[dict, list[torch.Tensor]]:
    """A batch's views, JpegViews among uint8 tensors -> ({'data': [bytes (N,) uint8], 'box': (n, 4), 'flip': (n,),
    'at': (n,) their batch positions, 'size', 'interpolation'}, the tensors decoded on the worker, in order)."""
    shipped = [(i, x) for i, x in enumerate(xs) if isinstance(x, JpegView)]
    first = shipped[0][1]
    jpeg = {"data": [x.data for _, x in shipped], "box": torch.tensor([x.box for _, x in shipped], dtype=torch.long),
            "flip": torch.tensor([x.flip for _, x in shipped], dtype=torch.bool),
            "at": torch.tensor([i for i, _ in shipped], dtype=torch.long),
            "size": first.size, "interpolation": first.interpolation}
    return jpeg, [x for x in xs if not isinstance(x, JpegView)]


def device_views(jpeg: dict, decoded: torch.Tensor, keys, device: torch.device) -> torch.Tensor:
    """The batch's uint8 views (B, 3, S, S) on `device`: the shipped JPEGs decoded there (`decode_on_device`) and
    the worker's `decoded` (m, 3, S, S, on `device`), each at its batch position. A JPEG that does not decode is a
    one-line TrainError naming its sample: the batch left the loader, so it can no longer be skipped and counted."""
    try:
        shipped = decode_on_device(jpeg["data"], jpeg["box"], jpeg["flip"], jpeg["size"], jpeg["interpolation"],
                                   device)
    except RuntimeError:
        for i, data in zip(jpeg["at"].tolist(), jpeg["data"]):  # which one: the batch decode names none
            try:
                decode_on_device([data], jpeg["box"][:1], jpeg["flip"][:1], jpeg["size"], jpeg["interpolation"],
                                 device)
            except RuntimeError as e:
                # torchvision's text is "decode_jpeg, FILE.cpp:LINE, the reason": the reason only
                why = re.sub(r"^[\w.]+, \S+:\d+, ", "", (str(e).strip().splitlines() or [type(e).__name__])[0])
                raise TrainError(f"sample {keys[i]}: its JPEG does not decode on {device} ({why}); data.decode=gpu "
                                 "cannot skip it once batched: re-create the shards with `vlprep shards "
                                 "--decode-check`, or train with data.decode=cpu, which skips and counts such "
                                 "samples") from None
        raise
    n = len(jpeg["data"]) + len(decoded)
    out = torch.empty((n, 3, jpeg["size"], jpeg["size"]), dtype=torch.uint8, device=device)
    on_worker = torch.ones(n, dtype=torch.bool)
    on_worker[jpeg["at"]] = False
    out[jpeg["at"].to(device)] = shipped
    out[on_worker.nonzero().squeeze(1).to(device)] = decoded
    return out


def bucket_length(longest: int, max_len: int, buckets: int) -> int:
    """The caption length a batch whose longest caption has `longest` tokens is padded to: the smallest of the
    `buckets` lengths ceil(max_len / buckets) * k (k = 1..buckets, the last cut to max_len) that holds it."""
    step = -(-max_len // buckets)
    return min(max_len, -(-max(longest, 1) // step) * step)


def pad_captions(batch: dict, length: int, pad_id: int) -> dict:
    """The batch with its captions padded on the right to `length` tokens: input_ids with `pad_id`, attention_mask
    and noun_mask (TOnICS) with 0 / False, the padding masked out as Collate's own is; other entries as they are."""
    n = length - batch["input_ids"].shape[1]
    if n <= 0:
        return batch
    out = dict(batch)
    out["input_ids"] = torch.nn.functional.pad(batch["input_ids"], (0, n), value=pad_id)
    out["attention_mask"] = torch.nn.functional.pad(batch["attention_mask"], (0, n), value=0)
    if "noun_mask" in batch:
        out["noun_mask"] = torch.nn.functional.pad(batch["noun_mask"], (0, n), value=False)
    return out


def to_device(batch: dict, device: torch.device) -> dict:
    """The batch's tensors on `device` (non-blocking from pinned memory); other entries as they are. uint8 images
    with a 'pixel_norm' (mean, std) become float32 (x / 255 - mean) / std there, the batch without 'pixel_norm'.
    A 'jpeg' entry (data.decode gpu) is decoded there first (`device_views`); the batch leaves without it."""
    out = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items() if k != "jpeg"}
    if "jpeg" in batch:
        out["images"] = device_views(batch["jpeg"], out["images"], batch["keys"], device)
    norm = out.pop("pixel_norm", None)
    if norm is not None and out["images"].dtype == torch.uint8:
        # torchvision's ToDtype(float32, scale=True) then Normalize, op for op: the CPU path's numbers exactly
        mean, std = norm[0].view(-1, 1, 1), norm[1].view(-1, 1, 1)
        out["images"] = out["images"].to(torch.float32).mul_(1.0 / 255).sub_(mean).div_(std)
    return out
