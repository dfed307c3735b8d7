"""prefixcache's installed version, for the layers that may not import the package top.

``prefixcache.__version__`` sits in the package's top-level module, above every
layer (tests/test_layers.py); the command line and the vLLM plugin's start-up
line read the installed distribution's version instead.
"""

from __future__ import annotations

import importlib.metadata

__all__ = ["installed_version"]


def installed_version() -> str:
    """The installed ``prefixcache`` distribution's version, or ``"(not installed)"``."""
    try:
        return importlib.metadata.version("prefixcache")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"
