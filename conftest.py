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


_unimportable: list[str] = []  # test modules whose import failed, this session


def pytest_collectreport(report: pytest.CollectReport) -> None:
    """Note a test module that cannot be imported: :func:`pytest_sessionfinish` fails the run.

    ``--doctest-ignore-import-errors`` (pyproject.toml) skips a library module whose
    optional dependency is missing; it skips a broken test module just as silently (its
    doctest collector reports the import error as a skip), and every test in it would
    pass unseen. Test modules that need an optional dependency skip themselves
    (``pytest.importorskip``), which is not this report.
    """
    name = Path(report.nodeid.split("::")[0]).name
    broken = "unable to import module" in str(report.longrepr)
    if report.skipped and name.startswith("test_") and broken:
        _unimportable.append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A test module that could not be imported fails the run (see above)."""
    if not _unimportable:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    for nodeid in _unimportable:
        if reporter is not None:
            reporter.write_line(f"a test module could not be imported (a failure): {nodeid}")
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
