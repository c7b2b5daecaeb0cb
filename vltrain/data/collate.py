"""Batches: captions tokenised and padded (`Collate`), noun spans as word-piece masks, to_device."""

import torch


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
    and the batch carries 'pixel_norm' (2, 3): the `norm` (mean, std) that `to_device` applies on the device."""

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
        x = torch.stack(xs)
        out = {"features" if self.use_features else "images": x, "input_ids": tok["input_ids"],
               "attention_mask": tok["attention_mask"], "keys": list(keys), "captions": list(captions)}
        if x.dtype == torch.uint8:
            if self.norm is None:
                raise ValueError("uint8 images and no normalisation to apply on the device: give Collate "
                                 "norm=(mean, std) (train_transform's .norm)")
            out["pixel_norm"] = torch.tensor(self.norm, dtype=torch.float32)
        if owner is not None:
            out["caption_owner"] = owner
        if extra:
            out["index"] = torch.tensor(extra[0], dtype=torch.long)
        if spans:
            out["noun_mask"] = span_mask(tok["offset_mapping"], torch.tensor(extra[1], dtype=torch.long))
        return out


def to_device(batch: dict, device: torch.device) -> dict:
    """The batch's tensors on `device` (non-blocking from pinned memory); other entries as they are. uint8 images
    with a 'pixel_norm' (mean, std) become float32 (x / 255 - mean) / std there, the batch without 'pixel_norm'."""
    out = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
    norm = out.pop("pixel_norm", None)
    if norm is not None and out["images"].dtype == torch.uint8:
        # torchvision's ToDtype(float32, scale=True) then Normalize, op for op: the CPU path's numbers exactly
        mean, std = norm[0].view(-1, 1, 1), norm[1].view(-1, 1, 1)
        out["images"] = out["images"].to(torch.float32).mul_(1.0 / 255).sub_(mean).div_(std)
    return out
