"""What the reference loop reports: a :class:`StepReport` per step, summed in a :class:`SimReport`.

Plain frozen records, apart from the loop (:mod:`prefixcache.reference.sim`)
so that readers of a run's numbers need not read the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class StepReport:
    """What one :meth:`DynamicBatchingSim.step` did, and the state it left.

    Requests and blocks are counted after the step; events and tokens within it.
    ``prompt_tokens`` and ``prefill_tokens_saved`` belong to the requests
    admitted in this step (a requeued request is counted again when readmitted).
    """

    step: int
    num_running: int
    num_paused: int
    num_waiting: int
    num_free_blocks: int
    num_active_blocks: int
    num_paused_blocks: int
    num_cached_blocks: int
    num_finished: int = 0
    prompt_tokens: int = 0
    prefill_tokens_saved: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    num_evicted_blocks: int = 0
    num_pauses: int = 0
    num_resumes: int = 0
    num_preemptions: int = 0


_SUMMED = (
    "num_finished",
    "prompt_tokens",
    "prefill_tokens_saved",
    "prefill_tokens",
    "decode_tokens",
    "num_evicted_blocks",
    "num_pauses",
    "num_resumes",
    "num_preemptions",
)


@dataclass(frozen=True)
class SimReport:
    """Totals of a run: the events of every :class:`StepReport` summed.

    ``hit_rate`` is the prefix hit rate in tokens: prompt tokens served from
    the cache over prompt tokens admitted. ``num_preemptions`` counts paused
    requests released and requeued.
    """

    num_steps: int
    num_requests: int
    num_finished: int
    prompt_tokens: int
    prefill_tokens_saved: int
    prefill_tokens: int
    decode_tokens: int
    num_evicted_blocks: int
    num_pauses: int
    num_resumes: int
    num_preemptions: int
    steps: tuple[StepReport, ...] = field(default=(), repr=False)

    @property
    def hit_rate(self) -> float:
        """Prompt tokens served from the cache over prompt tokens admitted (0.0 if none)."""
        return self.prefill_tokens_saved / self.prompt_tokens if self.prompt_tokens else 0.0

    def summary(self) -> str:
        """A few human-readable lines."""
        return (
            f"{self.num_finished}/{self.num_requests} requests in {self.num_steps} steps\n"
            f"prefix hit rate {self.hit_rate:.1%}: {self.prefill_tokens_saved:,} of "
            f"{self.prompt_tokens:,} prompt tokens served from cache\n"
            f"computed {self.prefill_tokens:,} prefill + {self.decode_tokens:,} decode tokens\n"
            f"evicted {self.num_evicted_blocks:,} blocks; {self.num_pauses} pauses, "
            f"{self.num_resumes} resumes, {self.num_preemptions} requeued"
        )
