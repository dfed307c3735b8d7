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

from setuptools import Extension, setup

NATIVE = "prefixcache/engine/native"
SOURCES = [
    "engine.cpp",
    "engine_layout.cpp",
    "engine_registry.cpp",
    "module.cpp",
    "module_engine.cpp",
]
HEADERS = [
    "binding.h",
    "block_hashing.h",
    "engine.h",
    "free_set.h",
    "hash_index.h",
    "leaf_heap.h",
    "xxh3.h",
]


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
