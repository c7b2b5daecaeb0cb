"""scripts/gpu_faiss.py, the GPU check's faiss step, on a CPU: it reports "no GPU" as a skip; its float32 tolerance
bounds real float32 inner products; its comparison counts ties at the k-th place and nothing else as equal (checked on
hand-made answers and on faiss against a numpy brute force); the whole comparison run CPU against CPU; the report's
faiss row."""

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


def load(name: str):
    spec = importlib.util.spec_from_file_location(name.replace("-", "_") + "_script", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gf():
    return load("gpu_faiss")


@pytest.fixture(scope="module")
def gc():
    return load("gpu_check")


def test_no_gpu_faiss_is_a_skip_that_says_so(gf, tmp_path, capsys):
    import faiss

    assert faiss.get_num_gpus() == 0  # this machine: faiss-cpu
    assert gf.main([str(tmp_path)]) == 0
    row = json.loads((tmp_path / "faiss.jsonl").read_text())
    assert row["status"] == "skipped" and row["gpus"] == 0 and row["faiss"] == faiss.__version__
    assert row["note"] == f"faiss {faiss.__version__} without GPU support: not run"
    assert "knn" not in row and "pseudolabel" not in row
    assert capsys.readouterr().out.startswith("faiss: {")


def test_faiss_missing_is_a_skip_too(gf, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "faiss", None)  # `import faiss` raises ImportError
    assert gf.main([str(tmp_path)]) == 0
    row = json.loads((tmp_path / "faiss.jsonl").read_text())
    assert row["faiss"] is None and row["status"] == "skipped"
    assert row["note"].startswith("faiss not importable (") and row["note"].endswith("): not run")


@pytest.mark.parametrize("d", [64, 512])
def test_tolerance_bounds_float32_inner_products_in_any_order(gf, d):
    u = np.float64(2.0) ** -24
    assert gf.ip_tolerance(d) == pytest.approx(2 * d * u / (1 - d * u), rel=1e-12)
    rng = np.random.default_rng(d)
    x = rng.standard_normal((300, d)).astype(np.float32)
    q = rng.standard_normal((20, d)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    prods = q[:, None, :].astype(np.float64) * x[None, :, :]  # float32 x float32 is exact in float64
    exact = prods.sum(-1)  # float64 rounding, far below float32's
    p32 = (q[:, None, :] * x[None, :, :]).astype(np.float32)
    orders = {"blas": q @ x.T,
              "forward": np.cumsum(p32, axis=-1, dtype=np.float32)[..., -1],
              "reverse": np.cumsum(p32[..., ::-1], axis=-1, dtype=np.float32)[..., -1],
              "pairwise": p32.sum(-1, dtype=np.float32)}
    norms = np.linalg.norm(q.astype(np.float64), axis=1)[:, None] * np.linalg.norm(x.astype(np.float64), axis=1)
    for name, got in orders.items():
        err = np.abs(got.astype(np.float64) - exact)
        assert (err <= gf.ip_tolerance(d, 1.0, 1.0) / 2 * norms * (1 + 1e-6)).all(), name
    assert max(np.abs(a.astype(np.float64) - b).max() for a in orders.values() for b in orders.values()) \
        <= gf.ip_tolerance(d) * norms.max() * (1 + 1e-6)


def test_compare_on_hand_made_answers(gf):
    tol = 1e-5
    base_ids = np.arange(10)
    base_scores = np.linspace(0.9, 0.5, 10).astype(np.float32)
    a_ids = np.tile(base_ids, (6, 1))
    a_scores = np.tile(base_scores, (6, 1))
    b_ids, b_scores = a_ids.copy(), a_scores.copy()
    # q0: identical. q1: B's 10th is id 10, within tol of A's 10th (a tie at the cut). q2: the same, 3 tol above
    # (a mismatch). q3: same ids, one score 2 tol off (a mismatch). q4: B found 9 (a mismatch). q5: B's order of two
    # tied ids swapped (equal sets)
    b_ids[1, 9], b_scores[1, 9] = 10, base_scores[9] + tol / 2
    b_ids[2, 9], b_scores[2, 9] = 10, base_scores[9] + 3 * tol
    b_scores[3, 4] += 2 * tol
    b_ids[4, 9] = -1
    b_ids[5, [3, 4]] = b_ids[5, [4, 3]]
    b_scores[5, 3] = b_scores[5, 4] = base_scores[3]
    a_scores[5, 4] = base_scores[3]
    got = gf.compare(a_scores, a_ids, b_scores, b_ids, tol)
    assert got["queries"] == 6 and got["neighbours"] == 60
    assert got["equal_sets"] == 3  # q0, q3 (sets equal, a score apart), q5; not q1, q2, q4
    assert (got["tie_queries"], got["ties"]) == (1, 1)
    assert got["mismatches"] == 3 and [e["query"] for e in got["examples"]] == [2, 3, 4]
    assert got["max_score_diff"] == pytest.approx(2 * tol, rel=1e-2)  # q3's; q1's and q2's id 10 is not shared


def test_faiss_flat_against_a_numpy_brute_force_differs_by_ties_only(gf):
    """Two real float32 computations of the same top-k (faiss' flat index, numpy's matmul with a sort by score then
    id), with near-ties planted at the cut: compare's ties are exactly the ids the two sets do not share, and each of
    those lies within the tolerance of the k-th score in exact (float64) arithmetic."""
    from vlprep import knn

    d, k = 64, 10
    x = gf.clustered(2000, d, 20, seed=3)
    q = gf.clustered(200, d, 20, seed=4)
    # plant: for each query, a copy of its k-th neighbour nudged by one float32 step in one coordinate, so two ids
    # score within a rounding or two of each other at the cut
    order = np.argsort(-(q.astype(np.float64) @ x.T.astype(np.float64)), axis=1, kind="stable")
    planted = x[order[:, k - 1]].copy()
    planted[:, 0] = np.nextafter(planted[:, 0], np.float32(np.inf))
    x = np.concatenate([x, planted]).astype(np.float32)
    index = knn.build_index(x, "flat")
    fs, fi = knn.search(index, q, k)
    s32 = q @ x.T
    ni = np.stack([np.lexsort((np.arange(len(x)), -row))[:k] for row in s32])
    ns = np.take_along_axis(s32, ni, 1)
    tol = gf.ip_tolerance(d)
    got = gf.compare(fs, fi, ns, ni, tol)
    exact = q.astype(np.float64) @ x.T.astype(np.float64)
    ties = 0
    for r in range(len(q)):
        a, b = set(fi[r].tolist()), set(ni[r].tolist())
        ties += len(a - b)
        kth = np.sort(exact[r])[::-1][k - 1]
        assert all(abs(exact[r, j] - kth) <= tol for j in a ^ b)
    assert got["mismatches"] == 0 and got["ties"] == ties
    assert got["equal_sets"] + got["tie_queries"] == len(q)


@pytest.mark.slow
def test_cpu_against_cpu_runs_the_whole_comparison(gf, tmp_path):
    """The GPU path's every piece (knn flat and IVF, two pseudolabel runs per index kind, the verdict) with device
    cpu on the other side: equal everywhere, and the IVF searches probe fewer lists than there are."""
    from vlprep import knn

    row = gf.faiss_row(tmp_path, "cpu")
    assert row["status"] == "ok", row
    assert [r["index"] for r in row["knn"]] == ["flat", "ivf"]
    for r in row["knn"]:
        assert (r["queries"], r["neighbours"], r["equal_sets"], r["ties"], r["mismatches"]) == (500, 5000, 500, 0, 0)
    assert row["knn"][1]["nprobe"] == knn.DEFAULT_NPROBE < knn.ivf_nlist(gf.N_VECTORS)
    assert [(r["index"], r["files"], r["files_differ"]) for r in row["pseudolabel"]] == [("flat", 4, []),
                                                                                          ("ivf", 4, [])]
    # the stage's own queries searched again: 40 UNALIGNED images x 2 crops, k 5
    for r in row["pseudolabel"]:
        assert (r["queries"], r["neighbours"], r["equal_sets"], r["ties"], r["mismatches"]) == (80, 400, 80, 0, 0)
    assert row["note"] == ("10800 neighbours compared (knn and the stage's queries), 0 tied at the k-th place, 0 "
                           "mismatched; pseudolabel 8 files, 0 differ")
    assert "CPU only in vlprep" in row["near_dup"]


def test_report_has_the_faiss_row(gc, tmp_path):
    def write(name, rows):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))

    knn_rows = [{"index": "flat", "neighbours": 5000, "ties": 2, "mismatches": 0},
                {"index": "ivf", "neighbours": 5000, "ties": 1, "mismatches": 3}]
    pseudo = [{"index": "flat", "files": 4, "files_differ": [], "neighbours": 400, "ties": 1, "mismatches": 0},
              {"index": "ivf", "files": 4, "files_differ": ["a"], "neighbours": 400, "ties": 0, "mismatches": 2}]
    write("steps.jsonl", [{"step": "faiss", "rc": 1, "seconds": 20}])
    write("faiss.jsonl", [{"kind": "faiss", "faiss": "1.9.0", "gpus": 1, "knn": knn_rows, "pseudolabel": pseudo,
                           "near_dup": "CPU only", "status": "FAILED", "note": "n", "seconds": 20.5},
                          {"kind": "faiss", "faiss": None, "gpus": 0, "status": "skipped", "note": "m"}])
    assert gc.report(tmp_path) == 1
    table = (tmp_path / "gpu-check.md").read_text()
    assert ("| 1.9.0 | 1 | knn flat, knn ivf, pseudolabel flat, pseudolabel ivf | 10800 | 4 | 5 | 1 of 8 | FAILED: n "
            "| 20.5 |") in table
    assert "| | | near-dup: CPU only | | | | | | |" in table
    assert "| not importable | 0 | nothing |  |  |  |  | skipped: m |  |" in table
    assert json.loads((tmp_path / "gpu-check.json").read_text())["faiss"][0]["knn"] == knn_rows


@pytest.mark.parametrize("rc, line", [(None, "(faiss: not run in this check)"),
                                      (124, "(no faiss rows: faiss.jsonl missing or empty; step faiss rc 124, see "
                                            "its log)")])
def test_report_without_a_faiss_row_says_why(gc, tmp_path, rc, line):
    steps = [{"step": "env", "rc": 0, "seconds": 1}] + ([{"step": "faiss", "rc": rc, "seconds": 60}] if rc else [])
    (tmp_path / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    gc.report(tmp_path)
    assert line in (tmp_path / "gpu-check.md").read_text()
