"""Mechanism checks: each method's premise measured directly on the recipes' trained checkpoints, per seed, as a
paired difference judged with pipelines/verdicts.py.

    .venv/bin/python pipelines/mechanisms.py [--demo DIR] [--out DIR] [--checks grit,tonics,softmask,fistful]
                                             [--seeds 0,1,2]

The recipes (pipelines/ablation.py) ask whether a method helps retrieval; these checks ask whether the reason the
paper gives for it holds at the demo's scale. Every check reads finished runs of a recipe, DEMO/ablation/RECIPE/ARM/
sSEED (last.pt and result.json); a check whose runs are missing says which `make ablation RECIPE=...` makes them and
the others still run. Each measures two sides on the same seed:

- grit (GRIT-VLP sec. 4, grouped mini-batches hold harder negatives): the `grit` recipe's `itc` run embeds its own
  training split (its data and data.val_frac); its features are cut into batches of its N (16) by GRIT's sampler
  (`GritSampler`, M and L as the recipe: 160 and 8,000, seeded by the seed) and at random (a seeded permutation).
  Metric: for every example of every full batch, the cosine of its hardest in-batch negative (image -> the other
  texts, text -> the other images), averaged over examples, the two directions averaged; x 100.
- tonics, sampler (TOnICS sec. 3, ontology minibatches hold same-object pairs): from the `tonics` run's training
  triplets, batches of its N_B (32) drawn by its `TonicsBatchSampler` at the curriculum state the run ended in (the
  checkpoint's sampler state) against the same sampler with P(entity) = 1 (random triplets, what the `random` arm
  draws), as many batches as the run took steps. Metric: the share (%) of pairs of instances of a batch whose images
  share an ontology class (an image's classes: those of all its triplets), over every pair of every batch.
- tonics, grounding (TOnICS sec. 3, same-object batches force noun grounding): the `tonics` and `random` runs'
  aligners score the run's held-out triplets (`heldout_positions`' scored ones: one per image, the refresh check's
  images left out, the same for both arms). For each triplet, its noun against its own image and K = 4 distractor
  images of the scored set that contain the triplet's class: a hit when its own image scores strictly highest (ties
  count against it). Metric: the exact expected hit rate (%) over every K-subset of the same-class images, averaged
  over the triplets with at least K such images; chance 1 / (K + 1) = 20%.
- softmask (SoftMask++ sec. 4.1, eq. 8, a word's Grad-CAM locates its object): a pointing game with the `softmask`
  run's fusion model on the ontology's triplets whose class the detector found in the image (DEMO/onto triplets
  `detected`, boxes from DEMO/det with that label). The word's map over the image tokens is the mean of the rows of
  its word pieces of the (image, own caption) pair's Grad-CAM (`gradcam`: mean over fusion layers and heads of
  A * ReLU(d p(match) / d A)) or of the cross-attention map (`attention_map`); the peak token's cell centre (the
  features' square grid over the centre crop of the image resized to the features' size, mapped back to the whole
  image) is a hit when it lies inside a box of the class. A flat map (no peak) scores as a random token. Against a
  uniformly random token, whose expected hit rate is the share of cell centres inside the boxes. Metric: hit rate
  (%) over the triplets. Images: every image of the run's data (training and held-out): only 8 of the 266 detected
  triplets fall in its held-out split, whose rates results.json reports beside.
- fistful (A Fistful of Words sec. 3.2, BoW training makes the text encoder order-insensitive): the `fistful`
  recipe's `bow` and `intact` runs embed the held-out retrieval captions (DEMO/eval-feat) and the same captions with
  their words shuffled (split on white space; a seeded permutation that changes the order; captions of fewer than
  two distinct words left out). Metric: the mean cosine of a caption's ITC embedding with its shuffled twin's, x 100.

Every finding has the paper's side as `better` and no paper effect (no paper quantifies these), so the verdicts are
one family: a paired t test of each difference against 0, Holm-adjusted over the findings of the checks that ran
(pipelines/verdicts.py). There is no power column: a power computed at our own observed difference (post-hoc
"observed power") is a function of the p-value and says nothing beyond it, and with no paper effect there is no
other effect to compute it for. OUT (default DEMO/ablation/mechanisms) gets
results.json (rows, findings, each check's definition, item counts and runtime) and table.md, printed too.
"""

import argparse
import copy
import json
import math
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

import verdicts  # pipelines/verdicts.py, beside this file

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DEMO = ROOT / "demo-out" / "openclipart"
console = Console(stderr=True, emoji=False)

CHECKS = ("grit", "tonics", "softmask", "fistful")  # each named after the recipe whose runs it reads
RUNS = {"grit": ["itc"], "tonics": ["tonics", "random"], "softmask": ["softmask"], "fistful": ["bow", "intact"]}
K_DISTRACTORS = 4
EMBED_BATCH = 64
GRADCAM_BATCH = 16

FINDINGS = [
    {"check": "grit", "paper": "GRIT-VLP sec. 4: GRIT's grouped mini-batches hold harder negatives than random "
     "mini-batches", "better": "grit-grouped", "than": "grit-random", "metric": "hardest_negative_cos",
     "paper_effect": None},
    {"check": "tonics", "paper": "TOnICS sec. 3: ontology minibatches hold more same-object pairs than random ones",
     "better": "tonics-sampler", "than": "random-sampler", "metric": "same_object_pairs", "paper_effect": None},
    {"check": "tonics", "paper": "TOnICS sec. 3: same-object minibatches force noun grounding: the noun finds its "
     f"image among {K_DISTRACTORS} images of the same object", "better": "tonics", "than": "random",
     "metric": "same_object_grounding", "paper_effect": None},
    {"check": "softmask", "paper": "SoftMask++ sec. 4.1 (eq. 8): a word's Grad-CAM peak lies on its object more "
     "often than a random token", "better": "gradcam", "than": "random-token", "metric": "pointing_hits",
     "paper_effect": None},
    {"check": "softmask", "paper": "SoftMask++ sec. 4.1 (eq. 8; Table 9's premise): Grad-CAM points at the word's "
     "object more often than the cross-attention map", "better": "gradcam", "than": "attention",
     "metric": "pointing_hits", "paper_effect": None},
    {"check": "fistful", "paper": "A Fistful of Words sec. 3.2: BoW training makes the text encoder insensitive to "
     "word order", "better": "bow", "than": "intact", "metric": "shuffle_cos", "paper_effect": None},
]
METRICS = {"hardest_negative_cos": "hardest in-batch negative cosine x 100",
           "same_object_pairs": "same-object pairs in a batch, %",
           "same_object_grounding": f"noun -> own image among {K_DISTRACTORS} same-object images, % (chance "
                                    f"{100 / (K_DISTRACTORS + 1):.0f})",
           "pointing_hits": "pointing game hits, %", "shuffle_cos": "cosine with the word-shuffled caption x 100"}


class CheckError(Exception):
    """Data a check cannot use; its text is the one line the user sees."""


# --- the metrics: pure functions of features, batches, scores and boxes ---------------------------------------------


def hardest_negative_cos(img: torch.Tensor, txt: torch.Tensor, batches) -> float:
    """Mean over the examples of `batches` (lists of row indices) of the cosine of each one's hardest in-batch
    negative, image -> text and text -> image averaged; the rows are L2-normalised (N, E) features. x 100."""
    i2t = []
    t2i = []
    for b in batches:
        b = torch.as_tensor(np.asarray(b), dtype=torch.long)
        sim = img[b].double() @ txt[b].double().t()
        sim.fill_diagonal_(-math.inf)
        i2t.append(sim.amax(dim=1))  # image k against the other texts
        t2i.append(sim.amax(dim=0))  # text k against the other images
    return 100 * (torch.cat(i2t).mean().item() + torch.cat(t2i).mean().item()) / 2


def random_batches(n: int, size: int, seed: int) -> list[np.ndarray]:
    """The full batches of `size` of a seeded permutation of range(n)."""
    order = np.random.default_rng([seed, 4711]).permutation(n)
    return [order[a:a + size] for a in range(0, n - size + 1, size)]


def grit_batches(img: torch.Tensor, txt: torch.Tensor, size: int, m: int, l: int, seed: int) -> list[np.ndarray]:
    """The batches GRIT's sampler builds for the next epoch from these features (every example collected once)."""
    from vltrain.samplers import GritSampler

    sampler = GritSampler(len(img), size, m, l, seed)
    sampler.collect(torch.arange(len(img)), img, txt)
    sampler.set_epoch(1)
    return [np.asarray(b) for b in sampler]


def class_masks(classes_of: list[set], names: list[str]) -> np.ndarray:
    """Each item's class set as a bit mask (int64) over `names`."""
    bit = {c: 1 << i for i, c in enumerate(names)}
    return np.array([sum(bit[c] for c in cs) for cs in classes_of], dtype=np.int64)


def same_object_share(batches, masks: np.ndarray) -> float:
    """The share (%) of pairs within a batch whose class masks (`class_masks` of each position's image) intersect,
    over every pair of every batch."""
    same = total = 0
    for b in batches:
        m = masks[np.asarray(b)]
        hit = (m[:, None] & m[None, :]) != 0
        iu = np.triu_indices(len(m), 1)
        same += int(hit[iu].sum())
        total += len(iu[0])
    return 100 * same / total if total else math.nan


def expected_grounding(scores: torch.Tensor, own: list[str], image_classes: list[set], k: int) -> tuple[float, int]:
    """scores (n, n): query i (a noun) against image j, query i's own image being j = i. For each query, the images
    j != i whose classes hold its class `own[i]` are its candidate distractors (m of them); with b of them scoring
    strictly below its own image, a random K-subset leaves the own image on top with probability C(b, K) / C(m, K).
    Returns (the mean of that over the queries with m >= K, in %; the number of such queries)."""
    s = scores.double()
    hits = []
    for i, c in enumerate(own):
        cand = [j for j, cs in enumerate(image_classes) if j != i and c in cs]
        if len(cand) < k:
            continue
        below = int((s[i, cand] < s[i, i]).sum())
        hits.append(math.comb(below, k) / math.comb(len(cand), k))
    return (100 * statistics.fmean(hits) if hits else math.nan), len(hits)


def cell_centres(width: int, height: int, grid: int, size: int) -> np.ndarray:
    """(grid * grid, 2) centres (x, y) of the token cells, row-major, in [0, 1] coordinates of the whole image, for
    tokens computed on the eval view: shorter side resized to `size` (torchvision's int(size * long / short)), then a
    size x size centre crop (its offset rounded as torchvision's CenterCrop does), cut into a grid x grid grid."""
    if width <= height:
        new_w = size
        new_h = int(size * height / width)
    else:
        new_w = int(size * width / height)
        new_h = size
    left = int(round((new_w - size) / 2.0))
    top = int(round((new_h - size) / 2.0))
    step = size / grid
    c = (np.arange(grid) + 0.5) * step
    ys, xs = np.meshgrid(c, c, indexing="ij")
    return np.stack([(left + xs.ravel()) / new_w, (top + ys.ravel()) / new_h], axis=1)


def inside(points: np.ndarray, boxes) -> np.ndarray:
    """(P,) bool: each point (x, y) lies in at least one box (x0, y0, x1, y1), edges included."""
    out = np.zeros(len(points), dtype=bool)
    for x0, y0, x1, y1 in boxes:
        out |= (points[:, 0] >= x0) & (points[:, 0] <= x1) & (points[:, 1] >= y0) & (points[:, 1] <= y1)
    return out


def pointing_hit(cam: torch.Tensor, centres: np.ndarray, boxes) -> float:
    """1.0 when the map's (N,) peak token's cell centre is inside a box, else 0.0; a flat map has no peak and scores
    the random token's expectation (`random_hit`)."""
    if float(cam.max()) <= float(cam.min()):
        return random_hit(centres, boxes)
    return float(inside(centres[int(cam.argmax())][None], boxes)[0])


def random_hit(centres: np.ndarray, boxes) -> float:
    """The expected hit of a uniformly random token: the share of cell centres inside a box."""
    return float(inside(centres, boxes).mean())


def shuffled(caption: str, rng: np.random.Generator) -> str | None:
    """The caption's white-space words in a seeded random order that differs from the caption's; None when no
    order can differ (fewer than two distinct words)."""
    words = caption.split()
    if len(set(words)) < 2:
        return None
    while True:
        perm = [words[i] for i in rng.permutation(len(words))]
        if perm != words:
            return " ".join(perm)


def shuffle_cosine(encode, captions: list[str], seed: int) -> tuple[float, int]:
    """(mean cosine x 100 of encode(caption) with encode(its shuffled twin), the captions used); `encode` maps a
    list of texts to (B, E) L2-normalised embeddings. The shuffles are a function of the seed and the captions."""
    rng = np.random.default_rng([seed, 1729])
    pairs = [(c, s) for c in captions if (s := shuffled(c, rng)) is not None]
    if not pairs:
        return math.nan, 0
    a = encode([c for c, _ in pairs])
    b = encode([s for _, s in pairs])
    return 100 * float((a.double() * b.double()).sum(dim=1).mean()), len(pairs)


# --- loading runs and data ------------------------------------------------------------------------------------------


def run_path(demo: Path, recipe: str, arm: str, seed: int) -> Path:
    return demo / "ablation" / recipe / arm / f"s{seed}"


def finished(run: Path) -> bool:
    """A run the recipe finished: its last.pt and result.json (an unfinished one may hold a periodic last.pt)."""
    return (run / "last.pt").is_file() and (run / "result.json").is_file()


def load_run(run: Path):
    """(vltrain.api.Model on the CPU in eval mode, its Config, the raw checkpoint) of a run's last.pt, rebuilt without
    its EMA copy and queues (as from an export: `exportfmt.EXPORT_DROPS`), which no check reads."""
    from vltrain import checkpoint as ckpt_io
    from vltrain.exportfmt import EXPORT_DROPS
    from vltrain.api import Model
    from vltrain.config_load import from_dict

    path = run / "last.pt"
    ckpt = ckpt_io.load(path)
    lean = {k: v for k, v in ckpt["model"].items() if not k.startswith(EXPORT_DROPS)}
    net = ckpt_io.model_from({**ckpt, "model": lean, "export": True}, path).eval()
    cfg = from_dict(ckpt["config"])
    cfg.device = "cpu"
    return Model(net, cfg, path, torch.device("cpu"), ckpt.get("step")), cfg, ckpt


def encode_texts(model, texts: list[str]) -> torch.Tensor:
    """model.encode_texts in batches of similar lengths (short captions padded to the batch's longest cost as much
    as long ones), in the given order."""
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    emb = model.encode_texts([texts[i] for i in order], batch_size=EMBED_BATCH)
    out = torch.empty_like(emb)
    out[torch.tensor(order, dtype=torch.long)] = emb
    return out


@torch.no_grad()
def embed_train_split(model, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """L2-normalised ITC features (image (n, E), text (n, E)) of the run's training split in shard order, each
    image with its first caption: what the trainer's forward pass hands GRIT's sampler (`queue_feats`), read as
    `embed_split` reads the split (ShardStream, unshuffled)."""
    from vltrain.data.stream import ShardStream
    from vltrain.evaluate import reads_features

    use_features = reads_features(model.net, cfg.shards)
    tf = None if use_features else model.transform
    stream = ShardStream(cfg.shards, "train", cfg.data.val_frac, tf, shuffle=False, use_features=use_features,
                         captions="first")
    xs = []
    captions = []
    for x, caption, _ in stream:
        xs.append(x)
        captions.append(caption)
    img = torch.cat([model.net.encode_image(torch.stack(xs[a:a + EMBED_BATCH]))[1]
                     for a in range(0, len(xs), EMBED_BATCH)]) if xs else torch.zeros(0, model.net.cfg.embed_dim)
    return img.float(), encode_texts(model, captions)


def sidecar_rows(folder, columns: list[str]) -> list[dict]:
    """Every sample's sidecar columns, in the dataset's order (the order vltrain's global indices follow)."""
    import pyarrow.parquet as pq
    from vlprep.dataset import open_dataset

    ds = open_dataset(folder)
    rows = []
    for shard in ds.shards:
        rows += pq.read_table(ds.sidecar(shard), columns=columns).to_pylist()
    return rows


# --- the checks, one seed each ---------------------------------------------------------------------------------


def check_grit(demo: Path, seed: int) -> tuple[list[dict], dict]:
    from vltrain.config import grit_sizes

    model, cfg, _ = load_run(run_path(demo, "grit", "itc", seed))
    img, txt = embed_train_split(model, cfg)
    if len(img) < 2 * cfg.batch_size:
        raise CheckError(f"grit: {len(img)} training examples in {', '.join(cfg.shards)}, fewer than two batches")
    m, l = grit_sizes(cfg)
    grouped = grit_batches(img, txt, cfg.batch_size, m, l, seed)
    rand = random_batches(len(img), cfg.batch_size, seed)
    info = {"examples": len(img), "batch_size": cfg.batch_size, "M": m, "L": l, "batches": len(grouped)}
    return [{"arm": "grit-grouped", "seed": seed, "hardest_negative_cos": round(hardest_negative_cos(img, txt, grouped),
                                                                                4), **info},
            {"arm": "grit-random", "seed": seed, "hardest_negative_cos": round(hardest_negative_cos(img, txt, rand), 4),
             **info}], info


def tonics_data(cfg):
    """The run's training data as the trainer's set-up built it (`prepare` + `heldout_positions`; the notes a run
    prints are not printed), with the ontology classes of every train and validation position and of every image
    (sample index -> set)."""
    import pyarrow.parquet as pq
    from vltrain.samplers import default_ontology
    from vltrain.trainset import heldout_positions, prepare

    cfg, data, _ = prepare(cfg, torch.device("cpu"))
    heldout_positions(cfg, data)
    onto = Path(cfg.sampler.ontology or default_ontology(cfg.shards[0]))
    t = pq.read_table(onto / "triplets.parquet", columns=["index", "class"]).to_pydict()
    idx = np.asarray(t["index"], dtype=np.int64)
    cls = np.asarray(t["class"], dtype=object)
    is_val = np.zeros(len(data.train.shards), dtype=bool)
    is_val[data.val.samples] = True
    train_cls = cls[~is_val[idx]]
    val_cls = cls[is_val[idx]]
    if len(train_cls) != len(data.train) or not np.array_equal(idx[is_val[idx]], data.val.samples):
        raise CheckError(f"tonics: {onto / 'triplets.parquet'} does not give the run's triplets")
    image_classes = defaultdict(set)
    for i, c in zip(idx.tolist(), cls.tolist()):
        image_classes[i].add(c)
    names = json.loads((onto / "ontology.json").read_text())
    names = [n["class"] for n in names["nodes"]]
    return data, train_cls, val_cls, image_classes, names


def sampler_batches(sampler, n: int) -> list[list[int]]:
    """The first n batches the sampler draws, period after period, at its current curriculum."""
    out = []
    epoch = 0
    while len(out) < n:
        sampler.set_epoch(epoch)
        out += [sampler.batch(b)[1] for b in range(min(sampler.period, n - len(out)))]
        epoch += 1
    return out


@torch.no_grad()
def check_tonics(demo: Path, seed: int) -> tuple[list[dict], dict]:
    from vltrain.evaluate import view_scores

    tonics, cfg, ckpt = load_run(run_path(demo, "tonics", "tonics", seed))
    rand_model, rand_cfg, _ = load_run(run_path(demo, "tonics", "random", seed))
    if cfg.sampler.kind != "tonics" or not cfg.data.triplets:
        raise CheckError(f"tonics: {run_path(demo, 'tonics', 'tonics', seed)} is not a TOnICS triplet run")
    data, train_cls, val_cls, image_classes, names = tonics_data(cfg)
    if ckpt.get("sampler") is None:
        raise CheckError(f"tonics: {run_path(demo, 'tonics', 'tonics', seed)}/last.pt holds no sampler state")
    data.sampler.load_state_dict(ckpt["sampler"])  # the curriculum where the run ended
    masks = class_masks([image_classes[int(s)] for s in data.train.samples], names)
    steps = cfg.steps
    curriculum = [round(float(p), 4) for p in data.sampler.curriculum.probs]
    share_tonics = same_object_share(sampler_batches(data.sampler, steps), masks)
    entity = copy.deepcopy(data.sampler)
    entity.curriculum.probs = np.zeros_like(entity.curriculum.probs)
    entity.curriculum.probs[0] = 1.0  # P(entity) = 1: random triplets, the random arm's batches
    share_random = same_object_share(sampler_batches(entity, steps), masks)

    rand_data = tonics_data(rand_cfg)[0]
    if not np.array_equal(rand_data.val_triplets, data.val_triplets):
        raise CheckError(f"tonics: seed {seed}'s random and tonics runs score different held-out triplets")
    positions = data.val_triplets
    own = [val_cls[int(p)] for p in positions]
    imgs = [image_classes[int(data.val.samples[int(p)])] for p in positions]
    rows = []
    n_items = 0
    for arm, model in (("tonics", tonics), ("random", rand_model)):
        scores = view_scores(model.net, data.val, positions, data.collate, EMBED_BATCH, True, torch.device("cpu"))
        acc, n_items = expected_grounding(scores, own, imgs, K_DISTRACTORS)
        rows.append({"arm": arm, "seed": seed, "same_object_grounding": None if math.isnan(acc) else round(acc, 4),
                     "triplets": n_items})
    info = {"batches": steps, "batch_size": cfg.batch_size, "p_entity": curriculum[0],
            "refreshes": int(data.sampler.curriculum.refreshes), "scored_triplets": len(positions),
            "grounding_triplets": n_items, "k": K_DISTRACTORS}
    rows = [{"arm": "tonics-sampler", "seed": seed, "same_object_pairs": round(share_tonics, 4),
             "p_entity": curriculum[0]},
            {"arm": "random-sampler", "seed": seed, "same_object_pairs": round(share_random, 4)}] + rows
    return rows, info


def pointing_items(demo: Path, cfg) -> tuple[list[dict], dict]:
    """The pointing game's items: every triplet of DEMO/onto whose class the detector found in its image, with the
    boxes of that label (DEMO/det), the image's sample index in the run's data, its size and held-out membership."""
    import pyarrow.parquet as pq
    from vltrain.data.shards import in_val

    onto = demo / "onto"
    det = demo / "det"
    for need in (onto / "triplets.parquet", det / "sizes.json"):
        if not need.is_file():
            raise CheckError(f"softmask: {need} is missing (`make demo` makes it)")
    if len(cfg.shards) != 1:
        raise CheckError(f"softmask: the run trained on {len(cfg.shards)} folders; the pointing game reads one")
    data_rows = sidecar_rows(cfg.shards[0], ["key", "caption", "width", "height"])
    at = {r["key"]: i for i, r in enumerate(data_rows)}
    objects = {r["key"]: r["objects"] or [] for r in sidecar_rows(det, ["key", "objects"])}
    onto_caption = {r["key"]: r["caption"] for r in sidecar_rows(onto, ["key", "caption"])}
    t = pq.read_table(onto / "triplets.parquet", columns=["key", "start", "end", "class", "detected"]).to_pylist()
    items = []
    skipped = 0
    for r in t:
        if not r["detected"]:
            continue
        i = at.get(r["key"])
        boxes = [o["box"] for o in objects.get(r["key"], []) if o["label"] == r["class"]]
        if i is None or not boxes or data_rows[i]["caption"] != onto_caption.get(r["key"]):
            skipped += 1  # not in the run's data, no box of the class, or another caption
            continue
        items.append({"sample": i, "span": (r["start"], r["end"]), "boxes": boxes, "width": data_rows[i]["width"],
                      "height": data_rows[i]["height"], "heldout": in_val(r["key"], cfg.data.val_frac)})
    if not items:
        raise CheckError(f"softmask: no detected triplet of {onto} is in {cfg.shards[0]}")
    return items, {"items": len(items), "skipped": skipped, "heldout_items": sum(it["heldout"] for it in items)}


def word_maps(net, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The word's Grad-CAM and cross-attention maps (B, N) for a batch of (image, own caption) pairs with the word's
    pieces in batch['noun_mask']: the mean of those rows of `gradcam` / `attention_map` (vltrain.softmask)."""
    from vltrain.softmask import attention_map, gradcam

    ids = batch["input_ids"]
    mask = batch["attention_mask"]
    words = batch["noun_mask"].float()
    with torch.no_grad():
        tokens, _ = net.encode_image(batch["features"])
    with torch.enable_grad():
        hidden, _ = net.encode_text(ids, mask)
        fused, maps = net.fuse(hidden, mask, tokens, return_attn=True)
        p_match = net.itm_logits(fused).float().softmax(dim=-1)[:, 1]
        grads = torch.autograd.grad(p_match.sum(), maps)  # each pair's p(match) depends on its own maps only
    maps = [a.detach() for a in maps]
    weights = words / words.sum(dim=1, keepdim=True)
    cam = gradcam(maps, list(grads))
    att = attention_map(maps)
    return torch.einsum("bl,bln->bn", weights, cam), torch.einsum("bl,bln->bn", weights, att)


def check_softmask(demo: Path, seed: int) -> tuple[list[dict], dict]:
    from vltrain.data.collate import Collate
    from vltrain.data.indexed import IndexedShards, InstanceView
    from vltrain.data.shards import feature_input

    model, cfg, _ = load_run(run_path(demo, "softmask", "softmask", seed))
    net = model.net
    if net.fusion is None:
        raise CheckError("softmask: the softmask run's model has no fusion encoder")
    spec = feature_input(cfg.shards, "auto")
    if spec is None:
        raise CheckError(f"softmask: {cfg.shards[0]} holds no `vlprep features` tokens to place on a grid")
    grid = math.isqrt(int(spec["tokens"]))
    if grid * grid != int(spec["tokens"]):
        raise CheckError(f"softmask: {spec['tokens']} feature tokens are not a square grid")
    items, info = pointing_items(demo, cfg)
    view = InstanceView(IndexedShards(cfg.shards), [it["sample"] for it in items], None, True,
                        [it["span"] for it in items])
    collate = Collate(model.tokenizer, cfg.data.max_len, True)
    hits = {"gradcam": [], "attention": [], "random-token": []}
    flat = empty = 0
    for a in range(0, len(items), GRADCAM_BATCH):
        chunk = items[a:a + GRADCAM_BATCH]
        batch = collate([view[p] for p in range(a, a + len(chunk))])
        keep = batch["noun_mask"].any(dim=1)  # a word cut off by max_len has no pieces
        if batch["features"].shape[1] != grid * grid:
            raise CheckError(f"softmask: the data's tokens are {batch['features'].shape[1]}, its record says "
                             f"{grid * grid}")
        cams, atts = word_maps(net, batch) if bool(keep.any()) else (None, None)
        for j, it in enumerate(chunk):
            if not keep[j]:
                empty += 1
                continue
            centres = cell_centres(it["width"], it["height"], grid, int(spec["size"]))
            flat += int(float(cams[j].max()) <= float(cams[j].min()))
            for name, value in (("gradcam", pointing_hit(cams[j], centres, it["boxes"])),
                                ("attention", pointing_hit(atts[j], centres, it["boxes"])),
                                ("random-token", random_hit(centres, it["boxes"]))):
                hits[name].append((value, it["heldout"]))
    info.update(scored=len(hits["gradcam"]), flat_gradcam_maps=flat, words_cut_off=empty, grid=grid,
                images="every image of the run's data (training and held-out)")
    rows = []
    for name, vals in hits.items():
        held = [v for v, h in vals if h]
        rows.append({"arm": name, "seed": seed, "pointing_hits": round(100 * statistics.fmean(v for v, _ in vals), 4),
                     "items": len(vals), "heldout_hits": round(100 * statistics.fmean(held), 4) if held else None,
                     "heldout_items": len(held)})
    return rows, info


def eval_captions(demo: Path) -> list[str]:
    folder = demo / "eval-feat"
    if not (folder / "sizes.json").is_file():
        raise CheckError(f"fistful: {folder} is missing (`make demo` makes it)")
    return [r["caption"] for r in sidecar_rows(folder, ["caption"])]


def check_fistful(demo: Path, seed: int) -> tuple[list[dict], dict]:
    captions = eval_captions(demo)
    rows = []
    n = 0
    for arm in RUNS["fistful"]:
        model, _, _ = load_run(run_path(demo, "fistful", arm, seed))
        cos, n = shuffle_cosine(lambda texts: encode_texts(model, texts), captions, seed)
        rows.append({"arm": arm, "seed": seed, "shuffle_cos": round(cos, 4), "captions": n})
    return rows, {"captions": n, "of": len(captions)}


RUNNERS = {"grit": check_grit, "tonics": check_tonics, "softmask": check_softmask, "fistful": check_fistful}


# --- table ----------------------------------------------------------------------------------------------------------


def side(rows: list[dict], arm: str, metric: str) -> str:
    vals = [r[metric] for r in rows if r["arm"] == arm and r.get(metric) is not None]
    if not vals:
        return "-"
    sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
    return f"{statistics.fmean(vals):.2f} ± {sd:.2f}"


def diff_cell(f: dict) -> str:
    if f["diff"] is None:
        return "-"
    ci = f"[{f['ci_low']:+.2f}, {f['ci_high']:+.2f}]" if f["ci_low"] is not None else "[one seed]"
    return f"{f['diff']:+.2f} {ci}"


def table_rows(rows: list[dict], findings: list[dict]) -> list[list[str]]:
    out = []
    for f in findings:
        out.append([f["check"], f"{f['better']} vs {f['than']}: {METRICS[f['metric']]}",
                    side(rows, f["better"], f["metric"]), side(rows, f["than"], f["metric"]), diff_cell(f),
                    f["verdict"]])
    return out


HEAD = ["check", "what is compared", "paper's side (mean ± sd)", "other side (mean ± sd)", "ours: diff [95% CI]",
        "verdict"]


def write_outputs(results: Path, table: Path, rows: list[dict], findings: list[dict], meta: dict) -> None:
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps({"recipe": "mechanisms", **meta, "rows": rows, "findings": findings}, indent=2)
                       + "\n")
    command = meta["command"].replace(f"{ROOT}/", "")  # the checkout's own paths, shown relative to it
    md = [f"`{command}` ({meta['date']}; seeds {', '.join(map(str, meta['seeds']))}): each check's two "
          "sides measured on the same seed's checkpoints, the difference paper's side minus other per seed, its 95% "
          "paired t interval, and the verdict of a paired t test against 0, Holm-adjusted over these findings "
          "(pipelines/verdicts.py).", "",
          "| " + " | ".join(HEAD) + " |", "|---" * len(HEAD) + "|"]
    md += ["| " + " | ".join(cells) + " |" for cells in table_rows(rows, findings)]
    md += ["", "| check | seeds | what was measured (the last seed's) | seconds |", "|---|---|---|---|"]
    for name, c in meta["checks"].items():
        last = list(c.get("per_seed", {}).values())[-1:] or [{}]  # what every seed shares, and the last one's state
        what = c.get("skipped") or "; ".join(f"{k} {v}" for k, v in last[0].items())
        md.append(f"| {name} | {', '.join(map(str, c.get('seeds', []))) or '-'} | {what} | "
                  f"{c.get('seconds', '-')} |")
    md += ["", "Definitions:", ""] + [f"- **{k}**: {v}" for k, v in DEFINITIONS.items()]
    table.write_text("\n".join(md) + "\n")


def rescore(path: Path) -> None:
    """Judge a results file's rows again under the current rules, measuring nothing, and write it back with its table
    beside it (NAME.json -> NAME.md)."""
    data = json.loads(path.read_text())
    ran = [name for name, c in data["checks"].items() if "seeds" in c]
    findings = judge(data["rows"], ran)
    meta = {k: v for k, v in data.items() if k not in ("recipe", "rows", "findings")}
    write_outputs(path, path.with_suffix(".md"), data["rows"], findings, meta)


def print_table(rows: list[dict], findings: list[dict]) -> None:
    table = Table(title="mechanism checks: paper's side minus other, paired by seed")
    for c in HEAD:
        table.add_column(c, justify="right" if c != "what is compared" else "left")
    for cells in table_rows(rows, findings):
        table.add_row(*cells)
    Console(width=max(Console().width, 160)).print(table)


DEFINITIONS = {
    "grit": "hardest_negative_cos: mean over the examples of the full batches of N of the itc run's training split, "
            "of the cosine x 100 of each example's hardest in-batch negative (image -> text and text -> image "
            "averaged); grouped by GritSampler (M, L of the recipe) vs a seeded random permutation.",
    "tonics": "same_object_pairs: % of the pairs within a batch whose images share an ontology class, over the run's "
              "step count of batches of N_B, drawn at the tonics run's final curriculum vs at P(entity) = 1. "
              f"same_object_grounding: mean over the scored held-out triplets with >= {K_DISTRACTORS} same-class "
              f"scored images of the exact probability that the noun scores its own image above {K_DISTRACTORS} "
              "random ones of them, %.",
    "softmask": "pointing_hits: % of the detected triplets (class found by the detector in the image) whose word "
                "map's peak token has its cell centre inside a box of the class; random-token: the expected hit "
                "rate of a uniform token (share of cell centres inside).",
    "fistful": "shuffle_cos: mean over the eval-feat captions of >= 2 distinct words of the cosine x 100 of the "
               "ITC text embeddings of the caption and of its words in a seeded different order.",
}


# --- main -----------------------------------------------------------------------------------------------------------


def idle_cores() -> int:
    """The cores the 1-minute load average leaves idle, at least 1."""
    return max(1, (os.cpu_count() or 1) - round(os.getloadavg()[0]))


def parse_seeds(text: str) -> list[int]:
    try:
        if "," in text or not text.isdigit():
            seeds = [int(x) for x in text.split(",") if x.strip()]
        else:
            seeds = list(range(int(text)))
    except ValueError:
        seeds = []
    if not seeds:
        raise CheckError(f"--seeds {text!r}: give a count (3: seeds 0, 1, 2) or a comma-separated list (0,1,2)")
    return seeds


def judge(rows: list[dict], names: list[str]) -> list[dict]:
    """verdicts.judge over the findings of the checks in `names` (one Holm family)."""
    return verdicts.judge([f for f in FINDINGS if f["check"] in names], rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--demo", type=Path, default=DEFAULT_DEMO, help=f"the demo's folder (default {DEFAULT_DEMO})")
    ap.add_argument("--out", type=Path, help="results folder (default DEMO/ablation/mechanisms)")
    ap.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated subset of {', '.join(CHECKS)}")
    ap.add_argument("--seeds", default="0,1,2", help="a count (3: seeds 0, 1, 2) or a list (0,1,2)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: the cores the load average "
                    "leaves idle, at least 1: on a machine busy training, a second thread spin-waits for a core and "
                    "costs 4-5x the time)")
    ap.add_argument("--rescore", type=Path, metavar="RESULTS.json",
                    help="judge a results file's rows again under the current rules (nothing is measured) and write "
                         "it back, with its table as RESULTS.md beside it")
    args = ap.parse_args(argv)
    if args.rescore is not None:
        try:
            rescore(args.rescore)
        except (OSError, KeyError, TypeError, ValueError) as e:
            console.print(f"error: --rescore {args.rescore}: {type(e).__name__}: {e}", highlight=False,
                          markup=False, soft_wrap=True)
            return 2
        console.print(f"rescored {args.rescore}; wrote {args.rescore.with_suffix('.md')}", highlight=False,
                      markup=False, soft_wrap=True)
        return 0
    torch.set_num_threads(args.threads if args.threads > 0 else idle_cores())
    demo = args.demo.resolve()
    out = args.out or demo / "ablation" / "mechanisms"
    names = [c.strip() for c in args.checks.split(",") if c.strip()]
    try:
        unknown = [c for c in names if c not in CHECKS]
        if unknown or not names:
            raise CheckError(f"unknown check(s) {', '.join(unknown) or '(none)'}; the checks are {', '.join(CHECKS)}")
        seeds = parse_seeds(args.seeds)
        rows = []
        checks = {}
        torch.manual_seed(0)
        for name in names:
            recipe = name
            ready = [s for s in seeds if all(finished(run_path(demo, recipe, arm, s)) for arm in RUNS[name])]
            missing = [s for s in seeds if s not in ready]
            if missing:
                arms = RUNS[name]
                where = demo / "ablation" / recipe / ("{" + ",".join(arms) + "}" if len(arms) > 1 else arms[0])
                console.print(f"{name}: no finished run{'s' if len(RUNS[name]) > 1 else ''} at {where}/s"
                              f"{{{','.join(map(str, missing))}}}; `make ablation RECIPE={recipe}` makes them"
                              + ("" if ready else ", so this check is skipped"), highlight=False, markup=False,
                              soft_wrap=True)
            if not ready:
                checks[name] = {"skipped": f"no finished runs (make ablation RECIPE={recipe})"}
                continue
            t0 = time.monotonic()
            c0 = time.process_time()
            infos = {}
            for seed in ready:
                t1 = time.monotonic()
                got, infos[seed] = RUNNERS[name](demo, seed)
                rows += [{"check": name, **r} for r in got]
                console.print(f"{name} seed {seed}: " + ", ".join(f"{r['arm']} {r[m]:.2f}" for r in got
                              for m in METRICS if r.get(m) is not None) + f" ({time.monotonic() - t1:.0f} s)",
                              highlight=False, markup=False, soft_wrap=True)
            checks[name] = {"seeds": ready, "missing_seeds": missing, "seconds": round(time.monotonic() - t0, 1),
                            "cpu_seconds": round(time.process_time() - c0, 1), "definition": DEFINITIONS[name],
                            "per_seed": {str(s): i for s, i in infos.items()}}
        ran = [n for n in names if "seeds" in checks.get(n, {})]
        if not ran:
            raise CheckError("no check has finished runs to measure (the lines above say which recipes make them)")
    except (CheckError, OSError, KeyError, ValueError, RuntimeError) as e:
        console.print(f"error: {e}", highlight=False, markup=False, soft_wrap=True)
        return 2
    findings = judge(rows, ran)
    meta = {"command": "pipelines/mechanisms.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d %H:%M"), "seeds": seeds, "checks": checks,
            "k_distractors": K_DISTRACTORS, "threads": torch.get_num_threads(),
            "load_average": round(os.getloadavg()[0], 1)}
    write_outputs(out / "results.json", out / "table.md", rows, findings, meta)
    print_table(rows, findings)
    console.print(f"wrote {out}/results.json and table.md", highlight=False, markup=False, soft_wrap=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
