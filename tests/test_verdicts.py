"""pipelines/verdicts.py: power, rounding, NaN metrics, a paper effect of 0, zero variance, the labels that rise with the
evidence (smaller/larger than the paper's), tie claims by TOST, relative shares, the power range, seed plans, and the
README's tables (they render and equal the results files)."""

import math
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import integrate, special, stats

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "pipelines"))  # verdicts.py is a sibling script of the pipelines, not a package
import verdicts  # noqa: E402


def reference_power(n: int, sd: float, effect: float, alpha: float) -> float:
    """P(|T| > crit) for T = (Z + ncp) / sqrt(V / df), V ~ chi2(df): integrated over V, with no noncentral t.

    The integrand takes scipy.stats' own formulas from scipy.special (norm.cdf is ndtr; chi2.pdf is exp of
    xlogy(df/2 - 1, v) - v/2 - gammaln(df/2) - df log(2)/2, as chi2._logpdf), without the distribution objects'
    argument handling, ~0.3 ms per call of the ~300 a quad makes."""
    df = n - 1
    ncp = abs(effect) * math.sqrt(n) / sd
    crit = stats.t.ppf(1 - alpha / 2, df)
    log_norm = special.gammaln(df / 2) + math.log(2) * df / 2

    def given_v(v):
        scale = crit * math.sqrt(v / df)
        return (special.ndtr(ncp - scale) + special.ndtr(-ncp - scale)) * math.exp(
            special.xlogy(df / 2 - 1, v) - v / 2 - log_norm)

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


def test_mechanisms_report_no_post_hoc_power():
    """A power at our own observed difference is a function of the p-value: the mechanisms table has no such column
    and its findings no such field."""
    import mechanisms

    rows = rows_of({"grit-grouped": [0.0749, 0.05, 0.0251], "grit-random": [0.0, 0.0, 0.0]}, "hardest_negative_cos")
    (f,) = mechanisms.judge(rows, ["grit"])
    assert "seeds_for_power" not in f and f["seeds_needed"] is None and f["seeds_range"] is None
    assert not any("power" in h for h in mechanisms.HEAD)


def test_a_holm_p_just_under_five_percent_is_significant_though_it_rounds_to_it():
    # diffs m - 1, m, m + 1: sd 1, so t = m sqrt(3); m chosen for a two-sided p of 0.04997 (one test: no adjustment)
    m = stats.t.isf(0.04997 / 2, 2) / math.sqrt(3)
    (f,) = verdicts.judge([finding(None)], rows_of({"b": [m - 1, m, m + 1], "c": [0.0, 0.0, 0.0]}))
    assert f["p_zero"] == 0.05 and f["verdict"] == "agrees"


def test_a_small_consistent_difference_on_the_papers_side_agrees_though_it_rounds_to_zero():
    (f,) = verdicts.judge([finding(1.0)], rows_of({"b": [0.0041, 0.0042, 0.0040], "c": [0.0, 0.0, 0.0]}))
    assert f["diff"] == 0.0 and f["p_zero"] < 0.05 and f["verdict"] == verdicts.SMALLER  # on the paper's side


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
    stale = [dict(f, verdict="inconclusive") for f in mechanisms.judge(rows, ["grit"])]
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


# --- the labels that rise with the evidence ---------------------------------------------------------------------


def test_a_significant_effect_smaller_than_the_papers_has_its_own_label_and_more_noise_reads_rules_out():
    tight = [0.49, 0.5, 0.51]  # +0.5 [0.48, 0.52] against a paper effect of +5: both tests reject
    (f,) = verdicts.judge([finding(5.0)], rows_of({"b": tight, "c": [0.0] * 3}))
    assert f["verdict"] == verdicts.SMALLER == "agrees in direction, smaller than the paper's"
    noisy = [-1.0, 0.0, 0.5, 1.0, 2.0]  # the same mean, sd 1.1: not apart from 0, still apart from +5
    (f,) = verdicts.judge([finding(5.0)], rows_of({"b": noisy, "c": [0.0] * 5}))
    assert f["verdict"] == "rules out the paper's effect"
    (f,) = verdicts.judge([finding(0.1)], rows_of({"b": tight, "c": [0.0] * 3}))
    assert f["verdict"] == verdicts.LARGER  # significantly beyond the paper's +0.1
    (f,) = verdicts.judge([finding(0.5)], rows_of({"b": tight, "c": [0.0] * 3}))
    assert f["verdict"] == "agrees"  # the paper's size is not rejected
    (f,) = verdicts.judge([finding(-5.0)], rows_of({"b": tight, "c": [0.0] * 3}))
    assert f["verdict"] == "disagrees"


# --- tie claims: two one-sided tests --------------------------------------------------------------------------------


def tie(margin, effect=-0.3):
    return {**finding(effect), "tie_margin": margin}


def test_tost_p_values_equal_scipy_one_sided_tests_and_the_interval_duality():
    """The same 200 random cases as one loop drew them; scipy's ttest_1samp runs once per sample size on the cases of
    that size (axis=1: the same test on each row, ~2 ms per call either way), not four times per case."""
    rng = np.random.default_rng(3)
    cases = []
    for _ in range(200):
        n = int(rng.integers(2, 9))
        d = list(rng.normal(rng.normal(0, 1), rng.uniform(0.1, 2), n))
        cases.append((d, float(rng.uniform(0.1, 3))))
    scipy_p = {}  # case index -> (lower, upper, above, below): the four one-sided p-values
    for n in {len(d) for d, _ in cases}:
        at = [i for i, (d, _) in enumerate(cases) if len(d) == n]
        x = np.array([cases[i][0] for i in at])
        m = np.array([cases[i][1] for i in at])[:, None]
        ps = [stats.ttest_1samp(x + m, 0, axis=1, alternative="greater").pvalue,  # against mean <= -m
              stats.ttest_1samp(x - m, 0, axis=1, alternative="less").pvalue,  # against mean >= +m
              stats.ttest_1samp(x - m, 0, axis=1, alternative="greater").pvalue,
              stats.ttest_1samp(x + m, 0, axis=1, alternative="less").pvalue]
        scipy_p.update({i: tuple(float(p[j]) for p in ps) for j, i in enumerate(at)})
    for i, (d, m) in enumerate(cases):
        lower, upper, above, below = scipy_p[i]
        p_equiv, p_apart = verdicts.tost_pvalues(d, m)
        assert p_equiv == pytest.approx(max(lower, upper), rel=1e-9, abs=1e-12)
        outside = min(above, below)
        assert p_apart == pytest.approx(min(1.0, 2 * outside), rel=1e-9, abs=1e-12)
        mean, lo90, hi90 = verdicts.t_interval(d, 0.90)
        inside = -m < lo90 and hi90 < m
        if min(abs(lo90 + m), abs(hi90 - m)) > 1e-9:  # off the boundary, where float rounding decides
            assert (p_equiv < 0.05) == inside
        _, lo95, hi95 = verdicts.t_interval(d, 0.95)
        if min(abs(lo95 - m), abs(hi95 + m)) > 1e-9:
            assert (p_apart < 0.05) == (lo95 > m or hi95 < -m)


def test_a_tie_claim_reads_equivalent_not_equivalent_or_inconclusive():
    """judge(power=False): the verdict is taken from the Holm-adjusted p-values before judge's power block runs, and
    that block only adds seeds_needed / seeds_range (a TOST power integral per bisection step: ~3 s of the ~3 s this
    test took). The tie's power path through judge runs in test_a_tie_claim_brings_two_tests_into_the_holm_family,
    and tost_power and seeds_needed(margin=) are checked in test_tost_power_matches_a_monte_carlo_and_seeds_...."""
    base = [0.0] * 4
    close = [-0.1, 0.1, 0.0, 0.05]  # the 90% interval well inside ±1
    (f,) = verdicts.judge([tie(1.0)], rows_of({"b": close, "c": base}), power=False)
    assert f["verdict"] == "equivalent within ±1" and "p_zero" not in f and "p_equiv" in f
    far = [-3.1, -2.9, -3.0, -3.05]  # the 95% interval well below -1
    (f,) = verdicts.judge([tie(1.0)], rows_of({"b": far, "c": base}), power=False)
    assert f["verdict"] == verdicts.NOT_EQUIVALENT
    wide = [-3.0, 2.0, -1.0, 1.5]
    (f,) = verdicts.judge([tie(1.0)], rows_of({"b": wide, "c": base}), power=False)
    assert f["verdict"] == "inconclusive"
    # a significant -3 used to "agree" with the paper's -0.3 read as a direction
    (f,) = verdicts.judge([finding(-0.3)], rows_of({"b": far, "c": base}), power=False)
    assert f["verdict"] == "agrees in direction, larger than the paper's"


def test_a_tie_claim_brings_two_tests_into_the_holm_family():
    base = [0.0] * 4
    close = [-0.1, 0.1, 0.0, 0.05]
    findings = verdicts.judge([tie(1.0), finding(2.0, "b2", "c")], rows_of({"b": close, "b2": [2, 2.1, 1.9, 2.2],
                                                                           "c": base}))
    assert verdicts.family_size(findings) == 4
    raw = [*verdicts.tost_pvalues(close, 1.0), verdicts.t_pvalue([2, 2.1, 1.9, 2.2]),
           verdicts.t_pvalue([2, 2.1, 1.9, 2.2], 2.0)]
    held = verdicts.holm(raw)
    got = [findings[0]["p_equiv"], findings[0]["p_apart"], findings[1]["p_zero"], findings[1]["p_paper"]]
    assert got == [round(p, 4) for p in held]


def test_tost_power_matches_a_monte_carlo_and_seeds_for_a_tie_reach_it():
    rng = np.random.default_rng(11)
    reps = 40000
    for n, sd, true, margin, alpha in ((5, 1.0, 0.0, 1.0, 0.05), (8, 0.7, 0.3, 1.0, 0.025), (4, 0.5, -0.2, 1.0, 0.05)):
        x = rng.normal(true, sd, (reps, n))
        mean = x.mean(1)
        se = x.std(1, ddof=1) / math.sqrt(n)
        c = stats.t.ppf(1 - alpha, n - 1)
        hit = float(np.mean((mean - c * se > -margin) & (mean + c * se < margin)))
        exact = verdicts.tost_power(n, sd, true, margin, alpha)
        assert abs(exact - hit) <= 4 * math.sqrt(exact * (1 - exact) / reps) + 1e-9, (n, exact, hit)
    need = verdicts.seeds_needed(1.0, 0.3, 0.05 / 4, margin=1.0)
    assert verdicts.tost_power(need, 1.0, 0.3, 1.0, 0.05 / 4) >= 0.8 > verdicts.tost_power(need - 1, 1.0, 0.3, 1.0,
                                                                                            0.05 / 4)
    assert verdicts.seeds_needed(1.0, 1.0, 0.05, margin=1.0) == verdicts.MAX_SEEDS + 1  # at the margin: never


# --- relative shares, the power range ---------------------------------------------------------------------------


def test_shares_set_each_difference_beside_its_baseline():
    rows = rows_of({"b": [12.0, 14.0, 13.0], "c": [10.0, 10.0, 10.0]})
    (f,) = verdicts.judge([{**finding(5.0), "paper_than": 40.0}], rows)
    assert f["shares"] == {"paper": 12.5, "ours": 30.0}  # 5 of 40; 3 of 10
    (f,) = verdicts.judge([finding(None)], rows)
    assert f["shares"] == {"paper": None, "ours": 30.0}


def test_the_seeds_range_comes_from_the_sds_80_percent_chi_square_interval():
    d = [0.2, 1.4, 0.9]
    sd = float(np.std(d, ddof=1))
    lo, hi = verdicts.sd_interval(sd, 3)
    # P(chi2(2) <= x) = 1 - exp(-x / 2): its 10% and 90% points in closed form
    assert lo == pytest.approx(sd * math.sqrt(2 / (-2 * math.log(0.1))), rel=1e-9)
    assert hi == pytest.approx(sd * math.sqrt(2 / (-2 * math.log(0.9))), rel=1e-9)
    (f,) = verdicts.judge([finding(2.0)], rows_of({"b": d, "c": [0.0] * 3}))
    alpha = 0.05 / 2
    assert f["seeds_range"] == [smallest_n(lo, 2.0, alpha), smallest_n(hi, 2.0, alpha)]
    assert f["seeds_range"][0] <= f["seeds_needed"] <= f["seeds_range"][1]


# --- the recipes' seed plan, relative columns and operating point -------------------------------------------------


def test_seeds_are_declared_before_the_run_and_a_later_extension_is_said(tmp_path):
    import ablation

    plan_path = tmp_path / "plan.json"
    first = ablation.declare_seeds(plan_path, [0, 1, 2])
    assert plan_path.is_file() and first["status"] == "as declared" and first["seeds"] == [0, 1, 2]
    again = ablation.declare_seeds(plan_path, [0, 1, 2, 3])
    assert again["seeds"] == [0, 1, 2] and again["status"] == "extended after a look"
    assert "extended after a look (declared 0, 1, 2" in ablation.seeds_text([0, 1, 2, 3], again)
    assert ablation.declare_seeds(plan_path, [5, 6])["status"] == "other than declared"
    assert "declared before the run" in ablation.seeds_text([0, 1, 2], first)
    plan_path.write_text("[1, 2]")
    with pytest.raises(ablation.RecipeError, match="not a seed plan"):
        ablation.declare_seeds(plan_path, [0])


def test_an_arm_far_below_the_papers_operating_point_is_flagged():
    import ablation

    rows = [{"arm": a, "seed": s, "i2t_r1": v, "chance_r1": 0.1} for a, v in (("new", 7.5), ("base", 7.0))
            for s in (0, 1)]
    f = {"better": "new", "than": "base", "metric": "i2t_r1", "paper_than": 40.0}
    assert ablation.far_below(f, rows) == ["new", "base"]  # both under 8 = 40 / 5
    assert ablation.far_below({**f, "paper_than": 36.0}, rows) == ["base"]  # under 7.2
    assert ablation.far_below({**f, "paper_than": None}, rows) == []
    low = [{**r, "i2t_r1": 0.2} if r["arm"] == "base" else r for r in rows]  # under 3x chance
    assert ablation.far_below({**f, "paper_than": None}, low) == ["base"]


def test_bad_tie_margins_and_baselines_are_one_line_errors():
    import ablation

    with pytest.raises(ablation.RecipeError, match="tie_margin: expected a positive number"):
        ablation.check_finding({"tie_margin": -1, "paper_effect": 0.0}, "findings[0]")
    with pytest.raises(ablation.RecipeError, match="paper_than: expected a positive number"):
        ablation.check_finding({"paper_than": "40"}, "findings[0]")
    with pytest.raises(ablation.RecipeError, match="needs the paper's own difference"):
        ablation.check_finding({"tie_margin": 1.0, "paper_effect": None}, "findings[0]")


def test_the_readme_tables_are_the_results_files():
    import readme_tables

    assert readme_tables.main(["--check"]) == 0, "run .venv/bin/python pipelines/readme_tables.py"
