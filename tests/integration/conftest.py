"""Every test in tests/integration is `slow`: subprocesses and torchrun, Ray, the real-data example, the benchmarks'
and pipelines' scripts, the install checks. `make test-fast` (-m "not slow") leaves the folder out; `make test`
runs it."""

from pathlib import Path

import pytest

HERE = Path(__file__).parent


# tryfirst: the mark must be on the items before `-m` deselects by marks (also a pytest_collection_modifyitems).
# The hook sees every collected item, not only this folder's, hence the path check.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.slow)
