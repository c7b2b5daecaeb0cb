"""Retrieval R@K (ITC similarity, optional ITM re-rank of the top-k), zero-shot accuracy, and `vltrain eval`.

Metrics are pure functions of score matrices; `embed_split`, `view_scores` and `evaluate_checkpoint` run a model
over shards to get them (the training loop's periodic checks use the first two).
"""

import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from torch.utils.data import DataLoader

from vltrain import TrainError
from vltrain.checkpoint import load, model_from
from vltrain.config import from_dict
from vltrain.data import (SAME_ENCODER, Collate, IndexedShards, InstanceView, ShardStream, eval_transform,
                          feature_input, to_device)
from vltrain.layers import noun_states
from vltrain.losses import upcast
from vltrain.model import autocast, resolve_device, tokenizer_for

console = Console(stderr=True, emoji=False, soft_wrap=True)
PROMPT = "a photo of a {}"

KS = (1, 5, 10)


def recall_at_k(sim: torch.Tensor, txt2img: torch.Tensor, ks=KS) -> dict[str, float]:
    """sim (N_img, N_txt), txt2img (N_txt,) image index of each text -> i2t / t2i R@K in % and their mean."""
    n_img, n_txt = sim.shape
    positive = torch.zeros(n_img, n_txt, dtype=torch.bool)
    positive[txt2img, torch.arange(n_txt)] = True
    out = {}
    # rank of the best positive per image (i2t) and of the image per text (t2i)
    order_i2t = sim.argsort(dim=1, descending=True)
    first_hit = positive.gather(1, order_i2t).float().argmax(dim=1)
    order_t2i = sim.t().argsort(dim=1, descending=True)
    rank_t2i = (order_t2i == txt2img[:, None]).float().argmax(dim=1)
    for k in ks:
        out[f"i2t_r{k}"] = round(100 * (first_hit < k).float().mean().item(), 2)
        out[f"t2i_r{k}"] = round(100 * (rank_t2i < k).float().mean().item(), 2)
    out["mean_recall"] = round(sum(out.values()) / len(out), 2)
    return out


def chance_recall(n_img: int, n_txt: int, ks=KS) -> dict[str, float]:
    """Expected R@K of a random ranking with one positive per query, for the table beside the results."""
    return {**{f"i2t_r{k}": round(100 * min(1.0, k / n_txt), 2) for k in ks},
            **{f"t2i_r{k}": round(100 * min(1.0, k / n_img), 2) for k in ks}}


def itm_rerank(sim: torch.Tensor, k: int, itm_score: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> tuple:
    """ALBEF's re-rank: for each query, its ITC top-k get score = ITM match logit + ITC similarity, others -100.

    itm_score(image_idx (M,), text_idx (M,)) -> (M,) match logits. Returns (sim_i2t, sim_t2i), both (N_img, N_txt).
    """
    k = min(k, sim.shape[1], sim.shape[0])
    i2t = torch.full_like(sim, -100.0)
    for i in range(sim.shape[0]):
        top_sim, top = sim[i].topk(min(k, sim.shape[1]))
        i2t[i, top] = itm_score(torch.full_like(top, i), top) + top_sim
    t2i = torch.full_like(sim, -100.0)
    for j in range(sim.shape[1]):
        top_sim, top = sim[:, j].topk(min(k, sim.shape[0]))
        t2i[top, j] = itm_score(top, torch.full_like(top, j)) + top_sim
    return i2t, t2i


def rerank_recall(sim_i2t: torch.Tensor, sim_t2i: torch.Tensor, txt2img: torch.Tensor, ks=KS) -> dict[str, float]:
    """R@K when the two directions are ranked by different score matrices (after itm_rerank)."""
    a, b = recall_at_k(sim_i2t, txt2img, ks), recall_at_k(sim_t2i, txt2img, ks)
    out = {**{k_: v for k_, v in a.items() if k_.startswith("i2t")}, **{k_: v for k_, v in b.items() if k_.startswith("t2i")}}
    out["mean_recall"] = round(sum(out.values()) / len(out), 2)
    return out


def zeroshot_accuracy(image_embeds: torch.Tensor, class_embeds: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """image_embeds (N, D), class_embeds (C, D), both L2-normalised; labels (N,) -> top-1 / top-5 accuracy in %."""
    logits = image_embeds @ class_embeds.t()
    top = logits.topk(min(5, class_embeds.shape[0]), dim=1).indices
    hit = top == labels[:, None]
    return {"top1": round(100 * hit[:, 0].float().mean().item(), 2),
            "top5": round(100 * hit.any(dim=1).float().mean().item(), 2)}


# --- running a model over shards ----------------------------------------------------------------------------------


def pixel_transform(model, image_size: int):
    """The deterministic eval transform for the model's pixels; a features model uses its encoder's size."""
    size = model.image_size if model.cfg.image_model == "features" else image_size
    return eval_transform(size, model.image_mean, model.image_std)


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
def embed_split(model, folders, split: str, val_frac: float, max_len: int, batch_size: int, image_size: int,
                workers: int, device: torch.device, use_features: bool, keep_inputs: bool = False) -> dict:
    """ITC embeddings of a split in shard order: img/txt (N, E), ids/mask (N, L), captions[, inputs (N, ...)]."""
    tok = tokenizer_for(model.cfg.text_model)
    tf = None if use_features else pixel_transform(model, image_size)
    stream = ShardStream(folders, split, val_frac, tf, shuffle=False, use_features=use_features)
    # Its own generator: evaluation must not draw from the global RNG, or a resumed run would diverge.
    loader = DataLoader(stream, batch_size=batch_size, collate_fn=Collate(tok, max_len, use_features),
                        num_workers=workers, generator=torch.Generator().manual_seed(0))
    was_training = model.training
    model.eval()
    out = {"img": [], "txt": [], "ids": [], "mask": [], "captions": [], "inputs": []}
    for batch in loader:
        if batch is None:  # every sample undecodable (skipped and counted by the reader)
            continue
        batch = to_device(batch, device)
        x = batch["features"] if use_features else batch["images"]
        with autocast(device):
            _, img = model.encode_image(x)
            _, txt = model.encode_text(batch["input_ids"], batch["attention_mask"])
        out["img"].append(upcast(img).cpu())
        out["txt"].append(upcast(txt).cpu())
        pad = max_len - batch["input_ids"].shape[1]
        out["ids"].append(torch.nn.functional.pad(batch["input_ids"].cpu(), (0, pad), value=tok.pad_token_id or 0))
        out["mask"].append(torch.nn.functional.pad(batch["attention_mask"].cpu(), (0, pad), value=0))
        out["captions"].extend(batch["captions"])
        if keep_inputs:  # only ITM re-ranking needs the pixels again
            out["inputs"].append(x.cpu())
    model.train(was_training)
    if not out["img"]:
        return {"n": 0}
    return {"n": sum(len(t) for t in out["img"]), "captions": out["captions"],
            **{k: torch.cat(v) for k, v in out.items() if k != "captions" and v}}


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
    nouns, tokens, txt, img = [], [], [], []
    bs = batch_size
    for a in range(0, len(positions), bs):
        batch = collate([view[int(p)] for p in positions[a:a + bs]])
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
        nouns, tokens = torch.cat(nouns), torch.cat(tokens)
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


def _check_eval_args(path: Path, shards) -> None:
    """Catch `vltrain eval DATA CKPT` (arguments swapped) with a line that says which argument is wrong."""
    for s in map(Path, shards):
        if s.is_file() and s.suffix in (".pt", ".pth"):
            raise TrainError(f"{s} is a checkpoint file, not a shard folder: the checkpoint comes first "
                             "(vltrain eval CHECKPOINT SHARDS...)")
    if path.is_dir():
        hint = " (the checkpoint comes first: vltrain eval CHECKPOINT SHARDS...)" if (path / "sizes.json").exists() \
            else ""
        raise TrainError(f"CHECKPOINT {path} is a folder, not a checkpoint file{hint}")


@torch.no_grad()
def evaluate_checkpoint(path, shards, zeroshot=None, itm_rerank_k: int = 0, device: str = "auto") -> dict:
    """Retrieval R@1/5/10 over ALL samples of `shards` (optionally ITM re-ranked over the ITC top-k) and zero-shot.

    Zero-shot reads class names from a file (one per line) and scores "a photo of a {name}". A sample's true
    label is the class whose name appears as whole words in its caption (the longest such name when several
    do); samples whose caption names no class are skipped and counted in `zeroshot.skipped`.
    A model trained on `vlprep features` tokens reads the shards' tokens when the same encoder made them, and
    otherwise runs that frozen encoder on the images first.
    """
    path = Path(path)
    _check_eval_args(path, shards)
    dev = resolve_device(device)
    ckpt = load(path)
    cfg = from_dict(ckpt["config"])
    model = model_from(ckpt, path).to(dev).eval()
    shards = [str(s) for s in shards]
    if cfg.data.triplets:
        return _evaluate_triplets(model, cfg, shards, dev, path, ckpt.get("step"),
                                  zeroshot is not None or itm_rerank_k > 0)
    # val_frac 0 puts every sample in the "train" split: `vltrain eval` scores all samples of SHARDS.
    use_features = reads_features(model, shards)
    emb = embed_split(model, shards, "train", 0.0, cfg.data.max_len, cfg.batch_size, cfg.data.image_size,
                      max(cfg.data.workers, 0), dev, use_features, keep_inputs=itm_rerank_k > 0)
    n = emb["n"]
    if n < 2:
        raise TrainError(f"evaluation needs at least 2 samples, found {n} in {', '.join(shards)}")
    sim = emb["img"] @ emb["txt"].t()
    txt2img = torch.arange(n)
    result = {"checkpoint": str(path), "step": ckpt.get("step"), "n_samples": n,
              "input": "features" if use_features else "pixels",
              "retrieval": recall_at_k(sim, txt2img), "chance": chance_recall(n, n)}

    if itm_rerank_k > 0:
        if model.fusion is None:
            raise TrainError("--itm-rerank-k needs a model with a fusion encoder (this one has fusion_layers=0)")

        def itm_score(img_idx: torch.Tensor, txt_idx: torch.Tensor) -> torch.Tensor:
            x, ids, mask = (emb["inputs"][img_idx].to(dev), emb["ids"][txt_idx].to(dev),
                            emb["mask"][txt_idx].to(dev))
            with autocast(dev):
                tokens, _ = model.encode_image(x)
                hidden, _ = model.encode_text(ids, mask)
                return model.itm_logits(model.fuse(hidden, mask, tokens))[:, 1].float().cpu()

        result["itm_rerank"] = {"k": itm_rerank_k, **rerank_recall(*itm_rerank(sim, itm_rerank_k, itm_score), txt2img)}

    if zeroshot is not None:
        zpath = Path(zeroshot)
        if not zpath.is_file():
            raise TrainError(f"class file not found: {zpath}")
        names = [line.strip() for line in zpath.read_text().splitlines() if line.strip()]
        if not names:
            raise TrainError(f"{zpath}: no class names (one per line)")
        patterns = [re.compile(r"\b" + re.escape(c.lower()) + r"\b") for c in names]
        labels = [_class_label(c.lower(), patterns) for c in emb["captions"]]
        keep = [i for i, y in enumerate(labels) if y is not None]
        tok = tokenizer_for(cfg.model.text_model)
        enc = tok([PROMPT.format(c) for c in names], padding="longest", truncation=True, max_length=cfg.data.max_len,
                  return_tensors="pt")
        with autocast(dev):
            _, class_emb = model.encode_text(enc["input_ids"].to(dev), enc["attention_mask"].to(dev))
        zs = {"classes": len(names), "samples": len(keep), "skipped": n - len(keep), "prompt": PROMPT}
        if keep:
            zs.update(zeroshot_accuracy(emb["img"][keep], class_emb.float().cpu(),
                                        torch.tensor([labels[i] for i in keep])))
        result["zeroshot"] = zs
    return result


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
    collate = Collate(tokenizer_for(cfg.model.text_model), cfg.data.max_len, use_features)
    sim = view_scores(model, view, positions, collate, cfg.batch_size, True, dev).t()  # (image, noun)
    return {"checkpoint": str(path), "step": step, "n_samples": n, "task": "noun-image retrieval, one triplet per image",
            "retrieval": recall_at_k(sim, torch.arange(n)), "chance": chance_recall(n, n)}


# --- the training loop's periodic checks -----------------------------------------------------------------------


def heldout_recall(sim: torch.Tensor, what: str, step: int) -> dict:
    """R@K of a held-out (N, N) image-text similarity with its chance levels; prints the step's one-line summary."""
    n = sim.shape[0]
    res = recall_at_k(sim, torch.arange(n))
    chance = chance_recall(n, n)
    console.print(f"step {step} eval on {n} {what}: R@1 image→text {res['i2t_r1']:.1f}, text→image "
                  f"{res['t2i_r1']:.1f} (chance {chance['i2t_r1']:.1f}); mean recall {res['mean_recall']:.2f}",
                  highlight=False)
    return {**res, "n_val": n, "chance": chance}


def val_triplet_sim(model, view: InstanceView, positions, collate: Collate, batch_size: int, device) -> torch.Tensor:
    """Triplet mode: the aligner's own task, noun i of a held-out triplet against image j -> (N, N) image x noun."""
    return view_scores(model, view, positions, collate, batch_size, True, device).t()


def heldout_r1(model, view: InstanceView, positions, collate: Collate, batch_size: int, triplets: bool,
               device) -> float:
    """TOnICS' refresh check: held-out image retrieval R@1 (a fraction) over `positions`."""
    scores = view_scores(model, view, positions, collate, batch_size, triplets, device)
    return float((scores.argmax(dim=1) == torch.arange(len(scores))).float().mean())
