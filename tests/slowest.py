"""The suite's own speed check: at the end of a run, the 10 slowest tests (setup, call and teardown together), and
every test of the fast tier (not marked `slow`) that took longer than FAST_TIER_BUDGET_S.

The fast tier is what `make test-fast` runs while one works; a test that creeps over a few seconds there belongs in
the `slow` tier or wants a smaller input. Timings depend on the machine and its load, so this reports, never fails.
"""

from collections import defaultdict

import pytest

FAST_TIER_BUDGET_S = 5.0
SHOWN = 10


class Slowest:
    """A pytest plugin (tests/conftest.py registers it): seconds per test id, summed over its setup, call and
    teardown reports, and whether the test is marked `slow`; printed in the terminal summary."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.slow: dict[str, bool] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        # under xdist the controller gets the workers' reports, whose keywords carry the items' marks
        self.seconds[report.nodeid] += report.duration
        self.slow[report.nodeid] = "slow" in report.keywords

    def lines(self) -> list[str]:
        ranked = sorted(self.seconds.items(), key=lambda kv: -kv[1])
        out = [f"{s:7.1f}s {nodeid}" for nodeid, s in ranked[:SHOWN]]
        over = [(nodeid, s) for nodeid, s in ranked if s > FAST_TIER_BUDGET_S and not self.slow[nodeid]]
        if over:
            out.append(f"tests of the fast tier over {FAST_TIER_BUDGET_S:g} s (mark them slow or shrink their input):")
            out += [f"{s:7.1f}s {nodeid}" for nodeid, s in over]
        return out

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.seconds:
            terminalreporter.write_sep("=", f"slowest {min(SHOWN, len(self.seconds))} tests (tests/slowest.py)")
            for line in self.lines():
                terminalreporter.write_line(line)
