"""Zero-shot classification as CLIP and open_clip score it: a prompt-ensemble classifier and an image-folder benchmark.

A class's text embedding is the mean of its L2-normalised prompt embeddings (one prompt per template, the class name
in place of `{}`), normalised again (CLIP, sec. 3.1.4; open_clip's `build_zero_shot_classifier`). An image is
assigned the class of highest cosine similarity. The benchmark layout is torchvision's ImageFolder: ROOT/CLASS/*.jpg,
one folder per class, with two optional files: ROOT/classnames.txt (readable names) and ROOT/templates.txt.
"""

import os

import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from vltrain.errors import TrainError
from vltrain.losses import upcast
from vltrain.model import autocast, model_tokenizer
# the benchmark's files (no model code: the run config checks a benchmark with them); their names stay importable here
from vltrain.zsfolder import (DEFAULT_TEMPLATES, IMAGE_BYTES, TEXT_BYTES, check_templates, fill,  # noqa: F401
                              image_folder, read_image, read_templates, read_text)

TOP_CONFUSIONS = 5


@torch.no_grad()
def class_embeddings(model, names: list[str], templates, max_len: int, device, batch_size: int = 256) -> torch.Tensor:
    """(C, E): for each class, the re-normalised mean of its L2-normalised prompt embeddings over the templates."""
    tok = model_tokenizer(model)
    prompts = [fill(t, name) for name in names for t in templates]
    was_training = model.training
    model.eval()
    out = []
    for a in range(0, len(prompts), batch_size):
        enc = tok(prompts[a:a + batch_size], padding="longest", truncation=True, max_length=max_len,
                  return_tensors="pt")
        with autocast(device):
            _, emb = model.encode_text(enc["input_ids"].to(device), enc["attention_mask"].to(device))
        out.append(upcast(emb).cpu())
    model.train(was_training)
    emb = F.normalize(torch.cat(out), dim=-1).view(len(names), len(templates), -1)
    return F.normalize(emb.mean(dim=1), dim=-1)


def zeroshot_metrics(image_embeds: torch.Tensor, class_embeds: torch.Tensor, labels: torch.Tensor,
                     names: list[str]) -> dict:
    """Top-1 / top-5 accuracy, mean per-class top-1 accuracy (over the classes that have images), all in %, and the
    five most frequent (true, predicted) top-1 confusions. image_embeds (N, E), class_embeds (C, E), labels (N,).

    As retrieval ranks (vltrain.evaluate.recall_at_k): an image's rank is the number of other classes scoring at
    least as high as the true one, so a tie counts against the image and the result does not depend on sort order;
    a NaN score ranks last (a NaN image is a miss at every K below C). A missed image's predicted class is the
    highest-scoring other class (the lowest index among equals), so a tie with the true class is a confusion too;
    an image whose scores are all NaN has no prediction and is left out of the confusions.
    """
    logits = image_embeds @ class_embeds.t()
    logits = logits.masked_fill(logits.isnan(), float("-inf"))
    is_true = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, labels[:, None], True)
    true = logits.gather(1, labels[:, None])
    rank = ((logits >= true) & ~is_true).sum(dim=1)
    others = logits.masked_fill(is_true, float("-inf"))
    pred = others.argmax(dim=1)  # the class that beat or tied the true one, for a missed image
    correct = rank == 0
    per_class = [correct[labels == c].float().mean().item() for c in range(len(names)) if (labels == c).any()]
    pairs = torch.zeros(len(names), len(names), dtype=torch.long)
    wrong = ~correct & (others.amax(dim=1) > float("-inf"))  # an all-NaN row predicts nothing
    pairs.index_put_((labels[wrong], pred[wrong]), torch.ones(int(wrong.sum()), dtype=torch.long), accumulate=True)
    order = sorted(((int(n), t, p) for (t, p), n in zip(pairs.nonzero().tolist(), pairs[pairs > 0].tolist())),
                   key=lambda r: (-r[0], r[1], r[2]))
    return {"top1": round(100 * correct.float().mean().item(), 2),
            "top5": round(100 * (rank < 5).float().mean().item(), 2),
            "mean_per_class": round(100 * sum(per_class) / len(per_class), 2),
            "confusions": [{"true": names[t], "predicted": names[p], "count": n}
                           for n, t, p in order[:TOP_CONFUSIONS]]}


def chance(n_classes: int) -> dict:
    """Expected accuracy of a random guess among the classes, in %."""
    return {"top1": round(100 / n_classes, 2), "top5": round(100 * min(1.0, 5 / n_classes), 2),
            "mean_per_class": round(100 / n_classes, 2)}



class _Images(Dataset):
    """Image files -> (pixels, index), or None (counted by the caller) when a file cannot be decoded."""

    def __init__(self, files, transform):
        self.files, self.transform = files, transform

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int):
        try:
            return self.transform(read_image(self.files[i])), i
        except Exception:  # any decoder error is the file's, not ours
            return None


def _stack(batch):
    batch = [b for b in batch if b is not None]
    return (torch.stack([b[0] for b in batch]), torch.tensor([b[1] for b in batch])) if batch else None


@torch.no_grad()
def embed_images(model, files, transform, batch_size: int, workers: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """ITC embeddings (M, E) of the image files that decode, and their indices (M,) into `files`."""
    # Its own generator (the workers' base seed): a training run's evaluation must not draw from the global RNG
    loader = DataLoader(_Images(files, transform), batch_size=batch_size, num_workers=workers, collate_fn=_stack,
                        generator=torch.Generator().manual_seed(0))
    was_training = model.training
    model.eval()
    embs = []
    kept = []
    for batch in loader:
        if batch is None:
            continue
        x, idx = batch
        with autocast(device):
            _, emb = model.encode_image(x.to(device))
        embs.append(upcast(emb).cpu())
        kept.append(idx)
    model.train(was_training)
    if not embs:
        return torch.zeros(0), torch.zeros(0, dtype=torch.long)
    return torch.cat(embs), torch.cat(kept)


def score_folder(model, root, transform, templates, max_len: int, batch_size: int, workers: int, device) -> dict:
    """Zero-shot on an image-folder benchmark: top-1, top-5, mean per-class, the top confusions, and what was used."""
    bench = image_folder(root)
    templates = list(templates or bench["templates"] or DEFAULT_TEMPLATES)
    emb, kept = embed_images(model, bench["files"], transform, batch_size, workers, device)
    skipped = len(bench["files"]) - len(kept)
    if not len(kept):
        raise TrainError(f"{root}: none of the {len(bench['files'])} images could be decoded")
    classes = class_embeddings(model, bench["names"], templates, max_len, device)
    return {"benchmark": str(root), "classes": len(bench["names"]), "images": len(kept), "skipped": skipped,
            "unreadable_folders": bench["unreadable"],
            **zeroshot_metrics(emb, classes, bench["labels"][kept], bench["names"]),
            "chance": chance(len(bench["names"])), "names": bench["names"], "templates": templates}
