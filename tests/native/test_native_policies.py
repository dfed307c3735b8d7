"""Each native policy makes its Python class's decisions, call for call.

The engine talks to a policy only through the calls of ``EvictionPolicy`` (DESIGN.md,
"Native policies"), so a native policy that answers every call as its Python class does
behaves identically inside either engine. Hypothesis draws programs of valid calls
(insert, discard, touch, evict(1), an exposed parent's ``evicts_first`` then insert,
relocate, on_register, on_hit, on_end, set_retention, clear) and runs them on
``_native.NativePolicy(name)`` and on ``prefixcache.policies.get(name)``; after every call
the answers, the size and the tracked set must agree, and at the end both must give the
same victims until empty.
"""

from __future__ import annotations

import copy
import os
import random
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixcache import policies
from prefixcache.engine.native_engine import native_available

pytestmark = [
    pytest.mark.skipif(not native_available(), reason="the native engine is not built"),
    pytest.mark.slow,  # long programs: the full suite (--full)
]

NUM_BLOCKS = 12
HASHES = list(range(1_000, 1_024))  # few, so ghost lists and history get hits

# Options each policy runs with besides its defaults: small capacities reach the limits.
OPTIONS: dict[str, list[dict[str, float | None]]] = {
    "arc": [
        {},
        {"ghost_capacity": 2},
        {"ghost_capacity": 0},
        {"initial_recency_share": 0.0},
        {"initial_recency_share": 1.0, "ghost_capacity": 3},
    ],
    "auto": [
        {},
        {"seed": 3},
        # One open duel, a one-counter sketch row (a 64-bit shift), a halving every 6 uses.
        {"duel_ratio": 0.02, "sketch_ratio": 0.01, "sample_ratio": 0.1},
        # Fast decay (the weight's rescaling past 1e100), an eager lead, a margin.
        {"half_life_ratio": 0.01, "switch_z": 0.0, "switch_margin": 0.5},
        {"safety_z": 0.0, "half_life_ratio": 0.05},  # the safety net trips and holds
        {"safety_z": None, "seed": 7, "switch_z": 0.5},  # the net off
    ],
    "fifo": [{}],
    "hazard": [
        {},
        {"history_capacity": 2, "half_life": 1},
        {"history_capacity": 0, "age_smoothing": 1.0, "window": 0.5},
        {"half_life": 3, "prior_weight": 0.5},
        {"history_capacity": 5, "half_life": 40},  # both maps full, hashes moving between
    ],
    "lfu": [{}, {"frequency_weight": 0.3}, {"frequency_weight": 2.5}],
    "lru": [{}],
    "priority": [
        {},
        {"max_retained_fraction": 0.0},
        {"max_retained_fraction": 1.0, "default_priority": 50},
    ],
    "protected_lru": [{}, {"history_capacity": 2}, {"history_capacity": 0}],
    "reuse_lru": [
        {},
        {"history_capacity": 2, "age_smoothing": 1.0},
        {"history_capacity": 0, "reuse_weight": 0.0},
        {"reuse_weight": 2.5, "age_smoothing": 0.3},
    ],
    "s3fifo": [
        {},
        {"ghost_capacity": 2},
        {"ghost_capacity": 0, "small_fraction": 0.5},
        {"small_fraction": 0.9, "promote_after": 2},
    ],
    "slru": [
        {},
        {"protected_fraction": 0.0},
        {"protected_fraction": 1.0},
        {"protected_fraction": 0.5},
    ],
}

CASES = [
    pytest.param(name, options, id=f"{name}-{i}")
    for name in sorted(OPTIONS)
    for i, options in enumerate(OPTIONS[name])
]

EXAMPLES = int(os.environ.get("PREFIXCACHE_POLICY_EXAMPLES", "20"))
LONG_STEPS = int(os.environ.get("PREFIXCACHE_POLICY_LONG_STEPS", "1500"))  # fewer under ASan


def native_policy(name: str, options: dict[str, Any], num_blocks: int = NUM_BLOCKS) -> Any:
    """The native twin of ``policies.get(name, **options)``, with the options the engine
    passes (``auto``'s sketch multipliers come from the Python class)."""
    from prefixcache.engine import _native
    from prefixcache.engine.selection import native_policy_spec

    spec = native_policy_spec({"name": name, **options}, policies.get(name, **options))
    assert spec is not None and spec[0] == name
    return _native.NativePolicy(name, num_blocks, spec[1])


def test_every_native_policy_has_a_case() -> None:
    from prefixcache.engine import _native

    assert sorted(OPTIONS) == _native.native_policy_names()


class Program:
    """One run: the two policies, the model of what is tracked, the clock.

    Choices come from ``pick`` and ``number``: hypothesis draws (short programs that
    shrink) or a seeded generator (long programs that fill ghost lists and histories and
    reach the periodic refreshes of learned statistics).
    """

    def __init__(
        self, name: str, options: dict[str, Any], draw: Any, num_blocks: int = NUM_BLOCKS
    ) -> None:
        self.num_blocks = num_blocks
        self.native = native_policy(name, options, num_blocks)
        self.python = policies.get(name, **options)
        self.tracked: dict[int, int] = {}  # block -> its hash
        self.clock = 0
        self.retention = policies.has_hook(self.python, "set_retention")
        self.draw = draw  # draw(kind, a, b): "pick" from a sequence or "number" in [a, b]

    def pick(self, choices: Sequence[Any]) -> Any:
        return self.draw("pick", choices, None)

    def number(self, low: int, high: int) -> int:
        return int(self.draw("number", low, high))

    def both(self, method: str, *args: object) -> object:
        expected = getattr(self.python, method)(*args)
        got = getattr(self.native, method)(*args)
        assert got == expected, f"{method}{args}: native {got!r}, python {expected!r}"
        return expected

    def leaf(self, block_id: int) -> tuple[int, int, int, int, int]:
        used = set(self.tracked.values())
        block_hash = self.pick([h for h in HASHES if h not in used])
        last_access = self.number(max(0, self.clock - 6), self.clock)
        return block_id, block_hash, last_access, self.number(1, 4), self.number(0, 5)

    def step(self) -> None:
        self.clock += self.number(0, 2)
        free = [b for b in range(self.num_blocks) if b not in self.tracked]
        held = sorted(self.tracked)
        kinds = ["register", "hit", "end"]
        if free and len(self.tracked) < len(HASHES):
            kinds += ["insert", "insert", "insert", "expose"]
        if held:
            kinds += ["discard", "touch", "touch", "evict", "evict"]
        if held and free and len(self.tracked) < len(HASHES):  # leaf() draws an unused hash
            kinds.append("relocate")
        if self.retention:
            kinds.append("retain")
        kind = self.pick(kinds)
        if kind == "insert":
            args = self.leaf(self.pick(free))
            self.both("insert", *args)
            self.tracked[args[0]] = args[1]
        elif kind == "expose":  # what the engine does with a parent a victim exposed
            args = self.leaf(self.pick(free))
            if not self.both("evicts_first", *args):
                self.both("insert", *args)
                self.tracked[args[0]] = args[1]
        elif kind == "discard":
            block_id = self.pick(held)
            self.both("discard", block_id)
            del self.tracked[block_id]
        elif kind == "touch":
            self.clock += 1
            self.both("touch", self.pick(held), self.clock)
        elif kind == "evict":
            for block_id in self.both("evict", 1):
                del self.tracked[block_id]
        elif kind == "relocate":
            old = self.pick(held)
            _, _, last_access, num_accesses, depth = self.leaf(old)
            new = self.pick(free)
            self.both("relocate", old, new, self.tracked[old], last_access, num_accesses, depth)
            self.tracked[new] = self.tracked.pop(old)
        elif kind == "register":
            run = [self.pick(HASHES) for _ in range(self.number(1, 4))]
            self.both("on_register", run, self.number(0, 5))
        elif kind == "hit":  # a matched prefix, root first (inner blocks included)
            self.both("on_hit", [self.pick(HASHES) for _ in range(self.number(1, 4))])
        elif kind == "end":  # blocks a conversation's end freed (after their discard)
            self.both("on_end", [self.pick(HASHES) for _ in range(self.number(1, 3))])
        else:
            expires = None if self.number(0, 1) else self.number(self.clock, self.clock + 20)
            priority = self.number(0, 100)
            self.both("set_retention", self.pick(HASHES), priority, expires)
        assert len(self.native) == len(self.python) == len(self.tracked)
        for block_id in range(self.num_blocks):
            assert (block_id in self.native) == (block_id in self.python), block_id

    def drain(self) -> None:
        while self.tracked:
            for block_id in self.both("evict", 1):
                del self.tracked[block_id]
        assert self.both("evict", 1) == []


def hypothesis_draw(data: st.DataObject) -> Any:
    def draw(kind: str, a: Any, b: Any) -> Any:
        return data.draw(st.sampled_from(a) if kind == "pick" else st.integers(a, b))

    return draw


def seeded_draw(seed: int) -> Any:
    rng = random.Random(seed)

    def draw(kind: str, a: Any, b: Any) -> Any:
        return rng.choice(a) if kind == "pick" else rng.randint(a, b)

    return draw


@pytest.mark.parametrize(("name", "options"), CASES)
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data(), steps=st.integers(1, 80))
def test_native_policy_answers_as_its_python_class(
    name: str, options: dict[str, float], data: st.DataObject, steps: int
) -> None:
    program = Program(name, options, hypothesis_draw(data))
    for _ in range(steps):
        program.step()
    program.drain()


@pytest.mark.parametrize(("name", "options"), CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_long_programs_agree(name: str, options: dict[str, float], seed: int) -> None:
    """Long seeded programs: ghost lists and histories wrap, learned tables refresh."""
    program = Program(name, options, seeded_draw(seed))
    for _ in range(LONG_STEPS):
        program.step()
    program.drain()


@pytest.mark.parametrize(("name", "options"), CASES)
def test_a_copy_carries_the_whole_state_and_is_independent(
    name: str, options: dict[str, float]
) -> None:
    """copy.deepcopy of a native policy answers as a deep copy of its Python class, and
    the original goes on as before (the vLLM plugin replays its order on a copy)."""
    program = Program(name, options, seeded_draw(2))
    for _ in range(300):
        program.step()
    twin = copy.copy(program)
    twin.native, twin.python = copy.deepcopy(program.native), copy.deepcopy(program.python)
    twin.tracked = dict(program.tracked)
    for _ in range(300):
        twin.step()
    twin.drain()
    assert len(copy.copy(program.native)) == len(program.tracked)
    for _ in range(300):
        program.step()
    program.drain()


@pytest.mark.parametrize(("name", "options"), CASES)
def test_clear_forgets_everything(name: str, options: dict[str, float]) -> None:
    native = native_policy(name, options)
    for block_id in range(4):
        native.insert(block_id, 1_000 + block_id, block_id, 1, 0)
    native.clear()
    assert len(native) == 0 and native.evict(1) == []
    native.insert(0, 1_000, 5, 1, 0)
    assert native.evict(1) == [0]


@pytest.mark.parametrize("seed", [0, 5])
def test_auto_follows_a_pool_estimate_that_grows(seed: int) -> None:
    """Block IDs past 64 grow auto's pool estimate: the sketch widens (keeping its counts),
    the duel bound and the decay change, in both classes alike."""
    program = Program("auto", {"seed": seed}, seeded_draw(seed), num_blocks=300)
    for _ in range(LONG_STEPS):
        program.step()
    program.drain()


def test_auto_needs_the_multipliers_its_seed_picks() -> None:
    """The native auto does not reimplement Python's random: a seed but 0 needs them."""
    from prefixcache.engine import _native
    from prefixcache.errors import ConfigError

    with pytest.raises(ConfigError, match="sketch multipliers"):
        _native.NativePolicy("auto", 4, {"seed": 1})
    with pytest.raises(ConfigError, match="switch_margin"):
        _native.NativePolicy("auto", 4, {"switch_margin": 1.0})
    assert len(native_policy("auto", {"seed": 1})) == 0


def test_unknown_names_and_options_are_config_errors() -> None:
    from prefixcache.engine import _native
    from prefixcache.errors import ConfigError

    with pytest.raises(ConfigError, match="no native policy named nope"):
        _native.NativePolicy("nope", 4)
    with pytest.raises(ConfigError, match="has no option"):
        _native.NativePolicy("lru", 4, {"ghost_capacity": 3})
    with pytest.raises(ConfigError, match="num_blocks"):
        _native.NativePolicy("lru", 0)


def test_calls_are_checked_before_the_policy_sees_them() -> None:
    from prefixcache.engine import _native
    from prefixcache.errors import BlockStateError, InvalidBlockIdError

    native = _native.NativePolicy("lru", 4)
    native.insert(1, 1_001, 0, 1, 0)
    with pytest.raises(InvalidBlockIdError):
        native.insert(4, 1_004, 0, 1, 0)
    with pytest.raises(BlockStateError):
        native.insert(1, 1_001, 0, 1, 0)
    with pytest.raises(KeyError):
        native.discard(2)
    with pytest.raises(KeyError):
        native.touch(2, 3)
    with pytest.raises(NotImplementedError):
        native.set_retention(1_001, 3)
    assert len(native) == 1 and 1 in native and "1" not in native
