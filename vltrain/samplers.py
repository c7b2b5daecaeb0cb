"""Index-based batch samplers: the TOnICS ontology curriculum and GRIT grouped mini-batches.

Both feed a DataLoader `batch_sampler` with lists of *positions* into the training instances (samples, or
triplets in TOnICS' triplet mode); `vltrain.data.InstanceView` turns a position into a sample read through wids.
A sampler's order depends only on (seed, epoch, its state), and its state goes into checkpoints.

TOnICS (Srinivasan et al., sections 2-3 and A.2)
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

GRIT (Byun et al., section 4 and supplementary Algorithms 1-2)
- `grit_order` groups one sub-queue greedily, alternating image->text and text->image argmax over the
  not-yet-visited examples.
- `GritSampler` collects each step's ITC features with their positions (no extra forward pass). When L are
  collected: example-level shuffle, split into L/M sub-queues, `grit_order` on each, append to the next
  epoch's index array G. At the epoch's end the remainder is grouped too; examples never collected (the
  tail a drop_last loader left out) go to the front of G, so they fall into full batches next epoch. G is then
  cut into mini-batches of N, which are shuffled at the mini-batch level; the D mod N examples at the end of G
  are the ones this epoch leaves out. The first epoch is a random permutation.
"""

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from vltrain import TrainError
from vltrain.config import GRIT_RATIOS, grit_sizes
from vltrain.data import IndexedShards, InstanceView, in_val
from vltrain.losses import upcast

__all__ = ["TonicsCurriculum", "TonicsBatchSampler", "grit_order", "grit_orders", "GritSampler", "indexed_data",
           "plot_curriculum"]


# --- TOnICS ---------------------------------------------------------------------------------------------------


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
        members, chosen, images = self.members[node], [], set()
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


# --- GRIT -----------------------------------------------------------------------------------------------------


GROUP_BYTES = 128 * 2**20  # similarity blocks (and their transposes) grouped at once: the memory of one chunk


def grit_order(image_feats: torch.Tensor, text_feats: torch.Tensor, start: int | None = None,
               generator: torch.Generator | None = None) -> torch.Tensor:
    """GRIT's grouping phase over one sub-queue: the visit order, a permutation of range(M) as a LongTensor.

    From example k the next example is the unvisited j maximising image_k . text_j, then on the next step
    text_k . image_j, alternating (image->text first). Argmax of the similarity equals argmax of the paper's
    softmax rows, so no softmax is taken. Ties go to the lowest index. Runs on the features' device.
    """
    m = image_feats.shape[0]
    if text_feats.shape[0] != m:
        raise ValueError(f"image_feats has {m} rows, text_feats {text_feats.shape[0]}")
    if m == 0:
        return torch.empty(0, dtype=torch.long)
    if start is None:
        start = int(torch.randint(m, (1,), generator=generator))
    if not 0 <= start < m:
        raise ValueError(f"start must be in [0, {m}), got {start}")
    return grit_orders(image_feats, text_feats, m, [start])


def grit_orders(image_feats: torch.Tensor, text_feats: torch.Tensor, m: int, starts: Sequence[int]) -> torch.Tensor:
    """`grit_order` on every sub-queue of m consecutive rows (the last one shorter when m does not divide n) at
    once: (n, D) x2 -> (n,) positions into the rows, each sub-queue's visit order in its own slot, on the
    features' device. starts[s] is sub-queue s's first example, relative to the sub-queue.

    The chains are sequential within a sub-queue but independent across sub-queues, so each step of the loop
    advances all of them: M steps per chunk of sub-queues instead of one step per example.
    """
    n = image_feats.shape[0]
    sizes = [min(m, n - a) for a in range(0, n, m)]
    if len(starts) != len(sizes) or not all(0 <= st < size for st, size in zip(starts, sizes)):
        raise ValueError(f"need one start in [0, size) for each of the {len(sizes)} sub-queues, got {list(starts)}")
    device = image_feats.device
    img, txt = upcast(image_feats), upcast(text_feats)
    out = torch.empty(n, dtype=torch.long, device=device)
    full = n // m
    chunk = max(1, GROUP_BYTES // (2 * 4 * m * m))
    spans = [(c, min(c + chunk, full), m) for c in range(0, full, chunk)]  # (first, end) sub-queues of size m
    if n % m:
        spans.append((full, full + 1, n % m))
    tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        # Full float32 products on CUDA too (train.tf32 turns TF32 on for the step): a 10-bit mantissa would
        # turn near-ties of the similarity into different argmaxes.
        torch.backends.cuda.matmul.allow_tf32 = False
        buffers = None
        for first, end, size in spans:
            # image_k . text_j, and text_k . image_j (the transposes, so that both kinds of rows are rows). One
            # pair of buffers for every full chunk: fresh pages of 128 MB per chunk cost as much as the chains.
            if size != m or buffers is None:
                buffers = torch.empty(2, end - first, size, size, device=device, dtype=img.dtype)
            sim, sim_t = buffers[0, :end - first], buffers[1, :end - first]
            for s in range(first, end):  # one product per sub-queue, as grit_order on that sub-queue would take
                a = s * m
                torch.mm(img[a:a + size], txt[a:a + size].t(), out=sim[s - first])
                sim_t[s - first].copy_(sim[s - first].t())  # while the block is in cache: ~2x one big transpose
            order = _greedy_chains(sim, sim_t, torch.as_tensor(starts[first:end], dtype=torch.long))  # (S, size)
            offsets = torch.arange(first, end, device=device)[:, None] * m
            out[first * m:first * m + order.numel()] = (order.to(device) + offsets).reshape(-1)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return out


def _greedy_chains(sim: torch.Tensor, sim_t: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """The alternating greedy chains of S sub-queues: sim (S, M, M), sim[s, k, j] = image_k . text_j, and sim_t
    its transposes (contiguous); starts (S,) -> visit orders (S, M) on sim's device. Ties go to the lowest index;
    visited examples are masked with -inf."""
    if sim.device.type == "cpu":
        return torch.from_numpy(_chains_numpy(sim.numpy(), sim_t.numpy(), starts.numpy()))
    return _chains_torch(sim, sim_t, starts.to(sim.device))


def _chains_numpy(sim: np.ndarray, sim_t: np.ndarray, starts: np.ndarray) -> np.ndarray:
    # numpy on a CPU: the same steps as _chains_torch, ~3.5x faster there (15 vs 52 ms for 17 chains of M = 960:
    # torch's CPU argmax over an (S, M) block alone is 86 us against numpy's 3.5). Same first-index tie rule;
    # tests/test_samplers.py checks that both paths give the same orders.
    s, m, _ = sim.shape
    rows = (sim.reshape(s * m, m), sim_t.reshape(s * m, m))  # image->text rows, text->image rows
    base = np.arange(s) * m
    blocked = np.zeros(s * m, dtype=sim.dtype)
    order = np.empty((m, s), dtype=np.int64)
    k = order[0] = starts
    blocked[base + k] = -np.inf
    for i in range(1, m):
        k = order[i] = (rows[(i - 1) % 2][base + k] + blocked.reshape(s, m)).argmax(axis=1)
        blocked[base + k] = -np.inf
    return np.ascontiguousarray(order.T)


def _chains_torch(sim: torch.Tensor, sim_t: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    # On a GPU the same steps as device ops: no host sync inside the loop (k stays on the device).
    s, m, _ = sim.shape
    rows = (sim.reshape(s * m, m), sim_t.reshape(s * m, m))
    base = torch.arange(s, device=sim.device) * m
    blocked = torch.zeros(s * m, dtype=sim.dtype, device=sim.device)
    order = torch.empty(m, s, dtype=torch.long, device=sim.device)
    k = order[0] = starts
    blocked.index_fill_(0, base + k, float("-inf"))
    for i in range(1, m):
        k = order[i] = (rows[(i - 1) % 2].index_select(0, base + k) + blocked.view(s, m)).argmax(dim=1)
        blocked.index_fill_(0, base + k, float("-inf"))
    return order.t().contiguous()


class GritSampler:
    """GRIT grouped mini-batches over positions 0..dataset_size-1 (N = batch_size, M = search_space, L = queue_size).

    Call `collect(positions, image_feats, text_feats)` after every training step with the batch's positions and
    its (detached, L2-normalised) ITC features; `set_epoch(e + 1)` then builds epoch e + 1 from what was collected.
    Yields full batches only (the DataLoader must not see a short last batch).
    """

    def __init__(self, dataset_size: int, batch_size: int, search_space: int, queue_size: int, seed: int = 0):
        if not 0 < batch_size <= dataset_size:
            raise ValueError(f"batch_size must be in 1..{dataset_size} (the dataset size), got {batch_size}")
        if search_space < 2:
            raise ValueError(f"search_space (M) must be at least 2, got {search_space}")
        if queue_size < search_space:
            raise ValueError(f"queue_size (L) must be at least search_space (M), got L={queue_size}, M={search_space}")
        self.size, self.batch_size, self.m, self.l, self.seed = dataset_size, batch_size, search_space, queue_size, seed
        self.epoch = 0
        self.rng = np.random.default_rng([seed, 7919])
        self.order = self.rng.permutation(dataset_size)  # epoch 0: plain random
        self.grouped: list[np.ndarray] = []  # the next epoch's G, sub-queue by sub-queue
        self._reset_queue()

    def _reset_queue(self, dim: int = 0, device: torch.device | str = "cpu") -> None:
        # The queue lives on the features' device (a GPU in training), so neither collecting nor grouping copies
        # features to the host; only the grouped positions come back, once per grouping.
        self.q_idx = torch.empty(self.l, dtype=torch.long, device=device)
        self.q_img = torch.empty(self.l, dim, device=device)
        self.q_txt = torch.empty(self.l, dim, device=device)
        self.q_len = 0

    # --- phases 1-3 ---

    def collect(self, positions, image_feats: torch.Tensor, text_feats: torch.Tensor) -> None:
        """Phase 1: enqueue one step's features; when L are held, shuffle, split and group them (phases 2-3)."""
        img, txt = upcast(image_feats.detach()), upcast(text_feats.detach())
        pos = torch.as_tensor(positions).reshape(-1).to(img.device, torch.long)
        if not len(pos) == len(img) == len(txt):
            raise ValueError(f"collect: {len(pos)} positions, {len(img)} image and {len(txt)} text features")
        if self.q_len == 0 and (self.q_img.shape[1] != img.shape[1] or self.q_img.device != img.device):
            self._reset_queue(img.shape[1], img.device)
        elif self.q_img.device != img.device:  # a queue restored from a checkpoint (CPU) meets the training device
            self.q_idx, self.q_img, self.q_txt = (t.to(img.device) for t in (self.q_idx, self.q_img, self.q_txt))
        start = 0
        while start < len(pos):
            take = min(len(pos) - start, self.l - self.q_len)
            sl = slice(self.q_len, self.q_len + take)
            self.q_idx[sl], self.q_img[sl], self.q_txt[sl] = (pos[start:start + take], img[start:start + take],
                                                              txt[start:start + take])
            self.q_len += take
            start += take
            if self.q_len == self.l:
                self._group_queue()

    def _group_queue(self) -> None:
        n = self.q_len
        perm = self.rng.permutation(n)  # phase 2: example-level shuffle of all three queues alike
        # one start per sub-queue (the last one shorter when M does not divide n), drawn in sub-queue order
        bounds = list(range(0, n, self.m)) + [n]
        starts = [int(self.rng.integers(b - a)) for a, b in zip(bounds, bounds[1:])]
        p = torch.from_numpy(perm).to(self.q_idx.device)
        # index_select, not q[p]: torch's advanced indexing took 290 ms for this (48,000 x 256) gather on a CPU here,
        # index_select 33 ms
        idx, img, txt = (q[:n].index_select(0, p) for q in (self.q_idx, self.q_img, self.q_txt))
        grouped = idx.index_select(0, grit_orders(img, txt, self.m, starts)).cpu().numpy()  # phase 3, all sub-queues
        self.grouped += np.split(grouped, bounds[1:-1])
        self.q_len = 0

    # --- phase 4 and epochs ---

    def _next_order(self) -> np.ndarray:
        if self.q_len:
            self._group_queue()
        grouped = np.concatenate(self.grouped) if self.grouped else np.empty(0, dtype=np.int64)
        if len(np.unique(grouped)) != len(grouped):
            raise RuntimeError("GRIT: an example was collected twice in one epoch")
        missing = np.setdiff1d(np.arange(self.size), grouped)
        self.grouped = []
        return self._minibatch_shuffle(np.concatenate([self.rng.permutation(missing), grouped]))

    def _minibatch_shuffle(self, g: np.ndarray) -> np.ndarray:
        """Phase 4: cut G into mini-batches of N and shuffle them; the D mod N tail stays last (left out)."""
        n = self.batch_size
        full = len(g) // n
        batches = g[:full * n].reshape(full, n)[self.rng.permutation(full)]
        return np.concatenate([batches.reshape(-1), g[full * n:]])

    def set_epoch(self, epoch: int) -> None:
        """Move to `epoch`: the same epoch is a no-op (resume, re-iteration); the next one builds it from G."""
        if epoch == self.epoch:
            return
        if epoch != self.epoch + 1:
            raise ValueError(f"GRIT builds epochs in order: at epoch {self.epoch}, asked for {epoch}")
        self.order = self._next_order()
        self.epoch = epoch

    def __len__(self) -> int:
        return self.size // self.batch_size

    def __iter__(self) -> Iterator[list[int]]:
        n = self.batch_size
        for b in range(len(self)):
            yield self.order[b * n:(b + 1) * n].tolist()

    def state_dict(self) -> dict:
        n = self.q_len
        return {"m": self.m, "l": self.l, "epoch": self.epoch, "order": self.order.copy(),
                "grouped": [g.copy() for g in self.grouped],
                "q_idx": self.q_idx[:n].cpu().numpy().copy(), "q_img": self.q_img[:n].cpu().numpy().copy(),
                "q_txt": self.q_txt[:n].cpu().numpy().copy(),
                "rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        if len(state["order"]) != self.size:
            raise ValueError(f"GRIT state is for {len(state['order'])} examples, this dataset has {self.size}")
        # States written before the sizes were saved hold no "m"/"l"; the trainer rebuilds those samplers with the
        # sizes of their time (config.GRIT_RATIOS_BEFORE).
        saved = (int(state.get("m", self.m)), int(state.get("l", self.l)))
        if saved != (self.m, self.l) or len(state["q_idx"]) > self.l:
            raise ValueError(f"GRIT state was built with M = {saved[0]}, L = {saved[1]}; this sampler has "
                             f"M = {self.m}, L = {self.l}")
        self.epoch, self.order = int(state["epoch"]), np.asarray(state["order"]).copy()
        self.grouped = [np.asarray(g).copy() for g in state["grouped"]]
        # (n, dim) as saved; reshape(0, -1) cannot infer dim, so an empty queue (a checkpoint right after a grouping)
        # reads its width from the shape.
        q_img = np.asarray(state["q_img"])
        n, dim = len(state["q_idx"]), (q_img.shape[1] if q_img.ndim == 2 else 0)
        self._reset_queue(dim)
        for q, key in ((self.q_idx, "q_idx"), (self.q_img, "q_img"), (self.q_txt, "q_txt")):
            q[:n] = torch.as_tensor(np.asarray(state[key]))
        self.q_len = n
        self.rng.bit_generator.state = state["rng"]


# --- TOnICS instances from `vlprep ontology` output -------------------------------------------------------------


def tonics_instances(ontology_dir, keys: Sequence[str], is_val: np.ndarray, triplets: bool) -> dict:
    """Instances and object nodes from ontology.json + triplets.parquet, split into train and validation.

    keys[i] is the key of global sample i of the training folders; the triplets' `index` must point into the
    first folder (the ontology's own shards), checked key by key. Returns a dict with, per split ("train", "val"):
    `samples` (P,) the global sample of each position, `spans` (P, 2) or None, and for "train" also `nodes` (a list
    of (class, positions) in ontology.json order).
    Triplet mode: an instance is a triplet. Sample mode: an instance is a sample (of any folder), and node o holds
    the samples with at least one triplet of class o.
    """
    import json
    from pathlib import Path

    import pyarrow.parquet as pq

    root = Path(ontology_dir)
    onto_path, trip_path = root / "ontology.json", root / "triplets.parquet"
    if not onto_path.is_file() or not trip_path.is_file():
        raise ValueError(f"{root}: no ontology.json / triplets.parquet (run `vlprep ontology` to make them)")
    classes = [n["class"] for n in json.loads(onto_path.read_text())["nodes"]]
    t = pq.read_table(trip_path, columns=["key", "index", "start", "end", "class"]).to_pandas()
    idx = t["index"].to_numpy(np.int64)
    if len(t) and (idx.max() >= len(keys) or any(keys[i] != k for i, k in zip(idx, t["key"]))):
        raise ValueError(f"{trip_path} does not describe the first shard folder (its keys differ): "
                         "give the ontology output folder as the first dataset")
    is_val = np.asarray(is_val, dtype=bool)
    cls = t["class"].to_numpy()
    out = {}
    if triplets:
        for split, keep in (("train", ~is_val[idx]), ("val", is_val[idx])):
            out[split] = {"samples": idx[keep], "spans": t[["start", "end"]].to_numpy(np.int64)[keep]}
        train_cls = cls[~is_val[idx]]
        out["train"]["nodes"] = [(c, np.flatnonzero(train_cls == c)) for c in classes]
    else:
        for split, keep in (("train", ~is_val), ("val", is_val)):
            out[split] = {"samples": np.flatnonzero(keep), "spans": None}
        pos_of = np.full(len(keys), -1, dtype=np.int64)
        pos_of[out["train"]["samples"]] = np.arange(len(out["train"]["samples"]))
        nodes = []
        for c in classes:
            members = np.unique(idx[cls == c])
            pos = pos_of[members]
            nodes.append((c, pos[pos >= 0]))
        out["train"]["nodes"] = nodes
    return out


# --- the trainer's index-based data: TOnICS, GRIT and triplets ------------------------------------------------


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


def indexed_data(cfg, tf_train, tf_eval, grit_ratios: tuple[int, int] = GRIT_RATIOS, world: int = 1) -> dict:
    """Train / val views read through wids, the batch sampler over the train view, the curriculum's node names and
    `notes` (lines for the user).

    Under torchrun (`world` processes) the sampler draws global batches of world x batch_size, the same on every
    rank from the same seed; each rank reads its slice (vltrain.distributed.RankSlice).
    """
    shards = IndexedShards(cfg.shards)
    is_val = np.array([in_val(k, cfg.data.val_frac) for k in shards.keys], dtype=bool)
    use_features, s, n = cfg.data.input == "features", cfg.sampler, cfg.batch_size * world
    names, notes = None, []
    if s.kind == "grit":
        splits = {"train": {"samples": np.flatnonzero(~is_val), "spans": None},
                  "val": {"samples": np.flatnonzero(is_val), "spans": None}}
        m, q = grit_sizes(cfg, grit_ratios)
        if world > 1 and not s.search_space:  # M and L are multiples of the global batch
            m = m * world
            q = s.queue_size or grit_ratios[1] * m
        sampler = GritSampler(len(splits["train"]["samples"]), n, m, q, cfg.seed)
    else:  # tonics, or random batches of triplets (P(entity) stays 1)
        try:
            onto = s.ontology or default_ontology(cfg.shards[0])
            if onto != cfg.shards[0] and not s.ontology:
                notes.append(f"tonics: ontology from {onto}, the folder {cfg.shards[0]} was cached from")
            splits = tonics_instances(onto, shards.keys, is_val, cfg.data.triplets)
        except ValueError as e:
            raise TrainError(str(e)) from None
        image_of = splits["train"]["samples"]
        if len(np.unique(image_of)) < n:
            raise TrainError(f"the training split has {len(np.unique(image_of))} distinct images with "
                             f"{'triplets' if cfg.data.triplets else 'samples'}, fewer than one batch of {n}")
        keep, dropped = [], []
        for c, pos in splits["train"]["nodes"] if s.kind == "tonics" else []:
            (keep if len(np.unique(image_of[pos])) >= n else dropped).append((c, pos))
        if s.kind == "tonics" and not keep:
            raise TrainError(f"no ontology class has {n} distinct training images, so no same-object batch can be "
                             "drawn; lower --batch-size")
        if dropped:
            notes.append(f"tonics: {len(dropped)} of {len(dropped) + len(keep)} classes have fewer than {n} distinct "
                         f"training images and stay out of the curriculum: {', '.join(c for c, _ in dropped)}")
        curriculum = TonicsCurriculum([len(p) for _, p in keep] or [1], s.alpha, s.beta)
        nodes = [p for _, p in keep] or [np.arange(len(image_of))]  # random triplets: a never-drawn dummy node
        sampler = TonicsBatchSampler(curriculum, nodes, image_of, n, s.refresh_every, cfg.seed)
        names = ["entity"] + [c for c, _ in keep]
    views = {split: InstanceView(shards, splits[split]["samples"], tf_train if split == "train" else tf_eval,
                                 use_features, splits[split]["spans"]) for split in ("train", "val")}
    return {"sampler": sampler, "names": names, "notes": notes, **views}


def plot_curriculum(log: list[dict], names: list[str], path: Path, top: int = 8) -> None:
    """P(entity) and the `top` object nodes with the most final mass across steps, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [0] + [r["step"] for r in log]  # the curriculum starts with P(entity) = 1
    probs = np.array([np.eye(len(names))[0]] + [r["probs"] for r in log])
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, probs[:, 0], color="black", lw=2, marker=".", label="entity")
    for k in (np.argsort(-probs[-1, 1:])[:top] + 1):
        ax.plot(steps, probs[:, k], label=names[k])
    ax.set(xlabel="step", ylabel="P_S(node)", ylim=(0, 1.02), title="TOnICS curriculum")
    ax.legend(fontsize=7, loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
