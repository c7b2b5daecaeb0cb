"""The recipes' statistical rule: each finding is a paired difference over seeds, tested with Holm's correction.

Arms of a recipe share their seeds (the seed sets the initial weights, the data order and the held-out draw), so a
finding "arm B beats arm C on metric m" is measured seed by seed: d_s = m(B, s) - m(C, s). Its estimate is the mean
of the d_s and its 95% interval the paired t interval, mean ± t(0.975, n-1) · sd / sqrt(n). A t interval over
seeds, not a bootstrap: with 3-5 seeds a bootstrap over seeds has a handful of distinct resamples and its interval is
too narrow, while the t interval is exact when the d_s are normal (a sum of many small effects of init and order).
Every arm is scored on the same fixed eval items, so the interval is about this eval set; each table states the
eval sizes and the sampling sd they imply for a reader who wants to carry a difference to other images.

The verdict (exactly one):
- **agrees**: the difference is significantly different from 0, on the paper's side (the paper's effect's sign; a
  finding of our own, with no paper effect, predicts B > C);
- **disagrees**: significantly different from 0, on the other side;
- **rules out the paper's effect**: not significantly different from 0, but significantly different from the paper's
  effect size (our interval excludes it: at this scale the effect is smaller than the paper's, or reversed but
  not significantly so);
- **inconclusive**: neither.
"Significantly" is a two-sided paired t test at family-wise level 5% across all the tests of a recipe (one against
0 for every finding, one against the paper's effect for every finding that has one), by Holm's step-down
correction. So the 95% interval shown beside a verdict is per finding and unadjusted: an interval that just misses
0 can still be "inconclusive" once the recipe's other tests are accounted for. A finding with fewer than 2 paired
seeds is inconclusive. `seeds_needed` is the number of seeds per arm at which the paired t test at level
5% / (number of tests) would detect the paper's effect with 80% power, at the observed sd of the differences.
"""

import math

import numpy as np
from scipy import stats

ALPHA = 0.05
POWER = 0.8
MAX_SEEDS = 1000  # seeds_needed beyond this is reported as more than MAX_SEEDS
VERDICTS = ("agrees", "disagrees", "rules out the paper's effect", "inconclusive")


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
    """Two-sided p-value of the paired t test of mean difference = null (1 with fewer than 2 differences; 0 or 1
    when every difference is the same, which the t test cannot score)."""
    n = len(diffs)
    if n < 2:
        return 1.0
    mean = float(np.mean(diffs))
    sd = float(np.std(diffs, ddof=1))
    if sd == 0:
        return 0.0 if mean != null else 1.0
    t = (mean - null) / (sd / math.sqrt(n))
    return float(2 * stats.t.sf(abs(t), n - 1))


def holm(pvalues: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values: the i-th smallest times (m - i + 1), made monotone, capped at 1."""
    m = len(pvalues)
    adjusted = [0.0] * m
    running = 0.0
    for rank, i in enumerate(sorted(range(m), key=lambda j: pvalues[j])):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted


def seeds_needed(sd: float, effect: float, alpha: float, power_goal: float = POWER) -> int | None:
    """Seeds per arm for a two-sided paired t test at `alpha` to detect `effect` with `power`, when the per-seed
    differences have standard deviation `sd` (noncentral t); None when the effect is 0, MAX_SEEDS + 1 when more
    than MAX_SEEDS are needed."""
    if effect == 0 or math.isnan(sd):
        return None
    if sd == 0:
        return 2

    def power(n: int) -> float:
        df = n - 1
        ncp = abs(effect) * math.sqrt(n) / sd
        crit = stats.t.ppf(1 - alpha / 2, df)
        p = float(stats.nct.sf(crit, df, ncp) + stats.nct.cdf(-crit, df, ncp))
        # scipy's noncentral t returns NaN far in its tail (large ncp); there the normal approximation is exact enough
        return p if not math.isnan(p) else float(stats.norm.sf(crit - ncp) + stats.norm.cdf(-crit - ncp))

    if power(MAX_SEEDS) < power_goal:
        return MAX_SEEDS + 1
    lo = 1  # power(hi) >= goal; power rises with n, so bisect for the smallest such n
    hi = MAX_SEEDS
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if power(mid) >= power_goal else (mid, hi)
    return max(hi, 2)


def judge(findings: list[dict], rows: list[dict], alpha: float = ALPHA) -> list[dict]:
    """Each finding (paper, better, than, metric, paper_effect) with diff, ci_low, ci_high, n_seeds, missing_seeds,
    p_zero and p_paper (Holm-adjusted over the recipe's tests), verdict and seeds_needed."""
    check_rows(rows)
    out = []  # tests: (finding index, "zero" | "paper", raw p)
    tests = []
    for i, f in enumerate(findings):
        diffs, seeds, missing = paired_differences(rows, f["better"], f["than"], f["metric"])
        mean, lo, hi = t_interval(diffs)
        sd = float(np.std(diffs, ddof=1)) if len(diffs) > 1 else math.nan
        out.append({**f, "diff": _round(mean), "ci_low": _round(lo), "ci_high": _round(hi), "sd": _round(sd),
                    "n_seeds": len(seeds), "missing_seeds": missing})
        tests.append((i, "zero", t_pvalue(diffs)))
        if f.get("paper_effect") is not None:
            tests.append((i, "paper", t_pvalue(diffs, f["paper_effect"])))
    adjusted = holm([p for _, _, p in tests])
    for (i, kind, _), p in zip(tests, adjusted):
        out[i][f"p_{kind}"] = round(p, 4)
    for f in out:
        effect = f.get("paper_effect")
        side = 1.0 if not effect else math.copysign(1.0, effect)
        if f["n_seeds"] >= 2 and f["p_zero"] < alpha:
            f["verdict"] = "agrees" if side * f["diff"] > 0 else "disagrees"
        elif f["n_seeds"] >= 2 and f.get("p_paper", 1.0) < alpha:
            f["verdict"] = "rules out the paper's effect"
        else:
            f["verdict"] = "inconclusive"
        need = seeds_needed(f["sd"], effect, alpha / len(tests)) if effect is not None and f["n_seeds"] >= 2 else None
        f["seeds_needed"] = need
    return out


def _round(x: float) -> float | None:
    """Two decimals for the JSON; None for an infinite or undefined bound (one seed)."""
    return None if math.isnan(x) or math.isinf(x) else round(x, 2)
