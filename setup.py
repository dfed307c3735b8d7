"""Build of the optional native engine, ``prefixcache.engine._native`` (C++17).

Everything else about the package is declared in ``pyproject.toml``; this file
only adds the extension. It is optional: if the compiler is missing or the
build fails, setuptools warns and installs the package without it, and the
library runs on the pure-Python engine (``prefixcache.engine.native_available()``
is False; importing prefixcache warns once). ``PREFIXCACHE_NO_NATIVE=1`` skips
the build on purpose (to test that fallback). See DESIGN.md, "The native engine".
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from setuptools import Extension, setup

NATIVE = "prefixcache/engine/native"
# Every .cpp of the native folder and of its policies/ (one file a native policy).
SOURCES = sorted(
    str(path.relative_to(NATIVE))
    for path in [*Path(NATIVE).glob("*.cpp"), *Path(NATIVE).glob("policies/*.cpp")]
)
HEADERS = sorted(
    str(path.relative_to(NATIVE))
    for path in [*Path(NATIVE).glob("*.h"), *Path(NATIVE).glob("policies/*.h")]
)


def native_extensions() -> list[Extension]:
    """The native engine's extension, or none when PREFIXCACHE_NO_NATIVE is set."""
    if os.environ.get("PREFIXCACHE_NO_NATIVE"):
        return []
    if sys.platform == "win32":
        compile_args = ["/std:c++17", "/O2", "/EHsc"]
    else:
        compile_args = ["-std=c++17", "-O3", "-fvisibility=hidden", "-Wall"]
    return [
        Extension(
            "prefixcache.engine._native",
            sources=[f"{NATIVE}/{name}" for name in SOURCES],
            depends=[f"{NATIVE}/{name}" for name in HEADERS],
            include_dirs=[NATIVE],
            language="c++",
            extra_compile_args=compile_args,
            optional=True,
        )
    ]


setup(ext_modules=native_extensions())
