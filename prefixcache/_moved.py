"""Old module paths of the flat layout, kept importable with a DeprecationWarning.

Round 2 moved the modules into layer subpackages (DESIGN.md, "Layers"); issue
30 moved the reference loops, the toy models and the trace model from
``prefixcache.serving`` to ``prefixcache.reference``. A meta-path finder maps
each old name, for example ``prefixcache.allocator``, to its new module, so
``from prefixcache.allocator import KVBlockAllocator`` keeps working and says
where the name lives now. Remove in 0.3.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

MOVED_MODULES = {
    "prefixcache.allocator": "prefixcache.engine.allocator",
    "prefixcache.block_ids": "prefixcache.engine.block_ids",
    "prefixcache.config": "prefixcache.engine.config",
    "prefixcache.eviction": "prefixcache.engine.eviction",
    "prefixcache.events": "prefixcache.engine.events",
    "prefixcache.hashing": "prefixcache.engine.hashing",
    "prefixcache.invariants": "prefixcache.engine.invariants",
    "prefixcache.journal": "prefixcache.engine.journal",
    "prefixcache.locked": "prefixcache.engine.locked",
    "prefixcache.pool": "prefixcache.engine.pool",
    "prefixcache.registry": "prefixcache.engine.registry",
    "prefixcache.routing": "prefixcache.engine.routing",
    "prefixcache.stats": "prefixcache.engine.stats",
    "prefixcache.types": "prefixcache.engine.types",
    "prefixcache.block_table": "prefixcache.serving.block_table",
    "prefixcache.kv_cache": "prefixcache.serving.kv_cache",
    "prefixcache.sim": "prefixcache.reference.sim",
    "prefixcache.trace": "prefixcache.reference.trace",
    "prefixcache.publisher": "prefixcache.wire.publisher",
    "prefixcache.metrics": "prefixcache.wire.metrics",
    "prefixcache.cli": "prefixcache.tools.cli",
    "prefixcache.replay": "prefixcache.tools.replay",
    "prefixcache.workloads": "prefixcache.tools.workloads",
    # Issue 30 moved what verifies and demonstrates the library out of serving.
    "prefixcache.serving.sim": "prefixcache.reference.sim",
    "prefixcache.serving.sim_hybrid": "prefixcache.reference.sim_hybrid",
    "prefixcache.serving.model": "prefixcache.reference.model",
    "prefixcache.serving.model_serving": "prefixcache.reference.model_serving",
    "prefixcache.serving.toy_hybrid": "prefixcache.reference.toy_hybrid",
    "prefixcache.serving.trace": "prefixcache.reference.trace",
}


class _AliasLoader(importlib.abc.Loader):
    """Loads an old name as the already-imported new module."""

    def __init__(self, new_name: str) -> None:
        self.new_name = new_name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(
            f"{spec.name} moved to {self.new_name}; import it from there",
            DeprecationWarning,
            stacklevel=2,
        )
        module = importlib.import_module(self.new_name)
        self._spec = module.__spec__  # the import machinery overwrites it with the alias's
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the new module is already executed; give it back its own spec."""
        module.__spec__ = self._spec


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds the old flat-layout names listed in :data:`MOVED_MODULES`."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        new_name = MOVED_MODULES.get(fullname)
        if new_name is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(new_name))


def install() -> None:
    """Put the finder on ``sys.meta_path`` once."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
