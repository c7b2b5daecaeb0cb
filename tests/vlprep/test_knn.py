"""vlprep.knn: flat and IVF inner-product indexes, the auto rule, GPU only when faiss has one."""

import numpy as np
import pytest

from vlprep import knn


def unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def test_flat_knn_equals_brute_force_numpy():
    rng = np.random.default_rng(0)
    x, q = unit(rng.standard_normal((700, 24))), unit(rng.standard_normal((60, 24)))
    index = knn.build_index(x, "flat")
    scores, ids = knn.search(index, q, 10)
    sim = q @ x.T
    expected = np.argsort(-sim, axis=1, kind="stable")[:, :10]
    assert (ids == expected).all()
    np.testing.assert_allclose(scores, np.take_along_axis(sim, expected, axis=1), rtol=1e-5, atol=1e-6)
    assert knn.kind_of(index) == "flat" and knn.set_nprobe(index, 8) == 0


def test_ivf_recall_at_10_on_clustered_data():
    # 200 topics; a point is its topic's centre plus noise of norm ~0.8 (cosine ~0.7 to its 10th neighbour)
    rng = np.random.default_rng(1)
    centres = unit(rng.standard_normal((200, 64)))
    x = unit(centres[rng.integers(0, 200, 20_000)] + 0.1 * rng.standard_normal((20_000, 64)))
    q = unit(centres[rng.integers(0, 200, 400)] + 0.1 * rng.standard_normal((400, 64)))
    flat_ids = knn.search(knn.build_index(x, "flat"), q, 10)[1]
    ivf = knn.build_index(x, "ivf")
    assert knn.kind_of(ivf) == "ivf" and knn.nlist(ivf) == knn.ivf_nlist(20_000) == 512
    assert knn.set_nprobe(ivf, knn.DEFAULT_NPROBE) == knn.DEFAULT_NPROBE
    ivf_ids = knn.search(ivf, q, 10)[1]
    recall = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(flat_ids, ivf_ids)])
    assert recall >= 0.95, recall
    assert knn.set_nprobe(ivf, 1) == 1  # far fewer lists: recall drops, so the setting is really applied
    low = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(flat_ids, knn.search(ivf, q, 10)[1])])
    assert low < recall


def test_auto_rule_and_list_count():
    assert knn.choose_kind("auto", knn.FLAT_MAX - 1) == "flat" and knn.choose_kind("auto", knn.FLAT_MAX) == "ivf"
    assert knn.choose_kind("ivf", 10) == "ivf" and knn.choose_kind("flat", 10**9) == "flat"
    assert knn.ivf_nlist(10**6) == 4000 and knn.ivf_nlist(2000) == 51 and knn.ivf_nlist(5) == 1
    with pytest.raises(ValueError, match="auto, flat, ivf"):
        knn.choose_kind("hnsw", 10)
    # a tiny forced IVF (one list) still returns the exact neighbours
    x = unit(np.random.default_rng(2).standard_normal((20, 8)))
    assert (knn.search(knn.build_index(x, "ivf"), x[:3], 1)[1][:, 0] == [0, 1, 2]).all()


def test_gpu_only_when_faiss_has_one_and_device_allows():
    import faiss

    assert knn.use_gpu("cpu") is False
    assert knn.use_gpu("auto") == (hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0)


@pytest.mark.skipif(not hasattr(__import__("faiss"), "StandardGpuResources")
                    or __import__("faiss").get_num_gpus() == 0, reason="needs faiss-gpu and a GPU")
def test_gpu_index_matches_cpu():
    x = unit(np.random.default_rng(3).standard_normal((1000, 32)))
    for kind in ("flat", "ivf"):
        cpu = knn.build_index(x, kind)
        nprobe = knn.set_nprobe(cpu, 4)
        gpu = knn.to_gpu(cpu, nprobe)
        a, b = knn.search(gpu, x[:50], 5)[1], knn.search(cpu, x[:50], 5)[1]
        assert knn.on_gpu(gpu) and np.mean([len(set(p) & set(q)) / 5 for p, q in zip(a, b)]) >= 0.98


def test_save_and_load_round_trip(tmp_path):
    x = unit(np.random.default_rng(1).standard_normal((100, 8)))
    index = knn.build_index(x, "flat")
    knn.save_index(index, tmp_path / "i.faiss")
    again = knn.load_index(tmp_path / "i.faiss")
    assert not (tmp_path / "i.faiss.tmp").exists() and again.ntotal == 100
    assert (knn.search(again, x[:5], 3)[1] == knn.search(index, x[:5], 3)[1]).all()
    with pytest.raises(ValueError, match="index must be one of"):
        knn.choose_kind("hnsw", 10)
