"""The papers' evaluation protocol: multi-caption retrieval R@K, its chance level, batched ITM re-ranking and the
zero-shot prompt ensemble, each against a straightforward re-derivation (and recall against clip_benchmark)."""

import math

import pytest
import torch
import torch.nn.functional as F

from vltrain.config import ModelConfig
from vltrain.evaluate import chance_recall, itm_rerank, recall_at_k, rerank_recall
from vltrain.model import build_model, tokenizer_for
from vltrain.zeroshot import DEFAULT_TEMPLATES, class_embeddings, zeroshot_metrics


def brute_recall(sim, txt2img, k):
    """Loops: an image hits when fewer than k captions of other images score at least as high as its best caption;
    a caption hits when fewer than k other images score at least as high as its own image (ties count against)."""
    n_img, n_txt = len(sim), len(sim[0])
    i2t = 0
    for i in range(n_img):
        best = max(sim[i][j] for j in range(n_txt) if txt2img[j] == i)
        i2t += sum(1 for j in range(n_txt) if txt2img[j] != i and sim[i][j] >= best) < k
    t2i = 0
    for j in range(n_txt):
        own = sim[txt2img[j]][j]
        t2i += sum(1 for i in range(n_img) if i != txt2img[j] and sim[i][j] >= own) < k
    return round(100 * i2t / n_img, 2), round(100 * t2i / n_txt, 2)


def old_recall(sim, n):
    """The one-caption-per-image recall vltrain computed before multi-caption retrieval (argsort ranks)."""
    positive = torch.eye(n, dtype=torch.bool)
    first_hit = positive.gather(1, sim.argsort(dim=1, descending=True)).float().argmax(dim=1)
    rank_t2i = (sim.t().argsort(dim=1, descending=True) == torch.arange(n)[:, None]).float().argmax(dim=1)
    out = {}
    for k in (1, 5, 10):
        out[f"i2t_r{k}"] = round(100 * (first_hit < k).float().mean().item(), 2)
        out[f"t2i_r{k}"] = round(100 * (rank_t2i < k).float().mean().item(), 2)
    out["mean_recall"] = round(sum(out.values()) / len(out), 2)
    return out


# Image 0 has captions 0-2, image 1 has 3-4, image 2 has 5-9: 2 to 5 captions per image.
TXT2IMG = [0, 0, 0, 1, 1, 2, 2, 2, 2, 2]
HAND = [
    # caption 0 ranks first for image 0 and caption 2 last: image 0 still hits at R@1
    [0.9, 0.1, -0.9, 0.5, 0.2, 0.3, 0.0, 0.0, -0.1, 0.4],
    # image 1's best caption (0.5) ties with a caption of image 2 (0.5): the tie counts against it, R@1 misses
    [0.2, 0.0, 0.1, 0.5, 0.3, 0.5, 0.1, 0.1, 0.0, 0.2],
    # image 2's captions are spread: its best (0.6) is beaten by nothing
    [0.1, 0.2, 0.0, 0.1, 0.3, 0.6, -0.5, 0.2, 0.3, 0.1],
]


def test_multi_caption_recall_on_a_hand_built_matrix_with_ties():
    sim = torch.tensor(HAND, dtype=torch.float64)
    r = recall_at_k(sim, torch.tensor(TXT2IMG), ks=(1, 2, 3))
    for k in (1, 2, 3):
        assert (r[f"i2t_r{k}"], r[f"t2i_r{k}"]) == brute_recall(HAND, TXT2IMG, k)
    # By hand: image→text R@1 is 2 of 3 (image 1's tie loses); at R@2 all three hit.
    assert r["i2t_r1"] == round(100 * 2 / 3, 2) and r["i2t_r2"] == 100.0
    # Text→image R@1 by hand, column by column (the caption's own image must beat both others strictly):
    # c0 .9 > .2, .1 yes; c1 .1 < .2 no; c2 -.9 no; c3 .5 ties image 0's .5 no; c4 .3 ties image 2's .3 no;
    # c5 .6 > .3, .5 yes; c6 -.5 no; c7 .2 > .0, .1 yes; c8 .3 > -.1, .0 yes; c9 .1 < .4 no -> 4 of 10.
    assert r["t2i_r1"] == 40.0
    assert r["mean_recall"] == round(sum(v for k_, v in r.items() if k_ != "mean_recall") / 6, 2)


@pytest.mark.parametrize("seed", range(5))
def test_multi_caption_recall_matches_loops_on_random_matrices_with_many_ties(seed):
    g = torch.Generator().manual_seed(seed)
    n_img = 9
    per = torch.randint(2, 6, (n_img,), generator=g)  # 2..5 captions per image
    txt2img = torch.repeat_interleave(torch.arange(n_img), per)
    txt2img = txt2img[torch.randperm(len(txt2img), generator=g)]  # captions not grouped by image
    sim = torch.randint(0, 4, (n_img, len(txt2img)), generator=g).double()  # 4 levels: ties everywhere
    r = recall_at_k(sim, txt2img, ks=(1, 3, 5))
    for k in (1, 3, 5):
        assert (r[f"i2t_r{k}"], r[f"t2i_r{k}"]) == brute_recall(sim.tolist(), txt2img.tolist(), k)


def test_one_caption_per_image_gives_the_old_numbers_exactly():
    for seed in range(3):
        n = 37
        # distinct scores (a permutation), so the old argsort ranks are well defined
        sim = torch.randperm(n * n, generator=torch.Generator().manual_seed(seed)).view(n, n).float()
        assert recall_at_k(sim, torch.arange(n)) == old_recall(sim, n)


def test_recall_against_clip_benchmark():
    """clip_benchmark 1.6.2 (clip_benchmark.metrics.zeroshot_retrieval.recall_at_k), an independent implementation
    of the same protocol: a query is a hit when one of its positives is in its top k."""
    from clip_benchmark.metrics.zeroshot_retrieval import recall_at_k as cb_recall

    g = torch.Generator().manual_seed(3)
    n_img = 40
    txt2img = torch.repeat_interleave(torch.arange(n_img), torch.randint(1, 6, (n_img,), generator=g))
    n_txt = len(txt2img)
    sim = torch.randperm(n_img * n_txt, generator=g).view(n_img, n_txt).double()  # no ties: topk is unambiguous
    ours = recall_at_k(sim, txt2img)
    positive = torch.zeros(n_txt, n_img, dtype=torch.bool)
    positive[torch.arange(n_txt), txt2img] = True
    for k in (1, 5, 10):
        image_retrieval = (cb_recall(sim.t(), positive, k) > 0).double().mean().item()  # text -> image
        text_retrieval = (cb_recall(sim, positive.t(), k) > 0).double().mean().item()  # image -> text
        assert ours[f"t2i_r{k}"] == round(100 * image_retrieval, 2)
        assert ours[f"i2t_r{k}"] == round(100 * text_retrieval, 2)


def test_nan_scores_rank_last_and_an_image_without_captions_is_an_error():
    sim = torch.tensor([[float("nan"), 0.0], [0.0, 1.0]])
    r = recall_at_k(sim, torch.arange(2), ks=(1,))
    assert r["i2t_r1"] == 50.0 and r["t2i_r1"] == 50.0  # image 0 / caption 0 miss: their positive is NaN
    with pytest.raises(ValueError, match="at least one caption"):
        recall_at_k(torch.zeros(3, 2), torch.tensor([0, 0]))


def test_chance_recall_with_several_captions_per_image():
    per = [1, 2, 5]
    n_txt = sum(per)
    got = chance_recall(3, n_txt, ks=(1, 2, 5), captions_per_image=per)
    for k in (1, 2, 5):
        # P(at least one of c right captions among k drawn without replacement from n_txt)
        want = sum(1 - math.comb(n_txt - c, k) / math.comb(n_txt, k) for c in per) / 3
        assert got[f"i2t_r{k}"] == round(100 * want, 2)
        assert got[f"t2i_r{k}"] == round(100 * min(1, k / 3), 2)
    assert chance_recall(100, 100) == {"i2t_r1": 1.0, "i2t_r5": 5.0, "i2t_r10": 10.0,
                                       "t2i_r1": 1.0, "t2i_r5": 5.0, "t2i_r10": 10.0}


def test_batched_itm_rerank_equals_a_query_by_query_rerank_and_scores_each_pair_once():
    g = torch.Generator().manual_seed(0)
    n_img, k = 6, 3
    txt2img = torch.repeat_interleave(torch.arange(n_img), 3)
    sim = torch.randperm(n_img * 18, generator=g).view(n_img, 18).double() / 100
    table = torch.randn(n_img, 18, generator=g, dtype=torch.float64)  # the ITM logit of each pair
    calls = []

    def itm(i, j):
        calls.append(len(i))
        return table[i, j]

    i2t, t2i = itm_rerank(sim, k, itm, batch=4)
    assert max(calls) <= 4
    top_t, top_i = sim.topk(k, dim=1).indices, sim.topk(k, dim=0).indices
    union = ({(i, int(j)) for i in range(n_img) for j in top_t[i]}
             | {(int(i), j) for j in range(18) for i in top_i[:, j]})
    assert sum(calls) == len(union)  # a pair in the top-k of both directions is scored once
    want_i2t = torch.full_like(sim, -100.0)
    for i in range(n_img):
        for j in top_t[i]:
            want_i2t[i, j] = table[i, j]
    want_t2i = torch.full_like(sim, -100.0)
    for j in range(18):
        for i in top_i[:, j]:
            want_t2i[i, j] = table[i, j]
    assert torch.equal(i2t, want_i2t) and torch.equal(t2i, want_t2i)
    r = rerank_recall(i2t, t2i, txt2img)
    assert set(r) == {"i2t_r1", "i2t_r5", "i2t_r10", "t2i_r1", "t2i_r5", "t2i_r10", "mean_recall"}


def test_zero_shot_template_ensemble_against_a_hand_computation():
    torch.manual_seed(0)
    model = build_model(ModelConfig(text_model="tiny", image_model="tiny", embed_dim=16, fusion_layers=0)).eval()
    tok = tokenizer_for("tiny")
    names, templates = ["cat", "red car", "tree"], ["a photo of a {}.", "art of the {}", "{} {}"]
    got = class_embeddings(model, names, templates, max_len=16, device=torch.device("cpu"), batch_size=4)
    for c, name in enumerate(names):
        embs = []
        for t in templates:  # one prompt at a time: no padding, no batching
            enc = tok([t.replace("{}", name)], return_tensors="pt")
            with torch.no_grad():
                embs.append(F.normalize(model.encode_text(enc["input_ids"], enc["attention_mask"])[1][0], dim=0))
        want = F.normalize(torch.stack(embs).mean(dim=0), dim=0)
        # float32 through a 2-layer encoder, padded vs unpadded rows: rounding only (~1e-6 per unit vector entry)
        assert torch.allclose(got[c], want, atol=1e-5), (name, (got[c] - want).abs().max())
    assert len(DEFAULT_TEMPLATES) == 7 and all("{}" in t for t in DEFAULT_TEMPLATES)


def test_zero_shot_metrics_top5_mean_per_class_and_confusions_by_hand():
    names = ["a", "b", "c", "d", "e", "f", "g"]
    classes = torch.eye(7)
    # logits = image rows directly (the class embeddings are the identity)
    images = torch.tensor([
        [5, 1, 0, 0, 0, 0, 0],   # label a: right
        [1, 5, 0, 0, 0, 0, 0],   # label a: predicted b (a is 2nd)
        [0, 5, 1, 0, 0, 0, 0],   # label c: predicted b
        [0, 5, 0, 1, 0, 0, 0],   # label c: predicted b; b and d beat c, 4 others tie with it (against it): rank 6
        [2, 0, 0, 0, 0, 0, 2],   # label g: tied with a at the top: counts against, a miss (confused with a)
    ], dtype=torch.float64)
    labels = torch.tensor([0, 0, 2, 2, 6])
    m = zeroshot_metrics(images, classes.double(), labels, names)
    assert m["top1"] == 20.0
    assert m["top5"] == 80.0  # all but image 3
    # per class: a 1/2, c 0/2, g 0/1 -> mean over the 3 classes present
    assert m["mean_per_class"] == round(100 * (0.5 + 0 + 0) / 3, 2)
    assert m["confusions"][0] == {"true": "c", "predicted": "b", "count": 2}
    assert {"true": "a", "predicted": "b", "count": 1} in m["confusions"]
    assert len(m["confusions"]) == 3
