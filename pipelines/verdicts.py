"""The recipes' statistical rule: each finding is a paired difference over seeds, tested with Holm's correction.

Arms of a recipe share their seeds (the seed sets the initial weights, the data order and the held-out draw), so a
finding "arm B beats arm C on metric m" is measured seed by seed: d_s = m(B, s) - m(C, s). Its estimate is the mean
of the d_s and its 95% interval the paired t interval, mean ± t(0.975, n-1) · sd / sqrt(n). A t interval over
seeds, not a bootstrap: with 3-5 seeds a bootstrap over seeds has a handful of distinct resamples and its interval is
too narrow, while the t interval is exact when the d_s are normal (a sum of many small effects of init and order).
Every arm is scored on the same fixed eval items, so the interval is about this eval set; each table states the
eval sizes and the sampling sd they imply for a reader who wants to carry a difference to other images.

A directional finding (the paper says B beats C by `paper_effect` points; a finding of our own, with no paper
effect, predicts B > C) gets exactly one verdict:
- **agrees**: significantly different from 0 on the paper's side, and the paper's size is not rejected;
- **agrees in direction, smaller than the paper's** (or **larger**): significantly different from 0 on the paper's
  side, and significantly different from the paper's effect, which lies beyond (or short of) ours;
- **disagrees**: significantly different from 0, on the other side; for a paper effect of exactly 0 without a
  margin (the paper found no difference, so predicts no side) a significant difference on either side;
- **rules out the paper's effect**: not significantly different from 0, but significantly different from the paper's
  effect (our interval excludes it);
- **inconclusive**: neither.
A tie claim (the finding has `tie_margin` m: the paper says B and C score alike, within ±m points) is tested by two
one-sided tests (TOST) and its verdict is:
- **equivalent within ±m**: both one-sided tests reject a difference of -m or less and of +m or more (the 90% t
  interval lies inside ±m);
- **not equivalent**: the difference is significantly beyond the margin (the 95% t interval lies outside ±m);
- **inconclusive**: neither.
Any finding can also read:
- **NaN metric**: a paired seed's metric is NaN or infinite in one arm (`nan_seeds` names them): no verdict;
- **no variance: more seeds or a finer metric**: every seed gives the same difference (up to float rounding), which
  the t test would read as infinite confidence (p = 0, an interval of width 0).
"Significantly" is at family-wise level 5% across all the tests of a recipe, by Holm's step-down correction: a
directional finding brings a two-sided paired t test against 0 and one against the paper's effect when that is
nonzero (for an effect of 0 the two are the same test, counted once); a tie claim brings its TOST p-value (the larger
of the two one-sided p-values) and the two-sided test against the nearer margin. Findings labelled "NaN metric" or
"no variance" have no test and leave the family. So the 95% interval shown beside a verdict is per finding and
unadjusted: an interval that just misses 0 can still be "inconclusive" once the recipe's other tests are accounted
for. A finding with fewer than 2 paired seeds is inconclusive. Verdicts and seeds use the unrounded differences and
p-values; the JSON rounds them for display.

`seeds_needed` is the number of seeds per arm at which the test would reach 80% power at level 5% / (number of
tests), Holm's first step, at the observed sd of the differences: the paired t test (exact noncentral t) to detect
the paper's effect, or for a tie claim the TOST (exact, integrated over the sd's distribution) to show equivalence
when the true difference is the paper's. With 3 seeds the sd has 2 degrees of freedom, so `seeds_range` gives the
same count at both ends of the sd's 80% chi-square interval: the count is a range, not a number.
`shares` set the difference beside its baseline: the paper's effect as a percentage of the paper's level of the
`than` arm (`paper_than`, when the finding quotes it), ours as a percentage of our `than` arm's mean.
"""

import math

import numpy as np
from scipy import integrate, stats

ALPHA = 0.05
POWER = 0.8
SD_LEVEL = 0.8  # seeds_range: the sd's two-sided chi-square interval at this level
MAX_SEEDS = 1000  # seeds_needed beyond this is reported as more than MAX_SEEDS
NAN_METRIC = "NaN metric"  # a seed's metric is NaN or infinite in one arm: no verdict, no test in the family
NO_VARIANCE = "no variance: more seeds or a finer metric"  # every seed gives the same difference
SMALLER = "agrees in direction, smaller than the paper's"
LARGER = "agrees in direction, larger than the paper's"
NOT_EQUIVALENT = "not equivalent"
EQUIVALENT = "equivalent within ±{margin:g}"  # a tie claim's verdict names its margin
DIRECTIONAL = ("agrees", SMALLER, LARGER, "disagrees", "rules out the paper's effect", "inconclusive")
VERDICTS = DIRECTIONAL + (EQUIVALENT, NOT_EQUIVALENT, NAN_METRIC, NO_VARIANCE)
P_KEYS = ("p_zero", "p_paper", "p_equiv", "p_apart")  # a finding's Holm-adjusted p-values, one per test it brings


def kind(verdict: str) -> str:
    """The VERDICTS entry a verdict string is (an equivalence verdict carries its margin)."""
    return EQUIVALENT if verdict.startswith("equivalent within") else verdict


def family_size(findings: list[dict]) -> int:
    """The number of tests in a judged recipe's Holm family."""
    return sum(k in f for f in findings for k in P_KEYS)


def check_rows(rows: list[dict]) -> None:
    """ValueError naming the first (arm, seed) that two rows share: a finding pairs the arms seed by seed, so a
    repeated seed would be paired once (and its other rows dropped) while an arm's summary counts every row."""
    seen = set()
    for i, r in enumerate(rows):
        pair = (r["arm"], r["seed"])
        if pair in seen:
            raise ValueError(f"rows[{i}]: arm {r['arm']!r} seed {r['seed']} has a row already; one row per arm and "
                             "seed")
        seen.add(pair)


def paired_differences(rows: list[dict], better: str, than: str, metric: str) -> tuple[list[float], list[int],
                                                                                         list[int]]:
    """(d_s in seed order, the seeds paired, the seeds of either arm left out because the other arm lacks them or a
    row lacks the metric)."""
    def by_seed(arm):
        return {r["seed"]: r.get(metric) for r in rows if r["arm"] == arm}

    b = by_seed(better)
    t = by_seed(than)
    seeds = sorted(s for s in set(b) & set(t) if b[s] is not None and t[s] is not None)
    missing = sorted((set(b) | set(t)) - set(seeds))
    return [b[s] - t[s] for s in seeds], seeds, missing


def t_interval(diffs: list[float], level: float = 1 - ALPHA) -> tuple[float, float, float]:
    """(mean, low, high): the paired t interval of the mean difference; infinite with fewer than 2 differences."""
    n = len(diffs)
    if n == 0:
        return math.nan, -math.inf, math.inf
    mean = float(np.mean(diffs))
    if n < 2:
        return mean, -math.inf, math.inf
    half = float(stats.t.ppf(0.5 + level / 2, n - 1)) * float(np.std(diffs, ddof=1)) / math.sqrt(n)
    return mean, mean - half, mean + half


def t_pvalue(diffs: list[float], null: float = 0.0) -> float:
    """Two-sided p-value of the paired t test of mean difference = null (1 with fewer than 2 differences; NaN when
    the differences have no spread, which the t test cannot score: see `no_variance`)."""
    n = len(diffs)
    if n < 2:
        return 1.0
    if no_variance(diffs):
        return math.nan
    mean = float(np.mean(diffs))
    sd = float(np.std(diffs, ddof=1))
    t = (mean - null) / (sd / math.sqrt(n))
    return float(2 * stats.t.sf(abs(t), n - 1))


def tost_pvalues(diffs: list[float], margin: float) -> tuple[float, float]:
    """(p_equiv, p_apart) for the tie claim |mean difference| < margin. p_equiv is the TOST p-value, the larger of the
    one-sided p-values against mean <= -margin and mean >= +margin (below alpha exactly when the 1 - 2 alpha t
    interval lies inside ±margin); p_apart is the two-sided p-value against the margin nearer the mean (below alpha
    exactly when the 1 - alpha interval lies outside ±margin, on either side). (1, 1) with fewer than 2 differences."""
    n = len(diffs)
    if n < 2:
        return 1.0, 1.0
    mean = float(np.mean(diffs))
    se = float(np.std(diffs, ddof=1)) / math.sqrt(n)
    df = n - 1
    above = (mean - margin) / se  # t against +margin
    below = (mean + margin) / se  # t against -margin
    p_equiv = max(float(stats.t.sf(below, df)), float(stats.t.cdf(above, df)))
    p_apart = min(1.0, 2 * min(float(stats.t.sf(above, df)), float(stats.t.cdf(below, df))))
    return p_equiv, p_apart


def no_variance(diffs: list[float]) -> bool:
    """Whether 2 or more differences are all the same, up to float rounding: the t test would give p = 0 (or 1) and
    an interval of width 0, an infinite confidence that a handful of seeds cannot give."""
    # subtracting metrics of up to ~1e5 points leaves rounding errors of ~1e-11; a real spread is far above 1e-9
    return len(diffs) >= 2 and float(np.std(diffs, ddof=1)) <= 1e-9 * max(1.0, max(abs(d) for d in diffs))


def holm(pvalues: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values: the i-th smallest times (m - i + 1), made monotone, capped at 1."""
    if any(math.isnan(p) for p in pvalues):
        raise ValueError("holm: a p-value is NaN; leave its test out of the family")
    m = len(pvalues)
    adjusted = [0.0] * m
    running = 0.0
    for rank, i in enumerate(sorted(range(m), key=lambda j: pvalues[j])):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted


def t_power(n: int, sd: float, effect: float, alpha: float) -> float:
    """Power of the two-sided paired t test at `alpha` on n differences of mean `effect` and sd `sd`: the exact
    noncentral t, both tails."""
    df = n - 1
    ncp = abs(effect) * math.sqrt(n) / sd
    crit = float(stats.t.ppf(1 - alpha / 2, df))
    upper = float(stats.nct.sf(crit, df, ncp))
    if math.isnan(upper):
        upper = 1.0 - float(stats.nct.cdf(crit, df, ncp))
    # scipy returns NaN for a lower tail far below its precision (ncp >= 0 puts it under alpha / 2): it adds ~0
    lower = float(stats.nct.cdf(-crit, df, ncp))
    return upper + (0.0 if math.isnan(lower) else lower)


def tost_power(n: int, sd: float, true: float, margin: float, alpha: float) -> float:
    """Power of the TOST at `alpha` to show |difference| < margin from n differences of mean `true` and sd `sd`:
    P(-margin + c s / sqrt(n) < mean < margin - c s / sqrt(n)), c = t(1 - alpha, n - 1), integrated exactly over the
    sample sd s ((n - 1) s^2 / sd^2 ~ chi2(n - 1), independent of the mean)."""
    df = n - 1
    c = float(stats.t.ppf(1 - alpha, df))
    root = math.sqrt(n)
    # the interval is empty once c s / sqrt(n) >= margin: integrate the chi-square variable up to that point
    top = df * (margin * root / (c * sd)) ** 2

    def given(v: float) -> float:
        half = margin - c * sd * math.sqrt(v / df) / root
        inside = stats.norm.cdf((half - true) * root / sd) - stats.norm.cdf((-half - true) * root / sd)
        return float(inside) * float(stats.chi2.pdf(v, df))

    # the chi-square density is a narrow peak at large n: integrate over its bulk (all but 1e-13 either side)
    lo, hi = float(stats.chi2.ppf(1e-13, df)), min(top, float(stats.chi2.isf(1e-13, df)))
    return float(integrate.quad(given, lo, hi, limit=200)[0]) if hi > lo else 0.0


def seeds_needed(sd: float, effect: float, alpha: float, power_goal: float = POWER,
                 margin: float | None = None) -> int | None:
    """Seeds per arm for the finding's test at `alpha` to reach `power_goal` when the per-seed differences have
    standard deviation `sd`: the two-sided paired t test to detect `effect` (noncentral t; None when the effect is
    0), or with a `margin` the TOST to show equivalence when the true difference is `effect`. MAX_SEEDS + 1 when more
    than MAX_SEEDS are needed (a tie whose true difference reaches the margin can never be shown)."""
    if math.isnan(sd):
        return None
    if margin is None:
        if effect == 0:
            return None

        def power(n: int) -> float:
            return t_power(n, sd, effect, alpha)
    else:
        if abs(effect) >= margin:
            return MAX_SEEDS + 1

        def power(n: int) -> float:
            return tost_power(n, sd, effect, margin, alpha)
    if sd == 0:
        return 2
    if power(MAX_SEEDS) < power_goal:
        return MAX_SEEDS + 1
    lo = 1  # power(hi) >= goal; power rises with n, so bisect for the smallest such n
    hi = MAX_SEEDS
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if mid >= 2 and power(mid) >= power_goal else (mid, hi)
    return max(hi, 2)


def sd_interval(sd: float, n: int, level: float = SD_LEVEL) -> tuple[float, float]:
    """The two-sided chi-square interval at `level` of the sd behind a sample sd `sd` of n normal values."""
    df = n - 1
    return (sd * math.sqrt(df / float(stats.chi2.ppf(0.5 + level / 2, df))),
            sd * math.sqrt(df / float(stats.chi2.ppf(0.5 - level / 2, df))))


def judge(findings: list[dict], rows: list[dict], alpha: float = ALPHA, power: bool = True) -> list[dict]:
    """Each finding (paper, better, than, metric, paper_effect; optional tie_margin and paper_than) with diff,
    ci_low, ci_high, sd (2 decimals, for display), n_seeds, missing_seeds, the Holm-adjusted p-values of its tests
    (p_zero and p_paper, or p_equiv and p_apart for a tie claim; 4 decimals), shares, verdict, and with `power`
    seeds_needed and seeds_range; every decision is taken on the unrounded numbers."""
    check_rows(rows)
    out = []
    exact = []  # per finding: (mean, sd, n, {test: raw p}), unrounded; None for a finding without tests
    for f in findings:
        diffs, seeds, missing = paired_differences(rows, f["better"], f["than"], f["metric"])
        bad = [s for s, d in zip(seeds, diffs) if not math.isfinite(d)]
        f = {**f, "n_seeds": len(seeds), "missing_seeds": missing}
        if bad:
            out.append({**f, "diff": None, "ci_low": None, "ci_high": None, "sd": None, "nan_seeds": bad,
                        "verdict": NAN_METRIC, "seeds_needed": None})
            exact.append(None)
            continue
        mean, lo, hi = t_interval(diffs)
        sd = float(np.std(diffs, ddof=1)) if len(diffs) > 1 else math.nan
        out.append({**f, "diff": _round(mean), "ci_low": _round(lo), "ci_high": _round(hi), "sd": _round(sd),
                    "shares": shares(f, rows, seeds, mean)})
        if no_variance(diffs):
            out[-1].update(verdict=NO_VARIANCE, seeds_needed=None)
            exact.append(None)
            continue
        effect = f.get("paper_effect")
        if f.get("tie_margin") is not None:
            p_equiv, p_apart = tost_pvalues(diffs, f["tie_margin"])
            tests = {"p_equiv": p_equiv, "p_apart": p_apart}
        else:  # a paper effect of 0 predicts no difference: the test against it is the test against 0, counted once
            tests = {"p_zero": t_pvalue(diffs)}
            if effect:
                tests["p_paper"] = t_pvalue(diffs, effect)
        exact.append((mean, sd, len(diffs), tests))
    family = [(i, key, p) for i, e in enumerate(exact) if e is not None for key, p in e[3].items()]
    adjusted = {(i, key): p for (i, key, _), p in zip(family, holm([p for _, _, p in family]))}
    for i, (f, e) in enumerate(zip(out, exact)):
        if e is None:
            continue
        mean, sd, n, tests = e
        p = {key: adjusted[i, key] for key in tests}
        f.update({key: round(v, 4) for key, v in p.items()})
        effect = f.get("paper_effect")
        margin = f.get("tie_margin")
        if margin is not None:
            f["verdict"] = _tie_verdict(n, margin, p["p_equiv"], p["p_apart"], alpha)
        else:
            f["verdict"] = _verdict(n, mean, effect, p["p_zero"], p.get("p_paper"), alpha)
        f["seeds_needed"] = f["seeds_range"] = None
        if power and n >= 2 and effect is not None and (effect != 0 or margin is not None):
            level = alpha / len(family)
            f["seeds_needed"] = seeds_needed(sd, effect, level, margin=margin)
            f["seeds_range"] = [seeds_needed(x, effect, level, margin=margin) for x in sd_interval(sd, n)]
    return out


def shares(f: dict, rows: list[dict], seeds: list[int], mean: float) -> dict:
    """The difference beside its baseline, in percent: the paper's effect of the paper's `than` level (when the
    finding quotes `paper_than`), ours of our `than` arm's mean over the paired seeds (None at a mean of 0)."""
    than = [r[f["metric"]] for r in rows if r["arm"] == f["than"] and r["seed"] in seeds]
    base = float(np.mean(than)) if than else 0.0
    paper, level = f.get("paper_effect"), f.get("paper_than")
    return {"paper": None if paper is None or not level else round(100 * paper / level, 1),
            "ours": None if base == 0 else round(100 * mean / base, 1)}


def _verdict(n_seeds: int, mean: float, effect: float | None, p_zero: float, p_paper: float | None,
             alpha: float) -> str:
    """One of DIRECTIONAL, from the unrounded mean difference and Holm-adjusted p-values."""
    if n_seeds < 2:
        return "inconclusive"
    if p_zero < alpha:
        if effect == 0:  # the paper found no difference; any significant one, either side, contradicts it
            return "disagrees"
        side = 1.0 if effect is None else math.copysign(1.0, effect)
        if side * mean <= 0:
            return "disagrees"
        if p_paper is None or p_paper >= alpha:
            return "agrees"
        return SMALLER if abs(mean) < abs(effect) else LARGER
    if p_paper is not None and p_paper < alpha:
        return "rules out the paper's effect"
    return "inconclusive"


def _tie_verdict(n_seeds: int, margin: float, p_equiv: float, p_apart: float, alpha: float) -> str:
    """Equivalent within ±margin, not equivalent or inconclusive, from the Holm-adjusted TOST and apart p-values."""
    if n_seeds < 2:
        return "inconclusive"
    if p_equiv < alpha:
        return EQUIVALENT.format(margin=margin)
    if p_apart < alpha:
        return NOT_EQUIVALENT
    return "inconclusive"


def _round(x: float) -> float | None:
    """Two decimals for the JSON; None for an infinite or undefined bound (one seed)."""
    return None if math.isnan(x) or math.isinf(x) else round(x, 2)
