"""Retrieval R@K as the papers score it (every caption of every image, optional ITM re-rank of the ITC top-k) and
`vltrain eval`, which also runs zero-shot classification (vltrain.zeroshot); docs/EVALUATION.md.

Metrics are pure functions of score matrices; `embed_split`, `view_scores` and `evaluate_checkpoint` run a model
over shards to get them (the training loop's periodic checks use the first two).
"""

import dataclasses
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from rich.console import Console
from torch.utils.data import DataLoader

from vlprep import cut
from vlprep.urls import redact
from vltrain.api import load, pixel_transform
from vltrain.config import DataConfig
from vltrain.data.collate import Collate, to_device
from vltrain.data.indexed import IndexedShards, InstanceView
from vltrain.data.samples import ALL
from vltrain.data.shards import SAME_ENCODER, data_signature, feature_input, first_held_out
from vltrain.data.stream import ShardStream
from vltrain.errors import TrainError
from vltrain.layers import noun_states
from vltrain.losses import upcast
from vltrain.model import autocast, model_tokenizer

console = Console(stderr=True, emoji=False, soft_wrap=True)

KS = (1, 5, 10)


PROTOCOL = ("multi-caption retrieval: image→text R@K counts an image when any of its captions is among its K "
            "best-scored captions, text→image R@K ranks the images for every caption; a wrong candidate scoring as "
            "high as the right one ranks above it")


def checked_txt2img(txt2img, n_img: int, n_txt: int) -> torch.Tensor:
    """txt2img as a long tensor; a one-line ValueError unless it gives every caption an image and every image a
    caption."""
    txt2img = torch.as_tensor(txt2img, dtype=torch.long)
    if txt2img.shape != (n_txt,) or (n_txt and not 0 <= int(txt2img.min()) <= int(txt2img.max()) < n_img):
        raise ValueError(f"txt2img must give each of the {n_txt} captions an image index below {n_img}")
    if (torch.bincount(txt2img, minlength=n_img) == 0).any():
        raise ValueError("every image needs at least one caption for image→text recall")
    return txt2img


def recalls(rank_i2t: torch.Tensor, rank_t2i: torch.Tensor, ks=KS) -> dict[str, float]:
    """R@K in % from each query's rank (the wrong candidates above its best right one), and the six recalls' mean."""
    out = {}
    for k in ks:
        out[f"i2t_r{k}"] = round(100 * (rank_i2t < k).double().mean().item(), 2)
        out[f"t2i_r{k}"] = round(100 * (rank_t2i < k).double().mean().item(), 2)
    out["mean_recall"] = round(sum(out.values()) / len(out), 2)
    return out


def recall_at_k(sim: torch.Tensor, txt2img, ks=KS) -> dict[str, float]:
    """sim (N_img, N_txt), txt2img (N_txt,) image index of each caption -> i2t / t2i R@K in % and their mean.

    The Karpathy-split protocol of ALBEF's evaluation (COCO 5K / Flickr30K 1K test, 5 captions per image): an image
    hits at K when any of its captions is among its K best-scored captions; a caption hits when its image is among
    its K best-scored images. The mean is the six recalls' mean (rsum / 6). A rank is the number of wrong candidates
    scoring at least as high as the best right one, so a tie counts against the query and the result never depends on
    sort order; a NaN score ranks last. With one caption per image this is the usual one-positive R@K.
    """
    n_img, n_txt = sim.shape
    txt2img = checked_txt2img(txt2img, n_img, n_txt)
    sim = sim.masked_fill(sim.isnan(), float("-inf"))
    cols = torch.arange(n_txt)
    positive = torch.zeros(n_img, n_txt, dtype=torch.bool)
    positive[txt2img, cols] = True
    best = sim.masked_fill(~positive, float("-inf")).amax(dim=1)  # the best-scored caption of each image
    rank_i2t = ((sim >= best[:, None]) & ~positive).sum(dim=1)
    rank_t2i = (sim >= sim[txt2img, cols][None, :]).sum(dim=0) - 1  # minus the caption's own image
    return recalls(rank_i2t, rank_t2i, ks)


BLOCK = 4096  # blocked_recall's block side: a (BLOCK, BLOCK) float32 score block is 64 MiB


def blocked_recall(img: torch.Tensor, txt: torch.Tensor, txt2img, ks=KS, block: int = BLOCK) -> dict:
    """recall_at_k(img @ txt.T, txt2img) without the (N_img, N_txt) matrix: the scores are computed a
    (block, block) tile at a time, twice, so memory is bounded by one tile whatever N (a held-out set of 100K images
    would need 40 GB at once). The first pass finds each image's best-scored caption and each caption's own
    image score; the second counts, per query, the wrong candidates scoring at least as high (recall_at_k's rank:
    ties count against the query, NaN ranks last). Both passes compute each tile by the same call, so a candidate
    and the positive it is compared with come from the same arithmetic; on a matrix that fits one tile the result
    equals recall_at_k's exactly."""
    n_img, n_txt = img.shape[0], txt.shape[0]
    txt2img = checked_txt2img(txt2img, n_img, n_txt)
    ninf = float("-inf")

    def tiles():
        for a in range(0, n_img, block):
            for b in range(0, n_txt, block):
                tile = img[a:a + block] @ txt[b:b + block].t()
                rows = torch.arange(a, a + tile.shape[0])[:, None]
                positive = txt2img[b:b + tile.shape[1]][None, :] == rows  # (rows, cols): caption of that image
                yield a, b, tile.masked_fill(tile.isnan(), ninf), positive

    best = torch.full((n_img,), ninf, dtype=img.dtype)  # each image's best-scored caption
    own = torch.empty(n_txt, dtype=img.dtype)  # each caption's score with its image
    for a, b, tile, positive in tiles():
        best[a:a + tile.shape[0]] = torch.maximum(best[a:a + tile.shape[0]],
                                                  tile.masked_fill(~positive, ninf).amax(dim=1))
        hit = positive.any(dim=0)
        cols = hit.nonzero().flatten()
        own[b + cols] = tile[positive[:, cols].int().argmax(dim=0), cols]
    rank_i2t = torch.zeros(n_img, dtype=torch.long)
    rank_t2i = torch.full((n_txt,), -1, dtype=torch.long)  # minus the caption's own image
    for a, b, tile, positive in tiles():
        rank_i2t[a:a + tile.shape[0]] += ((tile >= best[a:a + tile.shape[0], None]) & ~positive).sum(dim=1)
        rank_t2i[b:b + tile.shape[1]] += (tile >= own[None, b:b + tile.shape[1]]).sum(dim=0)
    return recalls(rank_i2t, rank_t2i, ks)


def chance_recall(n_img: int, n_txt: int, ks=KS, captions_per_image=None) -> dict[str, float]:
    """Expected R@K of a random ranking, for the table beside the results.

    Text→image has one right image among n_img: K / n_img. Image→text with c right captions among n_txt misses when
    all K drawn are wrong: 1 - C(n_txt - c, K) / C(n_txt, K), averaged over the images (c = 1 when not given)."""
    counts = [1] * n_img if captions_per_image is None else [int(c) for c in captions_per_image]

    def hit(c: int, k: int) -> float:
        miss = 1.0
        for t in range(min(k, n_txt)):
            miss *= max(0, n_txt - c - t) / (n_txt - t)
        return 1.0 - miss

    return {**{f"i2t_r{k}": round(100 * sum(hit(c, k) for c in counts) / len(counts), 2) for k in ks},
            **{f"t2i_r{k}": round(100 * min(1.0, k / n_img), 2) for k in ks}}


def itm_rerank(sim: torch.Tensor, k: int, itm_score: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
               batch: int = 256) -> tuple:
    """ALBEF's re-rank: each query's ITC top-k candidates are scored by the ITM match logit, the others get -100.

    As ALBEF's retrieval code (Retrieval.py) and the papers that follow it (SoftMask++ app. C, GRIT-VLP supp. sec. 3)
    describe it: the top-k are ranked by ITM alone (BLIP's code adds the ITC similarity; we do not).
    itm_score(image_idx (M,), text_idx (M,)) -> (M,) match logits, called with at most `batch` pairs at a time; a
    pair in the top-k of both directions is scored once. k is capped at the number of candidates of each direction.
    Returns (sim_i2t, sim_t2i), both (N_img, N_txt).
    """
    n_img, n_txt = sim.shape
    top_txt = sim.topk(min(k, n_txt), dim=1).indices  # (N_img, k) captions of each image
    top_img = sim.topk(min(k, n_img), dim=0).indices  # (k, N_txt) images of each caption
    i2t_pairs = (torch.arange(n_img)[:, None] * n_txt + top_txt).flatten()
    t2i_pairs = (top_img * n_txt + torch.arange(n_txt)[None, :]).flatten()
    pairs, where = torch.cat([i2t_pairs, t2i_pairs]).unique(return_inverse=True)
    match = torch.empty(len(pairs), dtype=sim.dtype)
    for a in range(0, len(pairs), batch):
        p = pairs[a:a + batch]
        match[a:a + batch] = itm_score(p // n_txt, p % n_txt).to(sim.dtype)
    out = []
    for idx, pos in ((i2t_pairs, where[:len(i2t_pairs)]), (t2i_pairs, where[len(i2t_pairs):])):
        scores = torch.full((n_img * n_txt,), -100.0, dtype=sim.dtype)
        scores[idx] = match[pos]
        out.append(scores.view(n_img, n_txt))
    return out[0], out[1]


def rerank_recall(sim_i2t: torch.Tensor, sim_t2i: torch.Tensor, txt2img, ks=KS) -> dict[str, float]:
    """R@K when the two directions are ranked by different score matrices (after itm_rerank)."""
    a = recall_at_k(sim_i2t, txt2img, ks)
    b = recall_at_k(sim_t2i, txt2img, ks)
    out = {**{k: v for k, v in a.items() if k.startswith("i2t")}, **{k: v for k, v in b.items() if k.startswith("t2i")}}
    out["mean_recall"] = round(sum(out.values()) / len(out), 2)
    return out


# --- running a model over shards ----------------------------------------------------------------------------------


def reads_features(model, folders) -> bool:
    """Whether to feed `folders` to `model` as cached tokens (True) or as pixels (False); ValueError if neither."""
    spec = feature_input(folders, "auto") if model.cfg.image_model == "features" else None
    own = model.cfg.feature_encoder
    if spec is not None and (not own or all(spec.get(k) == own.get(k) for k in SAME_ENCODER)):
        return True
    if model.image_mean is None:
        raise ValueError("this model reads feature tokens and " + ("the data's were made by another encoder"
                         if spec is not None else "the data has none") + "; it has no record of its encoder to "
                         "run on pixels")
    return False


@torch.no_grad()
def embed_split(model, folders, split: str, data: DataConfig, batch_size: int, device: torch.device,
                use_features: bool, keep_fusion: bool = False, limit: int = 0) -> dict:
    """ITC embeddings of a split in shard order, every caption of every image (multi-caption samples included); the
    split, captions, pixels and loader as `data` says (val_frac, max_len, image_size, workers, skip_bad_shards);
    `limit` > 0 takes the split's first `limit` samples in shard order (vltrain.data.shards.first_held_out), reading
    only the shards that hold them.

    Returns {'n': images, 'img' (N, E), 'txt' (T, E), 'txt2img' (T,) the image of each caption, 'keys' (N images),
    'captions' (T), 'ids'/'mask' (T, max_len), 'read': samples read, 'skipped': {'count', 'reasons'} the bad samples
    left out (LoadCounts.skipped)}; keep_fusion adds what ITM needs without re-encoding: the image
    tokens 'tokens' (N, n, D) and the text encoder's states 'hidden' (T, max_len, D).
    """
    tok = model_tokenizer(model)
    max_len = data.max_len
    tf = None if use_features else pixel_transform(model, data.image_size)
    subset = first_held_out(folders, data.val_frac, limit) if limit > 0 and split == "val" else None
    stream = ShardStream(folders, split, data.val_frac, tf, shuffle=False, use_features=use_features, captions=ALL,
                         skip_bad_shards=data.skip_bad_shards, subset=subset)
    # Its own generator: evaluation must not draw from the global RNG, or a resumed run would diverge.
    loader = DataLoader(stream, batch_size=batch_size, collate_fn=Collate(tok, max_len, use_features),
                        num_workers=data.workers, generator=torch.Generator().manual_seed(0))
    was_training = model.training
    model.eval()
    out = {k: [] for k in ("img", "txt", "txt2img", "ids", "mask", "tokens", "hidden")}
    keys = []
    captions = []
    n = 0
    for batch in loader:
        if batch is None:  # every sample undecodable (skipped and counted by the reader)
            continue
        batch = to_device(batch, device)
        x = batch["features"] if use_features else batch["images"]
        with autocast(device):
            tokens, img = model.encode_image(x)
            hidden, txt = model.encode_text(batch["input_ids"], batch["attention_mask"])
        out["img"].append(upcast(img).cpu())
        out["txt"].append(upcast(txt).cpu())
        out["txt2img"].append(batch["caption_owner"].cpu() + n)
        pad = max_len - batch["input_ids"].shape[1]
        out["ids"].append(F.pad(batch["input_ids"].cpu(), (0, pad), value=tok.pad_token_id or 0))
        out["mask"].append(F.pad(batch["attention_mask"].cpu(), (0, pad), value=0))
        if keep_fusion:  # ITM re-ranking fuses these pairwise: encoding each image once, not once per pair
            out["tokens"].append(upcast(tokens).cpu())
            out["hidden"].append(F.pad(upcast(hidden).cpu(), (0, 0, 0, pad)))
        keys.extend(batch["keys"])
        captions.extend(batch["captions"])
        n += len(img)
    model.train(was_training)
    seen = {"read": stream.counts.totals()[0], "skipped": stream.counts.skipped(), "io": stream.counts.io_totals()}
    if not n:
        return {"n": 0, **seen}
    return {"n": n, "keys": keys, "captions": captions, **seen, **{k: torch.cat(v) for k, v in out.items() if v}}


def drop_images(emb: dict, keys: set) -> dict:
    """`embed_split`'s embeddings without the images whose key is in `keys`, and without those images' captions."""
    keep = torch.tensor([k not in keys for k in emb["keys"]], dtype=torch.bool)
    if bool(keep.all()):
        return emb
    new_index = torch.cumsum(keep.long(), 0) - 1  # an old image index -> its index among the kept images
    txt2img = torch.as_tensor(emb["txt2img"])
    rows = keep[txt2img]
    out = {**emb, "n": int(keep.sum()), "img": emb["img"][keep], "txt": emb["txt"][rows],
           "txt2img": new_index[txt2img[rows]], "keys": [k for k, m in zip(emb["keys"], keep.tolist()) if m],
           "captions": [c for c, m in zip(emb["captions"], rows.tolist()) if m]}
    for name in ("ids", "mask", "hidden"):
        if name in emb:
            out[name] = emb[name][rows]
    if "tokens" in emb:
        out["tokens"] = emb["tokens"][keep]
    return out


def distinct_positions(view: InstanceView, limit: int, seed: int) -> np.ndarray:
    """Up to `limit` positions of a view in a seeded random order, one per image (retrieval needs one positive)."""
    order = np.random.default_rng([seed, 99]).permutation(len(view))
    _, first = np.unique(view.samples[order], return_index=True)
    return order[np.sort(first)][:limit]


@torch.no_grad()
def view_scores(model, view: InstanceView, positions, collate: Collate, batch_size: int, triplets: bool,
                device) -> torch.Tensor:
    """Scores (n, n) of query text i against image j: the aligner's s(i, j) in triplet mode, ITC similarity otherwise."""
    was_training = model.training
    model.eval()
    nouns = []
    tokens = []
    txt = []
    img = []
    bs = batch_size
    for a in range(0, len(positions), bs):
        batch = collate(view.__getitems__([int(p) for p in positions[a:a + bs]]))  # read in shard order
        if batch is None:  # undecodable samples drop out of both sides, so row i still matches column i
            continue
        batch = to_device(batch, device)
        with autocast(device):
            tok, i_feat = model.encode_image(batch["features"] if view.use_features else batch["images"])
            hidden, t_feat = model.encode_text(batch["input_ids"], batch["attention_mask"])
        if triplets:
            nouns.append(upcast(noun_states(hidden, batch["noun_mask"])))
            tokens.append(upcast(tok))
        else:
            txt.append(upcast(t_feat))
            img.append(upcast(i_feat))
    if triplets:
        nouns = torch.cat(nouns)
        tokens = torch.cat(tokens)
        scores = torch.cat([model.align_scores(nouns[a:a + bs], tokens) for a in range(0, len(nouns), bs)])
    else:
        scores = torch.cat(txt) @ torch.cat(img).t()
    model.train(was_training)
    return upcast(scores).cpu()


# --- `vltrain eval` -----------------------------------------------------------------------------------------------


def _class_label(caption: str, patterns: list[re.Pattern]) -> int | None:
    """Index of the longest class name found as whole words in the caption (case-insensitive), else None."""
    hits = [(len(p.pattern), i) for i, p in enumerate(patterns) if p.search(caption)]
    return max(hits)[1] if hits else None


def check_eval_args(path: Path, shards) -> None:
    """Catch `vltrain eval DATA CKPT` (arguments swapped) with a line that says which argument is wrong."""
    for s in map(Path, shards):
        if s.is_file() and s.suffix in (".pt", ".pth"):
            raise TrainError(f"{s} is a checkpoint file, not a shard folder: the checkpoint comes first "
                             "(vltrain eval CHECKPOINT SHARDS...)")
    # another folder is an export, or load's one-line error; a URL (a str) is fetchckpt's to check
    if isinstance(path, Path) and path.is_dir() and (path / "sizes.json").exists():
        raise TrainError(f"CHECKPOINT {path} is a folder, not a checkpoint file (the checkpoint comes first: "
                         "vltrain eval CHECKPOINT SHARDS...)")


def _itm_scorer(model, emb: dict, dev) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """itm_score(image_idx, text_idx) for itm_rerank: the fusion encoder on cached image tokens and text states.

    itm_rerank hands the pairs over sorted by image, so a chunk of pairs reads few distinct images: each is sent to
    the device, projected (image_to_text) and turned into every fusion layer's cross-attention keys and values once,
    and read by its pairs through fuse's image_rows, instead of once per pair."""

    def itm_score(img_idx: torch.Tensor, txt_idx: torch.Tensor) -> torch.Tensor:
        mask = emb["mask"][txt_idx]
        length = int(mask.sum(dim=1).max())  # no fusion FLOPs on padding beyond the chunk's longest caption
        images, rows = img_idx.unique(return_inverse=True)
        with autocast(dev):
            fused = model.fuse(emb["hidden"][txt_idx, :length].to(dev), mask[:, :length].to(dev),
                               emb["tokens"][images].to(dev), image_rows=rows.to(dev))
            return upcast(model.itm_logits(fused)[:, 1]).float().cpu()

    return itm_score


@torch.no_grad()
def evaluate_checkpoint(path, shards=(), zeroshot=None, itm_rerank_k: int = 0, device: str = "auto",
                        zeroshot_folder=None, templates=None, skip_bad_shards: bool = False) -> dict:
    """Retrieval R@1/5/10 over ALL images and captions of `shards` (optionally ITM re-ranked over the ITC top-k) and
    zero-shot classification (docs/EVALUATION.md).

    Retrieval follows the multi-caption protocol of `recall_at_k`. Zero-shot scores an image-folder benchmark
    (`zeroshot_folder`, vltrain.zeroshot) or, with `zeroshot` (a file of class names, one per line), the images of
    `shards` labelled by the class whose name appears as whole words in their first caption (the longest such name
    when several do; images whose caption names no class are skipped and counted in `zeroshot.skipped`). Classes are
    embedded as prompt ensembles: `templates` (a file, or a list of templates), else ROOT/templates.txt, else CLIP's
    7 ImageNet templates.
    A model trained on `vlprep features` tokens reads the shards' tokens when the same encoder made them, and
    otherwise (and for image folders) runs that frozen encoder on the pixels first. `skip_bad_shards` leaves out a
    shard cut short or, at a URL, unreadable after the retries (counted in `shards_skipped`), instead of stopping.
    `path` may be the URL of a checkpoint file: downloaded once, removed after (vltrain.fetchckpt), recorded redacted.
    """
    from vltrain.zeroshot import DEFAULT_TEMPLATES, read_templates, score_folder

    from vltrain.fetchckpt import is_url, local_checkpoint

    remote = is_url(path)
    shards = [str(s) for s in shards or ()]
    path = path if remote else Path(path)
    check_eval_args(path, shards)
    if zeroshot is not None and zeroshot_folder is not None:
        raise TrainError("give --zeroshot (class names found in captions) or --zeroshot-folder, not both")
    if zeroshot is not None and not shards:
        raise TrainError("--zeroshot labels the images of SHARDS by their captions: give shard folders too")
    if not shards and zeroshot_folder is None:
        raise TrainError("nothing to evaluate: give shard folders (retrieval) and/or --zeroshot-folder ROOT")
    if itm_rerank_k < 0:
        raise TrainError("--itm-rerank-k must be 0 (off) or a positive number of candidates")
    tmpl = list(templates) if isinstance(templates, (list, tuple)) else (
        read_templates(templates) if templates is not None else None)  # before the model: a bad file is quick
    if remote:  # downloaded once (the arguments checked first), scored as a local file, recorded redacted
        with local_checkpoint(path) as local:
            result = evaluate_checkpoint(local, shards, zeroshot, itm_rerank_k, device, zeroshot_folder,
                                         tmpl, skip_bad_shards)
        return {**result, "checkpoint": redact(path)}
    loaded = load(path, device)
    model = loaded.net
    cfg = loaded.config
    dev = loaded.device
    if cfg.data.triplets:
        return _evaluate_triplets(model, cfg, shards, dev, path, loaded.step,
                                  zeroshot is not None or zeroshot_folder is not None or itm_rerank_k > 0)
    # the recorded data.workers, at most one per CPU: a crafted config.json's 100000 would fork 100000 processes
    workers = min(max(cfg.data.workers, 0), os.cpu_count() or 1)
    result = {"checkpoint": str(path), "step": loaded.step}
    if shards:
        scores, emb = _retrieval(model, cfg, shards, itm_rerank_k, workers, dev, skip_bad_shards)
        result.update(scores)
        if zeroshot is not None:
            result["zeroshot"] = _zeroshot_by_caption(model, cfg, Path(zeroshot), emb,
                                                      tmpl or list(DEFAULT_TEMPLATES), dev)
    if zeroshot_folder is not None:
        result["zeroshot"] = score_folder(model, zeroshot_folder, pixel_transform(model, cfg.data.image_size), tmpl,
                                          cfg.data.max_len, cfg.batch_size, workers, dev)
    return result


def _retrieval(model, cfg, shards: list[str], itm_rerank_k: int, workers: int, dev,
               skip_bad_shards: bool = False) -> tuple[dict, dict]:
    """The retrieval part of `vltrain eval`, and the embeddings (embed_split's) for caption-labelled zero-shot."""
    # val_frac 0 puts every sample in the "train" split: `vltrain eval` scores all samples of SHARDS.
    use_features = reads_features(model, shards)
    data = dataclasses.replace(cfg.data, val_frac=0.0, workers=workers, skip_bad_shards=skip_bad_shards)
    emb = embed_split(model, shards, "train", data, cfg.batch_size, dev, use_features, keep_fusion=itm_rerank_k > 0)
    n = emb["n"]
    if emb["skipped"]["count"]:
        console.print(f"warning: {skipped_note(emb['skipped'], emb['read'])}: not scored", highlight=False)
    if n < 2:
        raise TrainError(f"evaluation needs at least 2 images, found {n} in {', '.join(shards)}")
    finite = emb["img"].isfinite().all(dim=1)
    if not bool(finite.all()):  # recalls from NaN embeddings would be printed as if they meant something
        raise TrainError(f"the checkpoint gives non-finite image embeddings for {int((~finite).sum())} of {n} "
                         f"images (first: {emb['keys'][int((~finite).nonzero()[0])]}); its weights are damaged")
    per_image = torch.bincount(emb["txt2img"], minlength=n)
    sizes = {"n_images": n, "n_captions": len(emb["txt"])}
    # ITM's re-rank reads the whole ITC matrix (each query's top-k); plain retrieval is scored in bounded tiles
    sim = emb["img"] @ emb["txt"].t() if itm_rerank_k > 0 else None
    recall = (recall_at_k(sim, emb["txt2img"]) if sim is not None
              else blocked_recall(emb["img"], emb["txt"], emb["txt2img"]))
    out = {"data": data_signature(shards), "input": "features" if use_features else "pixels", "protocol": PROTOCOL,
           "n_samples": n, "skipped": emb["skipped"], "retrieval": {**recall, **sizes},
           "chance": chance_recall(n, len(emb["txt"]), captions_per_image=per_image.tolist())}
    if any(emb["io"].values()):  # remote shards: reads retried, shards left out (--skip-bad-shards)
        out.update(emb["io"])
    if itm_rerank_k > 0:
        if model.fusion is None:
            raise TrainError("--itm-rerank-k needs a model with a fusion encoder (this one has fusion_layers=0)")
        t0 = time.perf_counter()
        scorer = _itm_scorer(model, emb, dev)
        pairs = []

        def counted(i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
            pairs.append(len(i))
            return scorer(i, j)

        ranked = itm_rerank(sim, itm_rerank_k, counted, batch=max(cfg.batch_size, 64))
        seconds = time.perf_counter() - t0
        out["itm_rerank"] = {"k": itm_rerank_k, **rerank_recall(*ranked, emb["txt2img"]), **sizes,
                             "pairs": sum(pairs), "seconds": round(seconds, 2),
                             "seconds_per_1k_images": round(1000 * seconds / n, 2)}
    return out, emb


def _zeroshot_by_caption(model, cfg, zpath: Path, emb: dict, templates: list[str], dev) -> dict:
    """Zero-shot on the images of the shards, each labelled by the class named in its first caption."""
    from vltrain.zeroshot import chance, class_embeddings, read_text, zeroshot_metrics

    if not zpath.exists():
        raise TrainError(f"class file not found: {zpath}")
    names = [line.strip() for line in read_text(zpath, "class names").splitlines() if line.strip()]
    if len(names) < 2:
        raise TrainError(f"{zpath}: zero-shot needs at least 2 class names (one per line)")
    twice = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if twice is not None:  # two classes of one name tie and always lose
        raise TrainError(f"{zpath}: class name {cut(repr(twice))} is listed twice; list each class once")
    patterns = [re.compile(r"\b" + re.escape(c.lower()) + r"\b") for c in names]
    first = np.unique(emb["txt2img"].numpy(), return_index=True)[1]  # each image's first caption
    labels = [_class_label(emb["captions"][i].lower(), patterns) for i in first]
    keep = [i for i, y in enumerate(labels) if y is not None]
    zs = {"classes": len(names), "samples": len(keep), "skipped": emb["n"] - len(keep), "templates": templates}
    if keep:
        class_emb = class_embeddings(model, names, templates, cfg.data.max_len, dev)
        zs.update(zeroshot_metrics(emb["img"][keep], class_emb, torch.tensor([labels[i] for i in keep]), names),
                  chance=chance(len(names)))
    return zs


def _evaluate_triplets(model, cfg, shards: list[str], dev, path: Path, step, extra: bool) -> dict:
    """A TOnICS aligner checkpoint: noun-to-image retrieval over the triplets of SHARDS (one per image)."""
    from vltrain.samplers import tonics_instances

    if extra:
        raise TrainError("--zeroshot and --itm-rerank-k need ITC / ITM heads; this is a TOnICS aligner checkpoint")
    data = IndexedShards(shards)
    try:
        inst = tonics_instances(shards[0], data.keys, np.zeros(len(data), dtype=bool), triplets=True)["train"]
    except ValueError as e:
        raise TrainError(f"a TOnICS aligner checkpoint is scored on triplets: {e}") from None
    use_features = reads_features(model, shards)
    tf = None if use_features else pixel_transform(model, cfg.data.image_size)
    view = InstanceView(data, inst["samples"], tf, use_features, inst["spans"])
    positions = distinct_positions(view, len(view), cfg.seed)
    n = len(positions)
    if n < 2:
        raise TrainError(f"evaluation needs at least 2 triplets of distinct images, found {n}")
    collate = Collate(model_tokenizer(model), cfg.data.max_len, use_features)
    sim = view_scores(model, view, positions, collate, cfg.batch_size, True, dev).t()  # (image, noun)
    skipped = data.counts.skipped()  # bad samples drop out of both sides
    n = len(sim)
    if skipped["count"]:
        console.print(f"warning: {skipped_note(skipped, data.counts.totals()[0])}: not scored", highlight=False)
    return {"checkpoint": str(path), "step": step, "n_samples": n, "task": "noun-image retrieval, one triplet per image",
            "skipped": skipped, "retrieval": recall_at_k(sim, torch.arange(n)), "chance": chance_recall(n, n)}


# --- the training loop's periodic checks -----------------------------------------------------------------------


def skipped_note(skipped: dict, read: int | None = None) -> str:
    """'2 of 120 samples skipped (npy_nonfinite 1, npy_shape 1)' for LoadCounts.skipped()."""
    n = skipped["count"]
    why = ", ".join(f"{r} {c}" for r, c in sorted(skipped["reasons"].items()))
    counted = f"{n} of {read} samples" if read is not None else f"{n} sample{'s' if n != 1 else ''}"
    return f"{counted} skipped ({why})"


def heldout_recall(sim, what: str, step: int, txt2img=None, skipped: dict | None = None,
                   held_out: int | None = None) -> dict:
    """R@K of a held-out (N_img, N_txt) image-text similarity, or of (image, caption) embeddings scored in tiles
    (blocked_recall: memory bounded whatever N), one caption per image unless txt2img says otherwise, with its
    chance levels; prints the step's one-line summary, with the bad samples `skipped` left out and, when given, the
    size of the whole held-out split (`held_out`) that a capped evaluation scored a part of."""
    embeddings = isinstance(sim, tuple)
    n, n_txt = (sim[0].shape[0], sim[1].shape[0]) if embeddings else sim.shape
    txt2img = torch.arange(n) if txt2img is None else txt2img
    res = blocked_recall(*sim, txt2img) if embeddings else recall_at_k(sim, txt2img)
    chance = chance_recall(n, n_txt, captions_per_image=torch.bincount(txt2img, minlength=n).tolist())
    many = f" ({n_txt} captions)" if n_txt != n else ""
    many += f" of {held_out} held out" if held_out is not None else ""
    left_out = f"; {skipped_note(skipped)}, not scored" if skipped and skipped["count"] else ""
    console.print(f"step {step} eval on {n} {what}{many}: R@1 image→text {res['i2t_r1']:.1f}, text→image "
                  f"{res['t2i_r1']:.1f} (chance {chance['i2t_r1']:.1f}); mean recall {res['mean_recall']:.2f}"
                  + left_out,
                  highlight=False)
    return {**res, "n_val": n, "n_captions": n_txt, "chance": chance, **({"skipped": skipped} if skipped else {}),
            **({"held_out": held_out} if held_out is not None else {})}


def val_triplet_sim(model, view: InstanceView, positions, collate: Collate, batch_size: int, device) -> torch.Tensor:
    """Triplet mode: the aligner's own task, noun i of a held-out triplet against image j -> (N, N) image x noun."""
    return view_scores(model, view, positions, collate, batch_size, True, device).t()


def heldout_r1(model, view: InstanceView, positions, collate: Collate, batch_size: int, triplets: bool,
               device) -> float:
    """TOnICS' refresh check: held-out image retrieval R@1 (a fraction) over `positions`."""
    scores = view_scores(model, view, positions, collate, batch_size, triplets, device)
    return float((scores.argmax(dim=1) == torch.arange(len(scores))).float().mean())
