"""Seeded generators of Mooncake-format traces, for judging eviction policies off one trace.

Each generator returns ``list[TraceRequest]`` (see :mod:`prefixcache.reference.trace`):
arrivals in timestamp order (Poisson, ``mean_gap_ms`` apart), one hash ID per
512-token block, a partial last block. Equal seeds give equal traces. Block
IDs are fresh integers except where a family shares them on purpose, so two
requests share exactly the prefixes the family describes.

- :func:`shared_system_prompts`: many users behind few long system prompts
  of Zipf popularity, each request with its own short tail.
- :func:`multi_turn_chats`: conversations whose every turn resends the
  previous prompt plus the reply and a new message, interleaved.
- :func:`documents_with_hot_prefixes`: the scan-heavy mix: a scan of
  one-off long documents mixed with requests on a few hot prefixes.
- :func:`agent_tool_loops`: agent sessions that call tools in a loop, each
  step resending the session so far plus the tool's output, behind a few
  shared agent system prompts; some steps retry from an earlier step.
- :func:`document_qa`: questions, and follow-ups, over a few long shared
  documents of Zipf popularity.
- :func:`long_agent_sessions`: agentic sessions of 50 to 200 calls, tool
  loops between the user's turns, growing contexts, log-normal gaps,
  session ends.
- :func:`heavy_tailed_chats`: chats with log-normal think times, a share of
  them abandoned after a turn or two and never resumed.
- :func:`multi_tenant_mix`: tenants of different shapes and rates, each
  behind its own system prompt, interleaved on one cache.
- :func:`scan_pollution`: a steady hot working set hit by bursts of one-off
  long scans.

The chat and agent families mark the last turn of each conversation their
client closes (``TraceRequest.ends_conversation``; never an abandoned one):
what ``prefixcache compare --conversation-ends`` replays.

Families that keep a clock per session (the log-normal ones) are not Poisson
streams: their requests come in the order the sessions' clocks put them.
:mod:`~prefixcache.tools.workloads.split` names which (family, seed) traces
are for tuning policies and which for reporting on them.

:func:`write_mooncake_trace` writes a trace as JSONL, so ``prefixcache
compare --trace`` can replay it.

>>> trace = multi_turn_chats(6, seed=1, num_conversations=2)
>>> len(trace), trace == multi_turn_chats(6, seed=1, num_conversations=2)
(6, True)
"""

from __future__ import annotations

from prefixcache.tools.workloads.agent_loops import agent_tool_loops
from prefixcache.tools.workloads.chats import multi_turn_chats
from prefixcache.tools.workloads.document_qa import document_qa
from prefixcache.tools.workloads.heavy_tailed_chats import heavy_tailed_chats
from prefixcache.tools.workloads.hot_prefixes import documents_with_hot_prefixes
from prefixcache.tools.workloads.long_agents import long_agent_sessions
from prefixcache.tools.workloads.multi_tenant import multi_tenant_mix
from prefixcache.tools.workloads.scan_pollution import scan_pollution
from prefixcache.tools.workloads.system_prompts import shared_system_prompts
from prefixcache.tools.workloads.writer import write_mooncake_trace

__all__ = [
    "agent_tool_loops",
    "document_qa",
    "documents_with_hot_prefixes",
    "heavy_tailed_chats",
    "long_agent_sessions",
    "multi_tenant_mix",
    "multi_turn_chats",
    "scan_pollution",
    "shared_system_prompts",
    "write_mooncake_trace",
]
