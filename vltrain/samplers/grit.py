"""GRIT (Byun et al., section 4 and supplementary Algorithms 1-2)
- `grit_order` groups one sub-queue greedily, alternating image->text and text->image argmax over the
  not-yet-visited examples.
- `GritSampler` collects each step's ITC features with their positions (no extra forward pass). When L are
  collected: example-level shuffle, split into L/M sub-queues, `grit_order` on each, append to the next
  epoch's index array G. At the epoch's end the remainder is grouped too; examples never collected (the
  tail a drop_last loader left out) go to the front of G, so they fall into full batches next epoch. G is then
  cut into mini-batches of N, which are shuffled at the mini-batch level; the D mod N examples at the end of G
  are the ones this epoch leaves out. The first epoch is a random permutation.
"""

from collections.abc import Iterator, Sequence

import numpy as np
import torch

from vltrain.losses import upcast

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
    img = upcast(image_feats)
    txt = upcast(text_feats)
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
            sim = buffers[0, :end - first]
            sim_t = buffers[1, :end - first]
            for s in range(first, end):  # one product per sub-queue, as grit_order on that sub-queue would take
                a = s * m
                torch.mm(img[a:a + size], txt[a:a + size].t(), out=sim[s - first])
                sim_t[s - first].copy_(sim[s - first].t())  # while the block is in cache: cheaper than one big transpose
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
    # numpy on a CPU: the same steps as _chains_torch, several times faster there (torch's CPU argmax over an
    # (S, M) block has a large fixed cost per call). Same first-index tie rule; both paths are tested to give the
    # same orders.
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
        img = upcast(image_feats.detach())
        txt = upcast(text_feats.detach())
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
        n = len(state["q_idx"])
        dim = q_img.shape[1] if q_img.ndim == 2 else 0
        self._reset_queue(dim)
        for q, key in ((self.q_idx, "q_idx"), (self.q_img, "q_img"), (self.q_txt, "q_txt")):
            q[:n] = torch.as_tensor(np.asarray(state[key]))
        self.q_len = n
        self.rng.bit_generator.state = state["rng"]
