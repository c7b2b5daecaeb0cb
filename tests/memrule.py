"""The memory rule's test helper: how many bytes of Python memory a stage's peak grows by per extra sample.

A stage obeys the rule when its process holds a constant plus a per-shard amount, never a structure with an entry per
sample of the whole dataset. The tests run the stage in-process (one local worker runs inline, so the worker's code is
measured too) on N and on 4N samples with the same samples per shard, and divide the growth of the peak by 3N.
tracemalloc counts what Python and numpy allocate, exactly and the same on any machine, unlike RSS, whose noise of a
few MB would hide a per-sample structure at the sizes a unit test can afford; torch tensors and C libraries' own
buffers are not counted, which is why the benchmark measures RSS as well."""

import gc
import tracemalloc
from typing import Callable


def traced_peak(fn: Callable[[], object]) -> int:
    """Bytes above the start that Python allocations reach at their highest while fn() runs."""
    gc.collect()
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def growth_per_sample(run: Callable[[int], object], n: int) -> float:
    """(peak of run(4n) - peak of run(n)) / 3n in bytes, after an unmeasured run(n) and run(4n), which pay the
    imports, model loads and caches a first call makes and build the datasets when `run` makes them on first use.
    `run(m)` runs the stage on an m-sample dataset."""
    run(n)
    run(4 * n)
    small = traced_peak(lambda: run(n))
    large = traced_peak(lambda: run(4 * n))
    return (large - small) / (3 * n)
