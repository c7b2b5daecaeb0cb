import copy
import json
from collections import Counter

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from tests.conftest import ANIMALS, ontology_dataset
from vltrain import checkpoint as ckpt_io
from vltrain.cli import app
from vltrain.data.collate import Collate, span_mask
from vltrain.data.shards import in_val
from vltrain.layers import NounAligner, noun_states
from vltrain.config import ModelConfig
from vltrain.model import build_model, build_tokenizer
from vltrain.samplers import GritSampler, TonicsBatchSampler, TonicsCurriculum, grit_order, tonics_instances

# --- TOnICS curriculum ------------------------------------------------------------------------------------------


def test_refresh_arithmetic_floor_and_proportional_split():
    sizes = [5, 3, 2]
    cur = TonicsCurriculum(sizes, alpha=0.9, beta=0.2)
    assert cur.probs.tolist() == [1.0, 0.0, 0.0, 0.0]
    # by hand: 1 -> 0.9 gives 0.1 away as 0.05 / 0.03 / 0.02; 0.9 -> 0.81 gives 0.09 more
    cur.refresh()
    assert cur.probs == pytest.approx([0.9, 0.05, 0.03, 0.02])
    cur.refresh()
    assert cur.probs == pytest.approx([0.81, 0.095, 0.057, 0.038])
    # a straightforward re-derivation for the next 30 refreshes: P_e <- max(a P_e, b), removed mass split by size
    pe, obj = 0.81, np.array([0.095, 0.057, 0.038])
    for _ in range(30):
        new = max(0.9 * pe, 0.2)
        obj = obj + (pe - new) * np.array(sizes) / sum(sizes)
        pe = new
        cur.refresh()
        assert cur.probs == pytest.approx([pe, *obj])
        assert cur.probs.sum() == pytest.approx(1.0)
    assert cur.probs[0] == pytest.approx(0.2)  # the floor holds: 0.81 * 0.9^k drops below 0.2 after 14 refreshes
    assert cur.probs[1:] / cur.probs[1:].sum() == pytest.approx(np.array(sizes) / 10)
    before = cur.probs.copy()
    assert cur.refresh() == 0.0 and cur.probs.tolist() == before.tolist()


def test_curriculum_rejects_bad_arguments():
    for args in ([[]], [[3, 0]], [[3], 1.0], [[3], 0.9, 1.5]):
        with pytest.raises(ValueError):
            TonicsCurriculum(*args)


def _tonics_sampler(n_images=60, per_image=2, batch=4, period=5000, seed=0):
    """Instances = triplets; image i has `per_image` triplets; node k holds the triplets of images with i % 3 == k."""
    image_of = np.repeat(np.arange(n_images), per_image)
    nodes = [np.flatnonzero(image_of % 3 == k) for k in range(3)]
    cur = TonicsCurriculum([len(n) for n in nodes])
    return TonicsBatchSampler(cur, nodes, image_of, batch, period, seed), image_of, nodes


def test_node_sampling_frequencies_follow_p_s():
    sampler, _, _ = _tonics_sampler()
    for _ in range(5):
        sampler.curriculum.refresh()
    probs = sampler.curriculum.probs.copy()  # [0.59, 0.1367, ...]
    n = 20_000
    counts = Counter(sampler.batch(b)[0] for b in range(n))
    freq = np.array([counts[k] / n for k in range(4)])
    # tolerance 0.016: about 4.5 binomial standard deviations (sqrt(0.25 / 20000) = 0.0035) at a fixed seed
    assert np.abs(freq - probs).max() < 0.016, (freq, probs)


def test_same_object_batches_hold_only_that_nodes_instances_and_no_image_twice():
    sampler, image_of, nodes = _tonics_sampler()
    sampler.curriculum.probs[:] = [0.25, 0.25, 0.25, 0.25]
    seen_nodes, drawn = set(), Counter()
    for b in range(400):
        node, batch = sampler.batch(b)
        seen_nodes.add(node)
        assert len(batch) == 4 and len(set(image_of[batch])) == 4  # duplicates prevented
        if node > 0:
            assert set(batch) <= set(nodes[node - 1].tolist())
        drawn.update(batch)
    assert seen_nodes == {0, 1, 2, 3}
    assert len(drawn) > 100  # entity batches reach the whole set (120 triplets)


def test_tonics_batches_are_a_function_of_seed_period_and_index():
    a, _, _ = _tonics_sampler()
    b, _, _ = _tonics_sampler()
    a.curriculum.refresh()
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    a.set_epoch(3)
    b.set_epoch(3)
    assert [x for _, x in zip(range(20), a)] == [x for _, x in zip(range(20), b)]
    b.set_epoch(4)
    assert [x for _, x in zip(range(5), a)] != [x for _, x in zip(range(5), b)]


def test_tonics_sampler_refuses_a_node_that_cannot_fill_a_batch():
    image_of = np.arange(10)
    with pytest.raises(ValueError, match="fewer than 4 distinct images"):
        TonicsBatchSampler(TonicsCurriculum([3]), [np.array([0, 1, 2])], image_of, 4, 10)


# --- the TOnICS aligner -------------------------------------------------------------------------------------------


def test_aligner_scores_match_a_per_pair_re_derivation():
    torch.manual_seed(0)
    d, d_img, heads, n_tok = 8, 6, 2, 5
    head = NounAligner(d, d_img, heads, 16, 1e-12, 0.0, 0.0).eval()
    nouns, tokens = torch.randn(3, d), torch.randn(4, n_tok, d_img)
    s = head(nouns, tokens)
    assert s.shape == (3, 4)

    def ln(x, m):
        return (x - x.mean()) / torch.sqrt(x.var(unbiased=False) + m.eps) * m.weight + m.bias

    hd = d // heads
    for i in range(3):
        for j in range(4):
            v = tokens[j] @ head.image_proj.weight.T + head.image_proj.bias  # (N, D)
            q = head.q(nouns[i])
            k, val = head.k(v), head.v(v)
            out = []
            for h in range(heads):
                sl = slice(h * hd, (h + 1) * hd)
                w = torch.softmax(torch.stack([q[sl] @ k[t, sl] for t in range(n_tok)]) / hd ** 0.5, dim=0)
                out.append(sum(w[t] * val[t, sl] for t in range(n_tok)))
            x = ln(nouns[i] + head.o(torch.cat(out)), head.ln)
            ffn = head.ffn_out(torch.nn.functional.gelu(head.ffn_in(x)))
            v_att = ln(x + ffn, head.ffn_ln)
            assert s[i, j].item() == pytest.approx((nouns[i] @ v_att).item(), rel=1e-4, abs=1e-5)


def test_noun_states_average_the_spans_word_pieces():
    hidden = torch.arange(24, dtype=torch.float32).view(2, 3, 4)
    mask = torch.tensor([[False, True, True], [False, False, False]])
    h = noun_states(hidden, mask)
    assert h[0].tolist() == ((hidden[0, 1] + hidden[0, 2]) / 2).tolist()
    assert h[1].tolist() == [0.0] * 4  # a truncated noun: zeros, not NaN


def test_span_mask_marks_the_nouns_word_pieces():
    tok = build_tokenizer(ModelConfig(text_model="tiny"))
    captions = ["a skateboarding dog", "two dogs and a man"]
    enc = tok(captions, padding="longest", return_offsets_mapping=True, return_tensors="pt")
    mask = span_mask(enc["offset_mapping"], torch.tensor([[2, 15], [15, 18]]))
    for b, (a, e) in enumerate([(2, 15), (15, 18)]):
        pieces = tok.convert_ids_to_tokens(enc["input_ids"][b][mask[b]].tolist())
        assert "".join(p.removeprefix("##") for p in pieces) == captions[b][a:e]


# --- GRIT ---------------------------------------------------------------------------------------------------------


def test_grit_order_is_the_alternating_greedy_chain():
    g = torch.Generator().manual_seed(0)
    img = torch.nn.functional.normalize(torch.randn(40, 8, generator=g), dim=1)
    txt = torch.nn.functional.normalize(torch.randn(40, 8, generator=g), dim=1)
    order = grit_order(img, txt, start=7).tolist()
    assert sorted(order) == list(range(40)) and order[0] == 7
    for i in range(1, 40):
        k, unvisited = order[i - 1], [j for j in range(40) if j not in order[:i]]
        # step 1 goes image_k -> text_j, step 2 text_k -> image_j, and so on
        score = (lambda j: float(img[k] @ txt[j])) if i % 2 == 1 else (lambda j: float(txt[k] @ img[j]))
        assert order[i] == max(unvisited, key=score)
    random_start = grit_order(img, txt, generator=torch.Generator().manual_seed(1))
    assert sorted(random_start.tolist()) == list(range(40))


def _former_grit_order(img: torch.Tensor, txt: torch.Tensor, start: int) -> np.ndarray:
    """The pre-issue-17 grit_order, one example per Python step over numpy rows: the reference for the order."""
    m = img.shape[0]
    sim = (img.float() @ txt.float().t()).numpy()
    rows = (sim, np.ascontiguousarray(sim.T))
    blocked = np.zeros(m, dtype=np.float32)
    order = np.empty(m, dtype=np.int64)
    k = order[0] = start
    blocked[k] = -np.inf
    for i in range(1, m):
        k = order[i] = int(np.argmax(rows[(i - 1) % 2][k] + blocked))
        blocked[k] = -np.inf
    return order


def _former_grouping(sampler: GritSampler, idx: np.ndarray, img: np.ndarray, txt: np.ndarray) -> list[np.ndarray]:
    """The pre-issue-17 _group_queue on a copy of the sampler's RNG: shuffle, then sub-queue by sub-queue."""
    rng = np.random.default_rng()
    rng.bit_generator.state = sampler.rng.bit_generator.state
    n = len(idx)
    perm = rng.permutation(n)
    idx, img, txt = idx[perm], img[perm], txt[perm]
    out = []
    for a in range(0, n, sampler.m):
        b = min(a + sampler.m, n)
        start = int(rng.integers(b - a))
        out.append(idx[a:b][_former_grit_order(torch.from_numpy(img[a:b]), torch.from_numpy(txt[a:b]), start)])
    return out


@pytest.mark.parametrize("n, m, dim, group_bytes", [(1000, 96, 32, None), (4800, 960, 256, None),
                                                    (700, 64, 16, 3 * 8 * 64 * 64)])
def test_grit_grouping_order_equals_the_former_implementation(monkeypatch, n, m, dim, group_bytes):
    """All sub-queues at once (and in chunks of 3, when the memory budget says so) give exactly the order the
    one-sub-queue-at-a-time implementation gave for the same seed and features, the shorter last one included."""
    import vltrain.samplers.grit as vs

    if group_bytes is not None:
        monkeypatch.setattr(vs, "GROUP_BYTES", group_bytes)
    rng = np.random.default_rng(n)
    img = rng.normal(size=(n, dim)).astype(np.float32)
    img /= np.linalg.norm(img, axis=1, keepdims=True)
    txt = img + 0.5 * rng.normal(size=(n, dim)).astype(np.float32)
    txt /= np.linalg.norm(txt, axis=1, keepdims=True)
    sampler = GritSampler(n + 10, 8, search_space=m, queue_size=n, seed=5)
    idx = rng.permutation(n + 10)[:n]
    expected = _former_grouping(sampler, idx, img, txt)
    for a in range(0, n, 100):  # collected in steps of 100; the queue fills, and groups, at the last one
        sampler.collect(torch.from_numpy(idx[a:a + 100]), torch.from_numpy(img[a:a + 100]),
                        torch.from_numpy(txt[a:a + 100]))
    assert sampler.q_len == 0 and len(sampler.grouped) == len(expected) == -(-n // m)
    for got, want in zip(sampler.grouped, expected):
        assert got.tolist() == want.tolist()


def test_grit_chains_on_torch_ops_equal_numpy_ties_included():
    """The device path (torch ops, used on a GPU) and the CPU path (numpy) take the same argmax, ties included:
    duplicated features make exact ties, which both resolve to the lowest index."""
    from vltrain.samplers.grit import _chains_numpy, _chains_torch

    g = torch.Generator().manual_seed(0)
    img = torch.nn.functional.normalize(torch.randn(5, 30, 8, generator=g), dim=2)
    txt = torch.nn.functional.normalize(torch.randn(5, 30, 8, generator=g), dim=2)
    img[:, 10:20], txt[:, 10:20] = img[:, :10], txt[:, :10]  # every similarity row holds exact ties
    sim = img @ txt.transpose(1, 2)
    starts = torch.tensor([0, 3, 29, 15, 10])
    a = _chains_torch(sim, sim.mT.contiguous(), starts)
    b = torch.from_numpy(_chains_numpy(sim.numpy(), sim.mT.contiguous().numpy(), starts.numpy()))
    assert a.tolist() == b.tolist()
    for s in range(5):
        assert a[s].tolist() == _former_grit_order(img[s], txt[s], int(starts[s])).tolist()
        assert sorted(a[s].tolist()) == list(range(30))


@pytest.mark.cuda
def test_grit_groups_on_the_gpu_without_moving_the_queue_to_the_host():
    sampler = GritSampler(64, 8, search_space=16, queue_size=32, seed=3)
    g = torch.Generator().manual_seed(0)
    img = torch.nn.functional.normalize(torch.randn(64, 8, generator=g), dim=1)
    txt = torch.nn.functional.normalize(torch.randn(64, 8, generator=g), dim=1)
    cpu = GritSampler(64, 8, search_space=16, queue_size=32, seed=3)
    for batch in sampler:
        b = torch.tensor(batch)
        sampler.collect(b.cuda(), img[b].cuda(), txt[b].cuda())
        assert sampler.q_img.is_cuda
        cpu.collect(b, img[b], txt[b])
    sampler.set_epoch(1)
    cpu.set_epoch(1)
    # float32 products on both sides; only near-ties of the last bits could differ, and random features have none
    assert sampler.order.tolist() == cpu.order.tolist()


def _run_epoch(sampler, dim=6, seed=0):
    """Iterate one epoch, collecting random features for each batch as the trainer does."""
    rng = np.random.default_rng(seed)
    batches = list(sampler)
    for batch in batches:
        feats = torch.nn.functional.normalize(torch.from_numpy(rng.normal(size=(2, len(batch), dim))).float(), dim=2)
        sampler.collect(torch.tensor(batch), feats[0], feats[1])
    return batches


def test_grit_epochs_are_permutations_of_full_batches():
    sampler = GritSampler(103, 8, search_space=10, queue_size=30, seed=0)
    assert sorted(sampler.order.tolist()) == list(range(103))
    trained = Counter()
    for epoch in range(4):
        batches = _run_epoch(sampler, seed=epoch)
        assert len(batches) == 12 and all(len(b) == 8 for b in batches)
        flat = [i for b in batches for i in b]
        assert len(set(flat)) == 96  # no example twice within an epoch
        trained.update(flat)
        sampler.set_epoch(epoch + 1)
        assert sorted(sampler.order.tolist()) == list(range(103))
    assert len(trained) == 103  # the 7 examples a drop_last epoch leaves out are trained in a later one


def test_grit_mini_batch_shuffle_keeps_groups_intact(monkeypatch):
    sampler = GritSampler(64, 8, search_space=16, queue_size=32, seed=3)
    seen = {}
    shuffle = sampler._minibatch_shuffle

    def spy(g):
        seen["g"] = g.copy()
        return shuffle(g)

    monkeypatch.setattr(sampler, "_minibatch_shuffle", spy)
    _run_epoch(sampler)
    sampler.set_epoch(1)
    chunks = [tuple(seen["g"][a:a + 8]) for a in range(0, 64, 8)]
    new = [tuple(b) for b in sampler]
    assert sorted(new) == sorted(chunks) and new != chunks  # the same groups, in another order
    # and each sub-queue of 16 was grouped by grit_order: consecutive positions of G follow the greedy chain
    assert sorted(seen["g"].tolist()) == list(range(64))


def test_grit_groups_what_was_collected():
    """Sub-queues hold collected examples grouped by grit_order over their collected features."""
    sampler = GritSampler(32, 4, search_space=8, queue_size=8, seed=0)
    img = torch.nn.functional.normalize(torch.randn(32, 5, generator=torch.Generator().manual_seed(0)), dim=1)
    txt = img.clone()  # text j matches image j exactly: the greedy chain stays inside its sub-queue's examples
    for batch in sampler:
        sampler.collect(torch.tensor(batch), img[batch], txt[batch])
    groups = sampler.grouped
    assert len(groups) == 4 and sorted(np.concatenate(groups).tolist()) == list(range(32))
    for grp in groups:
        order = grit_order(img[grp], txt[grp], start=0)
        # the group, re-ordered from its own first element, is the same chain
        assert order.tolist() == list(range(len(grp)))


def test_grit_state_round_trip_gives_the_same_next_epoch(tmp_path):
    a = GritSampler(50, 5, search_space=6, queue_size=14, seed=1)
    rng = np.random.default_rng(0)
    batches = list(a)
    feats = torch.from_numpy(rng.normal(size=(len(batches), 2, 5, 4))).float()
    for b, batch in enumerate(batches[:5]):
        a.collect(torch.tensor(batch), feats[b, 0], feats[b, 1])
    path = tmp_path / "state.pt"
    torch.save(a.state_dict(), path)
    b = GritSampler(50, 5, search_space=6, queue_size=14, seed=99)  # another seed: the state decides
    b.load_state_dict(torch.load(path, weights_only=False))
    for s in (a, b):
        for i, batch in enumerate(batches[5:], start=5):
            s.collect(torch.tensor(batch), feats[i, 0], feats[i, 1])
        s.set_epoch(1)
    assert a.order.tolist() == b.order.tolist()
    with pytest.raises(ValueError, match="in order"):
        a.set_epoch(3)
    state = a.state_dict()
    assert (state["m"], state["l"]) == (6, 14)
    with pytest.raises(ValueError, match=r"GRIT state was built with M = 6, L = 14; this sampler has M = 7, L = 14"):
        GritSampler(50, 5, search_space=7, queue_size=14).load_state_dict(state)
    del state["m"], state["l"]  # a state from before the sizes were saved loads into a sampler of the same sizes
    GritSampler(50, 5, search_space=6, queue_size=14).load_state_dict(state)


# --- end to end on tiny data -------------------------------------------------------------------------------------

N_VAL = sum(in_val(f"shard_{i:09d}", 0.25) for i in range(48))  # the trainer's key-hash validation split
N_TRAIN = 48 - N_VAL
TINY = ["model.text_model=tiny", "model.image_model=tiny", "model.embed_dim=16", "data.image_size=32",
        "data.workers=0", "data.max_len=16", "log_every=1", "optim.warmup_steps=0", "optim.min_lr_ratio=1.0",
        "data.val_frac=0.25"]


@pytest.fixture(scope="module")
def onto(tmp_path_factory):
    return ontology_dataset(tmp_path_factory.mktemp("onto"))


def _run(ds, out, *args):
    sets = [x for s in TINY for x in ("--set", s)]
    return CliRunner().invoke(app, ["run", str(ds), "--out", str(out), "--batch-size", "4", "--device", "cpu",
                                    *sets, *args])


def _rows(out, key):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in rows if key in r}


def test_tonics_instances_split_and_nodes(onto):
    keys = [f"shard_{i:09d}" for i in range(48)]
    is_val = np.arange(48) % 4 == 0
    trip = tonics_instances(onto, keys, is_val, triplets=True)
    train = trip["train"]
    assert not set(train["samples"]) & set(np.flatnonzero(is_val))
    names = [c for c, _ in train["nodes"]]
    assert names == ["cat", "dog", "bird"]
    for c, pos in train["nodes"]:
        assert all(ANIMALS[s % 3] == c for s in train["samples"][pos])
    cat = dict(train["nodes"])["cat"]
    assert len(cat) == 2 * len(set(train["samples"][cat]))  # two triplets per cat image
    samples = tonics_instances(onto, keys, is_val, triplets=False)
    assert len(samples["train"]["samples"]) == 36 and samples["train"]["spans"] is None
    for c, pos in samples["train"]["nodes"]:
        assert all(ANIMALS[s % 3] == c for s in samples["train"]["samples"][pos]) and len(pos) == 12
    with pytest.raises(ValueError, match="does not describe the first shard folder"):
        tonics_instances(onto, ["x"] * 48, is_val, triplets=True)


def test_collate_builds_noun_masks_from_spans():
    tok = build_tokenizer(ModelConfig(text_model="tiny"))
    batch = [(torch.zeros(3), "a red cat number 3 and a pet", "k0", 0, (25, 28)),
             (torch.zeros(3), "a blue dog", "k1", 5, (7, 10))]
    out = Collate(tok, 16)(batch)
    assert out["index"].tolist() == [0, 5]
    pieces = [tok.convert_ids_to_tokens(out["input_ids"][b][out["noun_mask"][b]].tolist()) for b in range(2)]
    assert pieces == [["pet"], ["dog"]]


@pytest.mark.slow  # about 3 s each: a run, its refreshes and a resume
@pytest.mark.parametrize("preset", ["tonics", "tonics-ir"])
def test_tonics_preset_runs_refreshes_and_resumes_exactly(onto, tmp_path, preset):
    common = ["--preset", preset, "--set", "sampler.refresh_every=3", "--set", "sampler.threshold=0",
              "--set", "eval_every=6"]
    r = _run(onto, tmp_path / "full", *common, "--steps", "8")
    assert r.exit_code == 0, r.output + repr(r.exception)
    assert "image    tiny on 32px pixels (frozen)" in r.output  # TOnICS trains on frozen image features
    ckpt = torch.load(tmp_path / "full" / "last.pt", weights_only=True)
    torch.manual_seed(0)
    fresh = build_model(ModelConfig(text_model="tiny", image_model="tiny", embed_dim=16, fusion_layers=0,
                                    aligner=True, freeze_image=True))
    for k, v in fresh.image_encoder.state_dict().items():  # the run's seed-0 image encoder never moved
        assert torch.equal(ckpt["model"]["image_encoder." + k], v), k
    log = json.loads((tmp_path / "full" / "curriculum.json").read_text())
    assert log["nodes"] == ["entity", "cat", "dog", "bird"]
    assert [row["step"] for row in log["log"]] == [3, 6]  # threshold 0: every check refreshes
    assert log["log"][-1]["probs"][0] == pytest.approx(0.81)
    assert (tmp_path / "full" / "curriculum.png").stat().st_size > 0
    assert set(_rows(tmp_path / "full", "total")) == set(range(1, 9))
    assert bool(_rows(tmp_path / "full", "tonics_tr_loss")) == (preset == "tonics")
    # aligner retrieval on the held-out triplets, less the half of the images that the refresh check reads
    assert _rows(tmp_path / "full", "val")[6]["n_val"] == N_VAL - N_VAL // 2

    r = _run(onto, tmp_path / "part", *common, "--steps", "4")  # stops one batch into the second period
    assert r.exit_code == 0, r.output + repr(r.exception)
    r = _run(onto, tmp_path / "part", *common, "--steps", "8", "--resume")
    assert r.exit_code == 0, r.output + repr(r.exception)
    assert _rows(tmp_path / "full", "total") == _rows(tmp_path / "part", "total")  # bit for bit
    assert json.loads((tmp_path / "part" / "curriculum.json").read_text()) == log

    r = CliRunner().invoke(app, ["eval", str(tmp_path / "full" / "last.pt"), str(onto), "--device", "cpu"])
    assert r.exit_code == 0, r.output + repr(r.exception)
    res = json.loads((tmp_path / "full" / "eval.json").read_text())
    assert res["n_samples"] == 48 and 0 <= res["retrieval"]["t2i_r1"] <= res["retrieval"]["t2i_r10"] <= 100


@pytest.mark.parametrize("sampler", ["tonics", "random"])
def test_tonics_refresh_check_never_reads_a_scored_image(onto, sampler):
    """The curriculum's refresh check and the held-out score draw disjoint images of the validation split, and a
    random-batch twin (same seed, same sampler.heldout) scores exactly the TOnICS arm's triplets."""
    from vltrain.config_load import load_config
    from vltrain.trainset import heldout_positions, prepare

    def positions(kind):
        cfg = load_config("tonics", None, TINY + ["sampler.heldout=4"], shards=[str(onto)], steps=4, batch_size=4,
                          **{"sampler.kind": kind})
        cfg, data, _ = prepare(cfg, torch.device("cpu"))
        heldout_positions(cfg, data)
        return data

    data, twin = positions("tonics"), positions(sampler)
    images = lambda pos: {int(data.val.samples[p]) for p in pos}  # noqa: E731
    assert len(data.heldout) == 4 and len(data.val_triplets) == N_VAL - 4
    assert not images(data.heldout) & images(data.val_triplets)
    assert images(data.heldout) | images(data.val_triplets) == set(data.val.samples.tolist())
    assert np.array_equal(twin.val_triplets, data.val_triplets)


def test_tonics_preset_on_vlprep_features_output_finds_its_ontology(onto, tmp_path):
    from vlprep.features import FeaturesConfig, features

    features(FeaturesConfig(src=onto, out=tmp_path / "feat", size=64, device="cpu", decode_threads=0))
    assert not (tmp_path / "feat" / "ontology.json").exists()  # `vlprep features` does not copy it
    r = _run(tmp_path / "feat", tmp_path / "run", "--preset", "tonics", "--set", "sampler.refresh_every=2",
             "--set", "sampler.threshold=0", "--steps", "4")
    assert r.exit_code == 0, r.output + repr(r.exception)
    assert f"tonics: ontology from {onto.resolve()}" in " ".join(r.output.split())
    assert "cached efficientnet-lite0 tokens 4x1280 float16 (frozen" in r.output
    ckpt = torch.load(tmp_path / "run" / "last.pt", weights_only=True)
    assert ckpt["config"]["data"]["input"] == "features" and ckpt["config"]["model"]["freeze_image"]
    assert len(_rows(tmp_path / "run", "curriculum")) == 2


def test_tonics_sampler_on_samples_with_albef_objectives(onto, tmp_path):
    r = _run(onto, tmp_path / "run", "--preset", "albef-base", "--set", "sampler.kind=tonics",
             "--set", "model.fusion_layers=1",
             "--set", "sampler.refresh_every=2", "--set", "sampler.threshold=0", "--steps", "4")
    assert r.exit_code == 0, r.output + repr(r.exception)
    assert set(_rows(tmp_path / "run", "itm_loss")) == {1, 2, 3, 4}
    assert len(_rows(tmp_path / "run", "curriculum")) == 2


def test_grit_preset_runs_and_resumes_exactly(onto, tmp_path):
    # N_TRAIN training pairs, N=4; M=6, L=12: several groupings an epoch, and a remainder at its end
    common = ["--preset", "grit", "--set", "model.fusion_layers=1", "--set", "sampler.search_space=6",
              "--set", "sampler.queue_size=12",
              "--set", "eval_every=100"]
    r = _run(onto, tmp_path / "full", *common, "--steps", "20")
    assert r.exit_code == 0, r.output + repr(r.exception)
    full = _rows(tmp_path / "full", "total")
    assert set(full) == set(range(1, 21)) and "itc_consistency_loss" in json.loads(
        (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()[0])
    ckpt = torch.load(tmp_path / "full" / "last.pt", weights_only=True)
    assert ckpt["epoch"] == 20 // (N_TRAIN // 4) and sorted(ckpt["sampler"]["order"].tolist()) == list(range(N_TRAIN))
    r = _run(onto, tmp_path / "part", *common, "--steps", "13")  # mid-epoch, mid-queue
    assert r.exit_code == 0, r.output + repr(r.exception)
    r = _run(onto, tmp_path / "part", *common, "--steps", "20", "--resume")
    assert r.exit_code == 0, r.output + repr(r.exception)
    assert _rows(tmp_path / "part", "total") == full  # bit for bit, epoch 2 grouped from restored features


def test_grit_default_sizes_and_an_older_checkpoint_keeps_its_own(onto, tmp_path):
    common = ["--preset", "grit", "--set", "model.fusion_layers=1", "--set", "eval_every=100"]
    r = _run(onto, tmp_path / "run", *common, "--steps", "3")
    assert r.exit_code == 0, r.output + repr(r.exception)
    ckpt = torch.load(tmp_path / "run" / "last.pt", weights_only=True)
    assert (ckpt["sampler"]["m"], ckpt["sampler"]["l"]) == (40, 2000)  # N = 4: M = 10 N, L = 50 M (GRIT 5.1)
    del ckpt["sampler"]["m"], ckpt["sampler"]["l"]  # as written before the sizes were saved, when 0 meant 15 N, 25 M
    ckpt_io.save(ckpt, tmp_path / "run" / "last.pt")
    r = _run(onto, tmp_path / "run", *common, "--steps", "4", "--resume")
    assert r.exit_code == 0, r.output + repr(r.exception)
    ckpt = torch.load(tmp_path / "run" / "last.pt", weights_only=True)
    assert (ckpt["sampler"]["m"], ckpt["sampler"]["l"]) == (60, 1500)


def test_sampler_errors_are_one_line(onto, tmp_path):
    r = _run(onto, tmp_path / "a", "--preset", "tonics", "--set", "sampler.ontology=" + str(tmp_path), "--steps", "1")
    assert r.exit_code == 2 and "no ontology.json" in r.output and "Traceback" not in r.output
    r = _run(onto, tmp_path / "b", "--preset", "albef-base", "--set", "sampler.kind=tonics", "--batch-size", "20",
             "--steps", "1")
    assert r.exit_code == 2 and "no ontology class has 20 distinct training images" in r.output
    r = _run(onto, tmp_path / "c", "--set", "sampler.kind=nope", "--steps", "1")
    assert r.exit_code == 2 and "unknown sampler 'nope'" in r.output
