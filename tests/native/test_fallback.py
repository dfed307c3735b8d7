"""Without the compiled extension the package still imports and runs, on the Python engine.

Each case runs in a fresh interpreter where ``prefixcache.engine._native``
cannot be imported (as after a failed build), so it runs whether or not the
extension is built here.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

BLOCKED = """
import sys, warnings
sys.modules["prefixcache.engine._native"] = None  # what a failed build leaves: ImportError
warnings.simplefilter("always")
"""


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    script = BLOCKED + textwrap.dedent(code)
    return subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**_environment(), **env},
        check=False,
    )


def _environment() -> dict[str, str]:
    import os

    return {key: value for key, value in os.environ.items() if key != "PREFIXCACHE_ENGINE"}


def test_import_warns_once_and_the_python_engine_runs() -> None:
    result = _run(
        """
        import prefixcache
        from prefixcache import KVBlockAllocator
        from prefixcache.engine.native_engine import native_available
        assert not native_available()
        allocator = KVBlockAllocator(total_count=8, device="cpu")
        allocator = KVBlockAllocator(total_count=8, device="cpu", engine="auto")
        assert allocator.engine == "python"
        assert allocator.allocate_memory_blocks(2).tolist() == [0, 1]
        print("ok")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
    assert result.stderr.count("native engine (prefixcache.engine._native) is not built") == 1


def test_asking_for_the_native_engine_without_it_is_a_config_error() -> None:
    result = _run(
        """
        from prefixcache import KVBlockAllocator
        from prefixcache.errors import ConfigError
        try:
            KVBlockAllocator(total_count=8, device="cpu", engine="native")
        except ConfigError as error:
            print("refused:", error)
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("refused: engine='native' cannot run this allocator")


def test_no_warning_when_the_python_engine_is_asked_for() -> None:
    result = _run("import prefixcache\n", PREFIXCACHE_ENGINE="python")
    assert result.returncode == 0, result.stderr
    assert "not built" not in result.stderr
