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
- **disagrees**: significantly different from 0, on the other side; for a paper effect of exactly 0 (the paper
  found no difference, so predicts no side) a significant difference on either side;
- **rules out the paper's effect**: not significantly different from 0, but significantly different from the paper's
  effect size (our interval excludes it: at this scale the effect is smaller than the paper's, or reversed but
  not significantly so);
- **inconclusive**: neither;
- **NaN metric**: a paired seed's metric is NaN or infinite in one arm (`nan_seeds` names them): no verdict;
- **no variance: more seeds or a finer metric**: every seed gives the same difference (up to float rounding), which
  the t test would read as infinite confidence (p = 0, an interval of width 0).
"Significantly" is a two-sided paired t test at family-wise level 5% across all the tests of a recipe (one against
0 for every finding, one against the paper's effect for every finding that has a nonzero one: for an effect of 0
the two tests are the same test, counted once), by Holm's step-down correction. The last two labels' findings have
no test and leave the family. So the 95% interval shown beside a verdict is per finding and unadjusted: an interval
that just misses 0 can still be "inconclusive" once the recipe's other tests are accounted for. A paper effect of 0
never "agrees": a t test cannot show two arms equal, only fail to separate them. A finding with fewer than 2 paired
seeds is inconclusive. Verdicts and seeds_needed use the unrounded differences and p-values; the JSON rounds them
for display. `seeds_needed` is the number of seeds per arm at which the paired t test at level 5% / (number of
tests) would detect the paper's effect with 80% power (exact noncentral t), at the observed sd of the differences.
"""

import math

import numpy as np
from scipy import stats

ALPHA = 0.05
POWER = 0.8
MAX_SEEDS = 1000  # seeds_needed beyond this is reported as more than MAX_SEEDS
NAN_METRIC = "NaN metric"  # a seed's metric is NaN or infinite in one arm: no verdict, no test in the family
NO_VARIANCE = "no variance: more seeds or a finer metric"  # every seed gives the same difference
VERDICTS = ("agrees", "disagrees", "rules out the paper's effect", "inconclusive", NAN_METRIC, NO_VARIANCE)


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


def seeds_needed(sd: float, effect: float, alpha: float, power_goal: float = POWER) -> int | None:
    """Seeds per arm for a two-sided paired t test at `alpha` to detect `effect` with `power`, when the per-seed
    differences have standard deviation `sd` (noncentral t); None when the effect is 0, MAX_SEEDS + 1 when more
    than MAX_SEEDS are needed."""
    if effect == 0 or math.isnan(sd):
        return None
    if sd == 0:
        return 2
    if t_power(MAX_SEEDS, sd, effect, alpha) < power_goal:
        return MAX_SEEDS + 1
    lo = 1  # power(hi) >= goal; power rises with n, so bisect for the smallest such n
    hi = MAX_SEEDS
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if t_power(mid, sd, effect, alpha) >= power_goal else (mid, hi)
    return max(hi, 2)


def judge(findings: list[dict], rows: list[dict], alpha: float = ALPHA) -> list[dict]:
    """Each finding (paper, better, than, metric, paper_effect) with diff, ci_low, ci_high, sd (2 decimals, for
    display), n_seeds, missing_seeds, p_zero and p_paper (Holm-adjusted over the recipe's tests, 4 decimals),
    verdict and seeds_needed; every decision is taken on the unrounded numbers."""
    check_rows(rows)
    out = []
    exact = []  # per finding: (mean, sd, raw p against 0, raw p against the paper's effect or None), unrounded
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
        out.append({**f, "diff": _round(mean), "ci_low": _round(lo), "ci_high": _round(hi), "sd": _round(sd)})
        if no_variance(diffs):
            out[-1].update(verdict=NO_VARIANCE, seeds_needed=None)
            exact.append(None)
            continue
        effect = f.get("paper_effect")
        # a paper effect of 0 predicts no difference: the test against it is the test against 0, counted once
        exact.append((mean, sd, t_pvalue(diffs), t_pvalue(diffs, effect) if effect else None))
    tests = [(i, kind, p) for i, e in enumerate(exact) if e is not None
             for kind, p in (("zero", e[2]), ("paper", e[3])) if p is not None]
    adjusted = {(i, kind): p for (i, kind, _), p in zip(tests, holm([p for _, _, p in tests]))}
    for i, (f, e) in enumerate(zip(out, exact)):
        if e is None:
            continue
        mean, sd = e[0], e[1]
        p_zero = adjusted[i, "zero"]
        p_paper = adjusted.get((i, "paper"))
        f["p_zero"] = round(p_zero, 4)
        if p_paper is not None:
            f["p_paper"] = round(p_paper, 4)
        f["verdict"] = _verdict(f["n_seeds"], mean, f.get("paper_effect"), p_zero, p_paper, alpha)
        effect = f.get("paper_effect")
        f["seeds_needed"] = (seeds_needed(sd, effect, alpha / len(tests))
                             if effect is not None and f["n_seeds"] >= 2 else None)
    return out


def _verdict(n_seeds: int, mean: float, effect: float | None, p_zero: float, p_paper: float | None,
             alpha: float) -> str:
    """One of the first four VERDICTS, from the unrounded mean difference and Holm-adjusted p-values."""
    if n_seeds < 2:
        return "inconclusive"
    if p_zero < alpha:
        if effect == 0:  # the paper found no difference; any significant one, either side, contradicts it
            return "disagrees"
        side = 1.0 if effect is None else math.copysign(1.0, effect)
        return "agrees" if side * mean > 0 else "disagrees"
    if p_paper is not None and p_paper < alpha:
        return "rules out the paper's effect"
    return "inconclusive"


def _round(x: float) -> float | None:
    """Two decimals for the JSON; None for an infinite or undefined bound (one seed)."""
    return None if math.isnan(x) or math.isinf(x) else round(x, 2)
