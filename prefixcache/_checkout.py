"""Importing prefixcache from a source checkout that was not installed.

The repository keeps the policies in a top-level ``policies/`` folder that an
install maps to ``prefixcache.policies`` (``package-dir`` in pyproject.toml).
When the package is imported straight from a checkout (a benchmark harness
running in another virtual environment puts the checkout on ``sys.path``), no
such mapping exists, so importing this module loads ``policies/`` under that
name (``prefixcache/__init__.py`` imports it first).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def map_policies_from_checkout() -> None:
    """Make ``prefixcache.policies`` importable when only the checkout is on the path."""
    if "prefixcache.policies" in sys.modules or importlib.util.find_spec("prefixcache.policies"):
        return
    folder = Path(__file__).resolve().parent.parent / "policies"
    spec = importlib.util.spec_from_file_location(
        "prefixcache.policies", folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["prefixcache.policies"] = module
    spec.loader.exec_module(module)


map_policies_from_checkout()  # before anything imports prefixcache.policies
