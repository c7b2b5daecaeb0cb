"""TOnICS (Srinivasan et al., sections 2-3 and A.2)
- Nodes: the root *entity* covers every training instance; one object node per ontology class o, whose
  instances X(o) are the training triplets of class o (sample mode: the training samples with such a triplet).
- Each step samples a node eta ~ P_S, then N_B instances uniformly from X(eta).
- Curriculum: P_S(entity) starts at 1. `refresh()` sets P_e <- max(alpha * P_e, beta) and gives the removed
  mass to the object nodes in proportion to |X(o)|. The trainer calls it every `refresh_every` steps when the
  held-out image retrieval R@1 is at least the threshold (paper: every 5K steps, 100 held-out instances, 0.9).
- Duplicate images are *prevented*: a batch never holds two instances of one image (two nouns of one caption can
  map to the same class). Instances are drawn uniformly and an instance whose image is already in the batch is
  redrawn, so no pair in the contrastive losses is a false negative of that kind. Nodes with fewer distinct
  training images than N_B cannot fill a batch this way and are left out of the curriculum (reported).
- Each curriculum *period* of `refresh_every` steps is one sampler "epoch": its batches are drawn from the P_S in
  force when the period starts, batch b from a generator seeded by (seed, period, b), so a refresh decided at the
  end of a period applies from the next one and a resumed run replays the same batches.
"""

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np


class TonicsCurriculum:
    """Node sampling distribution P_S: `.probs[0]` is the entity node, then the object nodes in `node_sizes` order."""

    def __init__(self, node_sizes: Sequence[int], alpha: float = 0.9, beta: float = 0.2):
        sizes = np.asarray(node_sizes, dtype=np.float64)
        if sizes.ndim != 1 or len(sizes) == 0 or (sizes <= 0).any():
            raise ValueError("node_sizes must be a non-empty list of positive instance counts")
        if not 0 < alpha < 1:
            raise ValueError(f"alpha must be in (0, 1), got {alpha}")
        if not 0 <= beta <= 1:
            raise ValueError(f"beta must be in [0, 1], got {beta}")
        self.node_sizes, self.alpha, self.beta = sizes, float(alpha), float(beta)
        self.probs = np.zeros(len(sizes) + 1)
        self.probs[0] = 1.0
        self.refreshes = 0

    def refresh(self) -> float:
        """One curriculum refresh; returns the mass moved from the entity node to the object nodes (0 at the floor)."""
        old = self.probs[0]
        new = min(old, max(self.alpha * old, self.beta))
        moved = old - new
        self.probs[0] = new
        self.probs[1:] += moved * self.node_sizes / self.node_sizes.sum()
        self.refreshes += 1
        return moved

    def sample(self, rng: np.random.Generator) -> int:
        """A node index drawn from P_S (0 = entity)."""
        # Inverse CDF by hand: rng.choice(p=...) insists on an exact sum, which refresh arithmetic only nearly has.
        cdf = np.cumsum(self.probs)
        return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(cdf) - 1))

    def state_dict(self) -> dict:
        return {"probs": self.probs.copy(), "refreshes": self.refreshes}

    def load_state_dict(self, state: dict) -> None:
        probs = np.asarray(state["probs"], dtype=np.float64)
        if probs.shape != self.probs.shape:
            raise ValueError(f"curriculum state has {len(probs)} nodes, this ontology has {len(self.probs)}")
        self.probs, self.refreshes = probs.copy(), int(state["refreshes"])


class TonicsBatchSampler:
    """Batches of N_B positions, each from one node drawn from the curriculum; one "epoch" is one period.

    nodes[k] holds the positions of object node k (the curriculum's node k + 1); image_of[p] identifies the image
    of position p (no batch holds one image twice). The entity node is every position.
    """

    def __init__(self, curriculum: TonicsCurriculum, nodes: Sequence[np.ndarray], image_of: np.ndarray,
                 batch_size: int, period: int, seed: int = 0):
        if len(nodes) + 1 != len(curriculum.probs):
            raise ValueError(f"{len(nodes)} object nodes but the curriculum has {len(curriculum.probs) - 1}")
        self.curriculum, self.image_of = curriculum, np.asarray(image_of)
        self.members = [np.arange(len(self.image_of))] + [np.asarray(n, dtype=np.int64) for n in nodes]
        for k, m in enumerate(self.members):
            if len(np.unique(self.image_of[m])) < batch_size:
                what = "the training set" if k == 0 else f"object node {k - 1}"
                raise ValueError(f"{what} has fewer than {batch_size} distinct images: it cannot fill a batch")
        self.batch_size, self.period, self.seed, self.epoch = batch_size, period, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.period

    def draw(self, node: int, rng: np.random.Generator) -> list[int]:
        """N_B positions of `node`, uniform among its instances, no image twice."""
        members = self.members[node]
        chosen = []
        images = set()
        while len(chosen) < self.batch_size:
            for p in members[rng.integers(0, len(members), size=2 * self.batch_size)]:
                img = self.image_of[p]
                if img not in images:
                    images.add(img)
                    chosen.append(int(p))
                    if len(chosen) == self.batch_size:
                        break
        return chosen

    def batch(self, index: int) -> tuple[int, list[int]]:
        """(node, positions) of batch `index` of the current period, a pure function of (seed, epoch, index, P_S)."""
        rng = np.random.default_rng([self.seed, self.epoch, index])
        node = self.curriculum.sample(rng)
        return node, self.draw(node, rng)

    def __iter__(self) -> Iterator[list[int]]:
        for b in range(self.period):
            yield self.batch(b)[1]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "curriculum": self.curriculum.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state["epoch"])
        self.curriculum.load_state_dict(state["curriculum"])


# --- TOnICS instances from `vlprep ontology` output -------------------------------------------------------------


def tonics_instances(ontology_dir, keys: Sequence[str], is_val: np.ndarray, triplets: bool) -> dict:
    """Instances and object nodes from ontology.json + triplets.parquet, split into train and validation.

    keys[i] is the key of global sample i of the training folders (a list, or IndexedShards' KeyArray); the
    triplets' `index` must point into the first folder (the ontology's own shards), checked key by key. Returns a
    dict with, per split ("train", "val"): `samples` (P,) the global sample of each position, `spans` (P, 2) or
    None, and for "train" also `nodes` (a list of (class, positions) in ontology.json order).
    Triplet mode: an instance is a triplet. Sample mode: an instance is a sample (of any folder), and node o holds
    the samples with at least one triplet of class o.
    Memory: numpy arrays only, 12 bytes per triplet (index, class; triplet mode 16 more for the span) and, in sample
    mode, 8 per sample; the triplets' keys are checked a block of rows at a time, never held as Python strings.
    """
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    root = Path(ontology_dir)
    onto_path = root / "ontology.json"
    trip_path = root / "triplets.parquet"
    if not onto_path.is_file() or not trip_path.is_file():
        raise ValueError(f"{root}: no ontology.json / triplets.parquet (run `vlprep ontology` to make them)")
    classes = [n["class"] for n in json.loads(onto_path.read_text())["nodes"]]
    t = pq.read_table(trip_path, columns=["index", "start", "end", "class"] if triplets else ["index", "class"])
    idx = np.asarray(t.column("index").to_numpy(), dtype=np.int64)  # Arrow's buffer when it is int64 already
    spans = np.stack([t.column("start").to_numpy(), t.column("end").to_numpy()], axis=1).astype(np.int64) if (
        triplets) else None
    # each triplet's class as its position in `classes` (-1: a class ontology.json does not list)
    names = pa.array(classes, type=pa.string())
    code = pc.fill_null(pc.index_in(pc.cast(t.column("class"), pa.string()), value_set=names), -1)
    code = code.to_numpy().astype(np.int32)
    del t
    if len(idx) and (idx.min() < 0 or idx.max() >= len(keys) or not _keys_agree(trip_path, keys)):
        raise ValueError(f"{trip_path} does not describe the first shard folder (its keys differ): "
                         "give the ontology output folder as the first dataset")
    is_val = np.asarray(is_val, dtype=bool)
    out = {}
    if triplets:
        for split, keep in (("train", ~is_val[idx]), ("val", is_val[idx])):
            out[split] = {"samples": idx[keep], "spans": spans[keep]}
        out["train"]["nodes"] = list(zip(classes, _groups(code[~is_val[idx]], len(classes))))
    else:
        for split, keep in (("train", ~is_val), ("val", is_val)):
            out[split] = {"samples": np.flatnonzero(keep), "spans": None}
        pos_of = np.full(len(keys), -1, dtype=np.int64)
        pos_of[out["train"]["samples"]] = np.arange(len(out["train"]["samples"]))
        # each (class, sample) pair once, in sample order within each class
        pairs = np.unique(code.astype(np.int64) * max(len(keys), 1) + idx)
        pair_code = pairs // max(len(keys), 1)
        pair_idx = pairs % max(len(keys), 1)
        nodes = []
        for c, rows in zip(classes, _groups(pair_code, len(classes))):
            pos = pos_of[pair_idx[rows]]
            nodes.append((c, pos[pos >= 0]))
        out["train"]["nodes"] = nodes
    return out


def _groups(code: np.ndarray, n: int) -> list[np.ndarray]:
    """[np.flatnonzero(code == k) for k in range(n)], from one stable sort instead of n passes."""
    order = np.argsort(code, kind="stable")
    bounds = np.searchsorted(code[order], np.arange(n + 1), side="left")
    return [order[bounds[k]:bounds[k + 1]] for k in range(n)]


def _keys_agree(trip_path: Path, keys) -> bool:
    """Whether every triplet's key is keys[its index], read a block of rows at a time."""
    import pyarrow.parquet as pq

    table = keys.array if hasattr(keys, "array") else None  # KeyArray: compare bytes, no str per sample
    for batch in pq.ParquetFile(trip_path).iter_batches(batch_size=4096, columns=["key", "index"]):
        got = batch.column(0).to_pylist()
        where = batch.column(1).to_numpy().astype(np.int64)
        if table is not None:
            if not np.array_equal(np.array([k.encode() for k in got], dtype="S"), table[where]):
                return False
        elif any(keys[i] != k for i, k in zip(where, got)):
            return False
    return True


def default_ontology(folder: str) -> str:
    """The folder holding the TOnICS ontology: `folder` itself, or the ontology folder it was cached from."""
    root = Path(folder)
    if (root / "ontology.json").is_file():
        return folder
    # `vlprep features` copies samples (same keys, same order) but not the ontology files; its meta.json names
    # the folder it read. A sample it skipped shifts the indices, which tonics_instances reports as a key mismatch.
    try:
        meta = json.loads((root / "meta.json").read_text())
    except (OSError, ValueError):
        return folder
    src = (meta.get("options") or {}).get("src") if meta.get("stage") == "features" else None
    return src if src and (Path(src) / "ontology.json").is_file() else folder
