"""pipelines/verdicts.py: power, rounding, NaN metrics, a paper effect of 0, zero variance; README tables render."""

import math
import re
import sys
from pathlib import Path

import pytest
from scipy import integrate, stats

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "pipelines"))  # verdicts.py is a sibling script of the pipelines, not a package
import verdicts  # noqa: E402


def reference_power(n: int, sd: float, effect: float, alpha: float) -> float:
    """P(|T| > crit) for T = (Z + ncp) / sqrt(V / df), V ~ chi2(df): integrated over V, with no noncentral t."""
    df = n - 1
    ncp = abs(effect) * math.sqrt(n) / sd
    crit = stats.t.ppf(1 - alpha / 2, df)

    def given_v(v):
        scale = crit * math.sqrt(v / df)
        return (stats.norm.cdf(ncp - scale) + stats.norm.cdf(-ncp - scale)) * stats.chi2.pdf(v, df)

    return integrate.quad(given_v, 0, math.inf, epsabs=1e-12, epsrel=1e-10, limit=200)[0]


def smallest_n(sd: float, effect: float, alpha: float) -> int:
    return next(n for n in range(2, 200) if reference_power(n, sd, effect, alpha) >= verdicts.POWER)


def rows_of(arms: dict[str, list[float]], metric: str = "m") -> list[dict]:
    return [{"arm": arm, "seed": s, metric: x} for arm, xs in arms.items() for s, x in enumerate(xs)]


def finding(effect, better="b", than="c"):
    return {"paper": f"{better}>{than}", "better": better, "than": than, "metric": "m", "paper_effect": effect}


def test_power_is_the_exact_noncentral_t_where_scipy_loses_the_lower_tail():
    # scipy's nct.cdf(-crit) is NaN here for n >= 3; the normal approximation that replaced the whole power said 4
    sd, effect, alpha = 0.1443, 0.6, 0.05 / 8
    assert verdicts.seeds_needed(sd, effect, alpha) == smallest_n(sd, effect, alpha) == 5
    assert reference_power(4, sd, effect, alpha) == pytest.approx(0.762, abs=5e-4)
    for n in range(2, 9):
        assert verdicts.t_power(n, sd, effect, alpha) == pytest.approx(reference_power(n, sd, effect, alpha),
                                                                      abs=1e-7)


def test_seeds_needed_uses_the_unrounded_sd():
    # differences [0.0249, 0, -0.0249]: sd 0.0249, stored as 0.02; 2 tests (against 0 and the paper's 0.1)
    (f,) = verdicts.judge([finding(0.1)], rows_of({"b": [0.0249, 0.0, -0.0249], "c": [0.0, 0.0, 0.0]}))
    assert f["sd"] == 0.02
    assert f["seeds_needed"] == smallest_n(0.0249, 0.1, 0.05 / 2) == 4


def test_mechanisms_seeds_for_power_use_the_unrounded_difference_and_sd():
    import mechanisms

    d = [0.0749, 0.05, 0.0251]  # mean 0.05, sd 0.0249 (rounded: 0.05 and 0.02)
    rows = rows_of({"grit-grouped": d, "grit-random": [0.0, 0.0, 0.0]}, "hardest_negative_cos")
    (f,) = mechanisms.judge(rows, ["grit"])  # one finding, one test
    assert (f["diff"], f["sd"]) == (0.05, 0.02)
    assert f["seeds_for_power"] == smallest_n(0.0249, 0.05, 0.05) != smallest_n(0.02, 0.05, 0.05)


def test_a_holm_p_just_under_five_percent_is_significant_though_it_rounds_to_it():
    # diffs m - 1, m, m + 1: sd 1, so t = m sqrt(3); m chosen for a two-sided p of 0.04997 (one test: no adjustment)
    m = stats.t.isf(0.04997 / 2, 2) / math.sqrt(3)
    (f,) = verdicts.judge([finding(None)], rows_of({"b": [m - 1, m, m + 1], "c": [0.0, 0.0, 0.0]}))
    assert f["p_zero"] == 0.05 and f["verdict"] == "agrees"


def test_a_small_consistent_difference_on_the_papers_side_agrees_though_it_rounds_to_zero():
    (f,) = verdicts.judge([finding(1.0)], rows_of({"b": [0.0041, 0.0042, 0.0040], "c": [0.0, 0.0, 0.0]}))
    assert f["diff"] == 0.0 and f["p_zero"] < 0.05 and f["verdict"] == "agrees"


def test_a_nan_metric_gets_its_own_label_and_leaves_the_holm_family():
    arms = {"b": [1.0, 1.2, 0.9, 1.1], "c": [0.0, 0.1, -0.1, 0.05], "n": [0.0, math.nan, 0.1, 0.0]}
    rows = rows_of(arms)
    clean = [finding(0.5), finding(None, "c", "b")]
    want = verdicts.judge(clean, rows)
    for at, effect in ((0, 0.5), (1, None), (2, 0.5), (0, None), (2, None)):  # first, between, last
        got = verdicts.judge(clean[:at] + [finding(effect, "b", "n")] + clean[at:], rows)
        nan = got.pop(at)
        assert nan["verdict"] == verdicts.NAN_METRIC and nan["nan_seeds"] == [1] and "p_zero" not in nan
        assert nan["diff"] is None and nan["seeds_needed"] is None
        assert got == want  # the others' p-values and verdicts are the clean family's, wherever the NaN one sits
    with pytest.raises(ValueError, match="NaN"):
        verdicts.holm([math.nan, 0.001, 0.01])


def test_a_paper_effect_of_zero_predicts_no_side_and_is_one_test():
    up = rows_of({"b": [1.0, 1.2, 0.9, 1.1], "c": [0.0, 0.1, -0.1, 0.05]})
    (f,) = verdicts.judge([finding(0.0)], up)
    diffs = verdicts.paired_differences(up, "b", "c", "m")[0]
    assert f["verdict"] == "disagrees" and "p_paper" not in f
    assert f["p_zero"] == round(verdicts.t_pvalue(diffs), 4)  # one test in the family: Holm leaves it as it is
    (f,) = verdicts.judge([finding(0.0, "c", "b")], up)
    assert f["verdict"] == "disagrees"
    (f,) = verdicts.judge([finding(0.0)], rows_of({"b": [0.1, -0.2, 0.15, -0.05], "c": [0.0, 0.0, 0.0, 0.0]}))
    assert f["verdict"] == "inconclusive" and f["seeds_needed"] is None


def test_differences_without_variance_get_no_verdict_and_leave_the_family():
    same = rows_of({"b": [2.1, 2.2, 2.3], "c": [1.1, 1.2, 1.3]})  # each difference 1, up to float rounding
    (f,) = verdicts.judge([finding(None)], same)
    assert f["verdict"] == "no variance: more seeds or a finer metric"  # was "agrees" at p = 0
    assert "p_zero" not in f and f["seeds_needed"] is None
    zeros = rows_of({"b": [1.0, 2.0, 3.0], "c": [1.0, 2.0, 3.0], "x": [1.5, 2.4, 3.7]})
    got = verdicts.judge([finding(2.0), finding(None, "x", "c")], zeros)
    assert got[0]["verdict"] == verdicts.NO_VARIANCE  # was "rules out the paper's effect" with an interval [0, 0]
    assert got[1] == verdicts.judge([finding(None, "x", "c")], zeros)[0]
    assert math.isnan(verdicts.t_pvalue([1.0, 1.0, 1.0]))
    assert verdicts.no_variance(verdicts.paired_differences(same, "b", "c", "m")[0])


def markdown_tables(text: str) -> list[list[str]]:
    """Each run of consecutive lines that start with '|'."""
    tables = []
    previous = False
    for line in text.splitlines():
        if line.startswith("|"):
            if not previous:
                tables.append([])
            tables[-1].append(line)
        previous = line.startswith("|")
    return tables


def assert_renders(table: list[str]) -> None:
    cells = [line.strip().count("|") for line in table]
    assert len(table) >= 2 and re.fullmatch(r"\|(---\|)+", table[1]), table[:2]
    assert cells == [cells[0]] * len(table), table[0]  # a header run into the previous table changes the count


def test_every_table_in_the_pipelines_readme_renders():
    for table in markdown_tables((ROOT / "pipelines" / "README.md").read_text()):
        assert_renders(table)


def test_the_mechanisms_table_renders(tmp_path):
    import mechanisms

    rows = rows_of({"grit-grouped": [35.1, 35.3, 35.2], "grit-random": [28.0, 28.5, 28.4]},
                   "hardest_negative_cos")
    findings = verdicts.judge([f for f in mechanisms.FINDINGS if f["check"] == "grit"], rows)
    meta = {"command": "mechanisms.py", "date": "today", "seeds": [0, 1, 2],
            "checks": {"grit": {"seeds": [0, 1, 2], "seconds": 1.0, "per_seed": {"2": {"batches": 3}}}}}
    mechanisms.write_outputs(tmp_path / "results.json", tmp_path / "table.md", rows, findings, meta)
    tables = markdown_tables((tmp_path / "table.md").read_text())
    assert len(tables) == 2
    for table in tables:
        assert_renders(table)


def test_mechanisms_rescore_judges_the_stored_rows_again_and_writes_the_table_beside_them(tmp_path):
    import json

    import mechanisms

    rows = rows_of({"grit-grouped": [35.1, 35.3, 35.2], "grit-random": [28.0, 28.5, 28.4]},
                   "hardest_negative_cos")
    meta = {"command": "mechanisms.py", "date": "today", "seeds": [0, 1, 2],
            "checks": {"grit": {"seeds": [0, 1, 2], "seconds": 1.0, "per_seed": {"2": {"batches": 3}}}}}
    stale = [dict(f, verdict="inconclusive", seeds_for_power=999) for f in mechanisms.judge(rows, ["grit"])]
    path = tmp_path / "mechanisms.json"
    mechanisms.write_outputs(path, tmp_path / "old.md", rows, stale, meta)
    assert mechanisms.main(["--rescore", str(path)]) == 0
    again = json.loads(path.read_text())
    assert again["findings"] == mechanisms.judge(rows, ["grit"]) and again["rows"] == rows
    assert again["checks"] == meta["checks"] and "agrees" in (tmp_path / "mechanisms.md").read_text()
    assert mechanisms.main(["--rescore", str(tmp_path / "missing.json")]) == 2


def test_near_chance_reads_a_nan_score_as_no_score():
    """An arm whose seeds scored NaN (a failed metric) is not on the metric's floor: its mean would be NaN, and NaN
    compares false with everything, which used to read as "under 3x chance"."""
    import ablation

    low = [{"arm": a, "seed": s, "i2t_r1": 2.0, "chance_r1": 1.0} for a in ("base", "new") for s in (1, 2)]
    assert ablation.near_chance("i2t_r1", low)
    nan = [{**r, "i2t_r1": math.nan} if r["arm"] == "new" else r for r in low]
    assert not ablation.near_chance("i2t_r1", nan)
    one = [{**r, "i2t_r1": math.nan} if (r["arm"], r["seed"]) == ("new", 1) else r for r in low]
    assert ablation.near_chance("i2t_r1", one)  # the other seed still scores, under 3x chance
