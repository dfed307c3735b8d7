"""The README works as written: the newcomer path is what it says, and its Python runs.

A newcomer copies the README's blocks before reading any code, and CI (``.ci/run``) runs its
first bash block verbatim. So: every ``python`` block runs in a fresh namespace and prints
what its comments say; the first bash block pins torch before installing the package with
the test extra and then runs the suite with the coverage gate; the Development block runs
the linters and the type checker CI relies on; every extra the README names exists; and the
test extra installs every optional module the suite would otherwise skip.
"""

from __future__ import annotations

import ast
import contextlib
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")

# Optional modules a test may skip without, even with the test extra installed: NVIDIA
# Dynamo's indexer (the test extra installs it on Linux x86-64 only), the package's own
# compiled engine (a machine without a compiler falls back to the Python engine), the
# engines the integrations adapt (Megatron-core, vLLM: peers, tested against fakes without
# them) and tomllib (the standard library's from Python 3.11).
MAY_BE_MISSING = ("dynamo", "prefixcache", "megatron", "vllm", "redis", "tomllib")


def fenced_blocks(text: str, language: str) -> list[tuple[int, str]]:
    """``(first line number, code)`` of every fenced block in ``language``, in order."""
    blocks = []
    pattern = re.compile(rf"^```{language}[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
    for match in pattern.finditer(text):
        line = text.count("\n", 0, match.start()) + 2
        blocks.append((line, match.group(1)))
    return blocks


def section(text: str, heading: str) -> str:
    """The text from ``heading`` to the next heading of the same level."""
    start = text.index(f"\n{heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def expected_prints(code: str) -> list[str]:
    """The comment of every ``print(...)  # comment`` line: what that line must print."""
    return [
        line.split("  # ", 1)[1].strip()
        for line in code.splitlines()
        if line.startswith("print(") and "  # " in line
    ]


def test_fenced_blocks_finds_blocks_and_their_lines() -> None:
    text = "intro\n```python\nx = 1\n```\n\n```bash\nls\n```\n```python\ny = 2\n```\n"
    assert fenced_blocks(text, "python") == [(3, "x = 1\n"), (10, "y = 2\n")]
    assert fenced_blocks(text, "bash") == [(7, "ls\n")]


def test_expected_prints_reads_the_comments_of_print_lines() -> None:
    code = "x = 1  # not a print\nprint(x)  # 1\nprint(x)\n"
    assert expected_prints(code) == ["1"]


PYTHON_BLOCKS = fenced_blocks(README, "python")


def test_the_readme_has_python_blocks() -> None:
    assert len(PYTHON_BLOCKS) >= 3


@pytest.mark.parametrize(
    "code", [code for _, code in PYTHON_BLOCKS], ids=[f"line{n}" for n, _ in PYTHON_BLOCKS]
)
def test_python_block_runs_and_prints_what_its_comments_say(code: str) -> None:
    if "ZmqEventPublisher" in code:
        pytest.importorskip("zmq", reason="the events extra (pyzmq) is not installed")
        pytest.importorskip("msgspec", reason="the events extra (msgspec) is not installed")
        # Port 0 binds a free port: the README's fixed ports may be taken on a test machine.
        code = code.replace(":5557", ":0").replace(":5558", ":0")
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        exec(compile(code, "README.md", "exec"), {"__name__": "__readme__"})
    printed = output.getvalue().splitlines()
    for line, comment in zip(printed, expected_prints(code), strict=False):
        assert comment == line or comment.startswith(f"{line}:"), (line, comment)
    assert len(printed) >= len(expected_prints(code))


def test_first_block_pins_torch_then_installs_the_test_extra_then_runs_the_quick_suite() -> None:
    _, first = fenced_blocks(README, "bash")[0]
    commands = [line.split("#", 1)[0].strip() for line in first.splitlines()]
    commands = [command for command in commands if command]
    assert commands == [
        'pip install "torch==2.13.0"',
        'pip install -e ".[test]"',
        "python -m pytest -q",
    ]
    before = README[: README.index(first)]
    assert "CPU-only" in section(README, "## Quick start") and "CPU-only" in before


def test_full_suite_block_runs_every_test_with_the_gate() -> None:
    """CI runs it right after the first block (.ci/run): the slow tests and coverage."""
    _, block = fenced_blocks(section(README, "## Full suite"), "bash")[0]
    commands = [line.split("#", 1)[0].strip() for line in block.splitlines()]
    assert [command for command in commands if command] == ["python -m pytest -q --full --cov"]
    assert '"## Full suite"' in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def test_development_block_runs_the_linters_and_the_type_checker() -> None:
    _, first = fenced_blocks(section(README, "## Development"), "bash")[0]
    assert 'pip install -e ".[dev]"' in first
    for command in ("ruff check .", "ruff format --check .", "mypy"):
        assert command in first


def test_every_extra_the_readme_names_exists() -> None:
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from 3.11")
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    extras = set(pyproject["project"]["optional-dependencies"])
    named = set(re.findall(r"""(?:prefixcache|\.)\[(\w+)\]""", README))
    assert named, "the README names no extra"
    assert named <= extras, named - extras
    assert {"test", "dev"} <= extras


def importorskip_targets() -> set[str]:
    """Every module the suite hands to ``pytest.importorskip``."""
    names = set()
    for path in (ROOT / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "importorskip"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                names.add(node.args[0].value)
    return names


def test_the_test_extra_installs_every_optional_module_the_suite_uses() -> None:
    """After the README's install line nothing but the named exceptions may skip."""
    wanted = {name for name in importorskip_targets() if not name.startswith(MAY_BE_MISSING)}
    assert {"zmq", "msgspec"} <= wanted
    missing = []
    for name in sorted(wanted):
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    assert not missing, f"not installed by the test extra: {missing}"
