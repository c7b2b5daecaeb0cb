import torch
import torch.nn.functional as F

from vltrain.evaluate import blocked_recall, chance_recall, itm_rerank, recall_at_k, rerank_recall
from vltrain.zeroshot import zeroshot_metrics


def brute_recall(sim, txt2img, k):
    """Re-derivation with plain loops: a query hits when a positive is among its k highest scores."""
    n_img, n_txt = len(sim), len(sim[0])
    i2t = sum(any(txt2img[j] == i for j in sorted(range(n_txt), key=lambda j: -sim[i][j])[:k]) for i in range(n_img))
    t2i = sum(txt2img[j] in sorted(range(n_img), key=lambda i: -sim[i][j])[:k] for j in range(n_txt))
    return 100 * i2t / n_img, 100 * t2i / n_txt


def test_identical_embeddings_give_perfect_recall():
    e = F.normalize(torch.randn(20, 8, generator=torch.Generator().manual_seed(0)), dim=1)
    r = recall_at_k(e @ e.t(), torch.arange(20))
    assert all(v == 100.0 for v in r.values())


def test_recall_matches_brute_force_with_several_captions_per_image():
    g = torch.Generator().manual_seed(1)
    sim = torch.randn(7, 14, generator=g)
    txt2img = torch.tensor([i // 2 for i in range(14)])
    r = recall_at_k(sim, txt2img, ks=(1, 3, 5))
    for k in (1, 3, 5):
        i2t, t2i = brute_recall(sim.tolist(), txt2img.tolist(), k)
        assert abs(r[f"i2t_r{k}"] - round(i2t, 2)) < 1e-6 and abs(r[f"t2i_r{k}"] - round(t2i, 2)) < 1e-6
    assert chance_recall(100, 100) == {"i2t_r1": 1.0, "i2t_r5": 5.0, "i2t_r10": 10.0,
                                       "t2i_r1": 1.0, "t2i_r5": 5.0, "t2i_r10": 10.0}


def test_itm_rerank_fixes_a_wrong_itc_ranking():
    sim = torch.tensor([[0.1, 0.9, 0.0], [0.8, 0.2, 0.0], [0.0, 0.1, 0.5]])  # ITC swaps images 0 and 1
    assert recall_at_k(sim, torch.arange(3))["i2t_r1"] < 100
    oracle = lambda i, j: (i == j).float() * 10  # noqa: E731  an ITM head that knows the answer
    i2t, t2i = itm_rerank(sim, 2, oracle)
    r = rerank_recall(i2t, t2i, torch.arange(3))
    assert r["i2t_r1"] == 100.0 and r["t2i_r1"] == 100.0
    assert (i2t[0] == -100).sum() == 1  # outside the top-k stays at -100


def test_zeroshot_top1_top5():
    classes = torch.eye(6)
    images = F.normalize(torch.eye(6)[[0, 1, 2, 3]] + 0.1 * torch.eye(6)[[1, 0, 0, 0]], dim=1)
    acc = zeroshot_metrics(images, classes, torch.tensor([0, 1, 0, 3]), list("abcdef"))
    assert (acc["top1"], acc["top5"]) == (75.0, 100.0)


def test_drop_images_removes_an_image_and_its_captions_and_renumbers_the_rest():
    from vltrain.evaluate import drop_images

    emb = {"n": 3, "img": torch.eye(3), "txt": torch.arange(12.0).reshape(4, 3), "txt2img": torch.tensor([0, 1, 1, 2]),
           "keys": ["a", "b", "c"], "captions": ["a0", "b0", "b1", "c0"], "ids": torch.arange(8).reshape(4, 2)}
    out = drop_images(emb, {"b"})
    assert out["n"] == 2 and out["keys"] == ["a", "c"] and out["captions"] == ["a0", "c0"]
    assert torch.equal(out["img"], torch.eye(3)[[0, 2]]) and torch.equal(out["txt"], emb["txt"][[0, 3]])
    assert out["txt2img"].tolist() == [0, 1] and out["ids"].tolist() == [[0, 1], [6, 7]]
    assert drop_images(emb, {"z"}) is emb


def test_blocked_recall_equals_the_whole_matrix_in_any_tiling():
    """Scored tile by tile, the ranks are recall_at_k's: with several captions per image, exact ties (small-integer
    embeddings: every dot product is exact in float32, so any tiling computes the same numbers and a tie is a
    tie), a NaN caption and a NaN image."""
    gen = torch.Generator().manual_seed(0)
    n_img = 23
    txt2img = torch.cat([torch.arange(n_img), torch.randint(0, n_img, (17,), generator=gen)])
    img = torch.randint(-2, 3, (n_img, 4), generator=gen).float()  # 5^4 values over 23 rows: ties among images
    txt = img[txt2img] + torch.randint(-1, 2, (len(txt2img), 4), generator=gen).float()
    txt[5] = float("nan")
    img[7] = float("nan")
    want = recall_at_k(img @ txt.t(), txt2img)
    assert 0 < want["i2t_r1"] < 100 and 0 < want["t2i_r1"] < 100  # a test that ranks something
    for block in (1, 3, 7, 16, 1000):
        assert blocked_recall(img, txt, txt2img, block=block) == want


def test_blocked_recall_refuses_what_recall_at_k_refuses():
    img = torch.randn(3, 4)
    txt = torch.randn(3, 4)
    for bad in ([0, 1, 5], [0, 0, 1]):  # an image index out of range; image 2 without a caption
        try:
            blocked_recall(img, txt, torch.tensor(bad))
        except ValueError as e:
            assert "\n" not in str(e)
        else:
            raise AssertionError(f"txt2img {bad} was accepted")
