"""The shared harness's vLLM peers with prefixcache's vLLM plugin installed.

``../shared/bench/run_peers.py`` drives vLLM 0.33's real ``BlockPool`` as two peers:
``vllm`` (a new request per turn) and ``vllm-session`` (vLLM's streaming-input sessions:
one resumable ``Request`` across turns, hashed incrementally, its blocks kept between
turns). The adapters here are those peers with :func:`prefixcache.integrations.vllm.install`
called first, so every pool they build frees and hands out blocks through the plugin's
queue (the native queue for a policy with a native unit). W4 through them shows what a
continuing request costs inside vLLM with the plugin: vLLM's own session path, the
plugin's eviction order (issue 27, "the vLLM integration where the host gives a
continuing request"). The harness's own classes are taken from the running harness
(``BUILTIN``), never copied.

Run from the checkout where vLLM 0.33 is installed (``../shared/bench/README.md``)::

    PYTHONPATH=. $PEERS_VENV/bin/python ../shared/bench/run_peers.py --peers vllm-session \\
      --adapter benchmarks/vllm_peer_adapters.py:VllmSessionWithPlugin --workloads W4
"""

from __future__ import annotations

import sys
from typing import Any


def _harness_peer(name: str) -> type:
    """The running harness's built-in peer class ``name`` (``run_peers.BUILTIN``)."""
    main = sys.modules.get("__main__")
    builtin = getattr(main, "BUILTIN", None)
    if builtin is None:  # imported some other way: the harness is on sys.path
        import run_peers

        builtin = run_peers.BUILTIN
    return builtin[name]  # type: ignore[no-any-return]


def _with_plugin(peer: str, policy: str) -> type:
    """A subclass of harness peer ``peer`` whose pools run the plugin with ``policy``."""
    base = _harness_peer(peer)

    def prefix_init(self: Any, pool_blocks: int, block_size: int) -> None:
        from prefixcache.integrations import vllm as plugin

        plugin.install(policy)
        base.prefix_init(self, pool_blocks, block_size)
        queue = type(self.pool.free_block_queue)
        if not queue.__module__.startswith("prefixcache."):  # the plugin must be what runs
            raise RuntimeError(f"the pool's queue is {queue.__module__}.{queue.__name__}")

    def version(self: Any) -> str:
        return f"{base.version(self)} + prefixcache {policy}"

    name = f"{base.name}+prefixcache-{policy}"
    return type(
        f"{base.__name__}With{policy.title()}",
        (base,),
        {"name": name, "prefix_init": prefix_init, "version": version},
    )


VllmSessionWithPlugin = _with_plugin("vllm-session", "lru")
VllmSessionWithAuto = _with_plugin("vllm-session", "auto")
VllmWithPlugin = _with_plugin("vllm", "lru")
