"""The suite's two sizes: the quick one a newcomer runs, and the full one CI runs.

Tests marked ``slow`` (long property programs, fuzzing, the engine-against-engine
and policy-against-policy programs) are deselected unless ``--full`` is given:
``python -m pytest -q`` runs the rest in a few minutes on two cores, and
``python -m pytest -q --full --cov`` (README, "Full suite"; CI) runs everything
with the coverage gate. Naming a slow test's file or node ID on the command line
runs it too.
"""

from __future__ import annotations

from pathlib import Path

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--full",
        action="store_true",
        help="also run the tests marked slow (the full suite CI runs)",
    )


def pytest_report_header(config: pytest.Config) -> str:
    if config.getoption("--full"):
        return "prefixcache: the full suite (slow tests included)"
    return "prefixcache: the quick suite; slow tests deselected (--full runs them, as CI does)"


def _named_on_command_line(item: pytest.Item, config: pytest.Config) -> bool:
    """Whether the command line names this test's file (or the test) directly."""
    path = Path(str(item.path)).resolve()
    for arg in config.args:
        target = Path(arg.split("::")[0]).resolve()
        if target == path:
            return True
    return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--full"):
        return
    kept, slow = [], []
    for item in items:
        if item.get_closest_marker("slow") and not _named_on_command_line(item, config):
            slow.append(item)
        else:
            kept.append(item)
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = kept
