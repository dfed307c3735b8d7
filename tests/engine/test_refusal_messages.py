"""Refusals say exactly what is wrong: each error's message, word for word.

Other tests check that a bad call raises the right class; these pin the
message a caller reads (the argument, the bound, the value), for the
allocator's methods, registration's arguments, verify mode's fingerprints,
the constructor, and ``check_invariants()``, which joins the first five
problems it finds.

``tests/MUTATION.md`` lists the mutants these tests kill and the survivors that are equivalent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from prefixcache.policies import LRUPolicy

from prefixcache import AllocatorConfig, InvariantError, KVBlockAllocator
from prefixcache.engine.invariants import find_invariant_problems

Make = Callable[..., KVBlockAllocator]


def _refusal_cases() -> list[Any]:
    """(setup-and-call, error type name, exact message pattern) per refusal."""

    def block_of(allocator: KVBlockAllocator, state: str) -> int:
        (block,) = allocator.allocate_memory_blocks(1).tolist()
        if state == "cached":
            allocator.register_kv_block_hashes([block], [77])
            allocator.release_memory_blocks([block])
        elif state == "paused":
            allocator.pause([block])
        elif state == "free":
            allocator.release_memory_blocks([block])
        return block

    def release(state: str, paused: Any) -> Callable[[KVBlockAllocator], Any]:
        def call(allocator: KVBlockAllocator) -> Any:
            block = block_of(allocator, state)
            return lambda: allocator.release_memory_blocks([block], paused=paused)

        return call

    def queued_twice(allocator: KVBlockAllocator) -> Any:
        block = block_of(allocator, "active")

        def call() -> None:
            with allocator.free_group():
                allocator.release_memory_blocks([block, block])

        return call

    def on(method: str, *args: Any, **kwargs: Any) -> Callable[[KVBlockAllocator], Any]:
        return lambda allocator: lambda: getattr(allocator, method)(*args, **kwargs)

    def on_block(state: str, method: str, *args: Any) -> Callable[[KVBlockAllocator], Any]:
        def call(allocator: KVBlockAllocator) -> Any:
            block = block_of(allocator, state)
            return lambda: getattr(allocator, method)([block], *args)

        return call

    def twice_in_one_call(allocator: KVBlockAllocator) -> Any:
        (block,) = allocator.allocate_memory_blocks(1).tolist()
        return lambda: allocator.register_kv_block_hashes([block, block], [5, 6])

    b = r"block \d+"
    return [
        (
            release("cached", False),
            "ReferenceCountError",
            rf"{b} \(cached\) holds 0 active reference\(s\); asked to drop 1",
        ),
        (
            release("free", False),
            "ReferenceCountError",
            rf"{b} \(free\) holds 0 active reference\(s\); asked to drop 1",
        ),
        (
            release("paused", False),
            "ReferenceCountError",
            rf"{b} \(paused\) holds 0 active reference\(s\); asked to drop 1",
        ),
        (
            release("active", True),
            "ReferenceCountError",
            rf"{b} \(active\) holds 0 paused reference\(s\); asked to drop 1",
        ),
        (
            queued_twice,
            "ReferenceCountError",
            rf"{b} \(active\) holds 1 active \(after queued releases\) reference\(s\); "
            "asked to drop 2",
        ),
        (
            release("active", "no"),
            "InvalidArgumentError",  # type: ignore[arg-type]
            "paused must be a bool, got 'no'",
        ),
        (
            on("allocate_memory_blocks", 2.0),
            "InvalidArgumentError",
            "num_blocks must be an int >= 0, got 2.0",
        ),
        (
            on("allocate_memory_blocks", -1),
            "InvalidArgumentError",
            "num_blocks must be an int >= 0, got -1",
        ),
        (
            on("match_prefix", [1], acquire="yes"),
            "InvalidArgumentError",
            "acquire must be a bool, got 'yes'",
        ),
        (
            on("match_prefix", "ab"),
            "InvalidTensorError",
            "block_hashes must be a sequence of ints or a 1-D integer tensor, got str",
        ),
        (
            on("set_retention_priority", "ab", 1),
            "ConfigError",
            r"policy LRUPolicy does not support retention priorities; "
            r"configure one that does \(e\.g\. 'priority'\)",
        ),
        (
            on_block("active", "register_kv_block_hashes", "ab"),
            "InvalidTensorError",
            "block_hashes must be a sequence of ints or a 1-D integer tensor, got str",
        ),
        (
            on_block("active", "register_kv_block_hashes", [1, 2]),
            "InvalidArgumentError",
            "1 block IDs but 2 hashes",
        ),
        (
            on_block("free", "register_kv_block_hashes", [1]),
            "BlockStateError",
            rf"{b} \(free\) is not referenced; register blocks while a request holds them",
        ),
        (
            twice_in_one_call,
            "HashConflictError",
            r"block \d+ appears twice with different hashes \(5 and 6\)",
        ),
        (
            on_block("free", "acquire_blocks"),
            "BlockStateError",
            r"block \d+ is free; only cached or referenced blocks can be acquired "
            r"\(allocate fresh blocks instead\)",
        ),
        (
            on_block("free", "update_timestamps"),
            "BlockStateError",
            r"block \d+ is free; it has no timestamp to update",
        ),
        (
            on("is_hash_registered", "1"),
            "InvalidArgumentError",
            "block_hash must be an int, got '1'",
        ),
        (
            on("is_hash_registered", True),
            "InvalidArgumentError",
            "block_hash must be an int, got True",
        ),
        (
            on("advance_clock", -1),
            "InvalidArgumentError",
            r"ticks must be an int in \[0, 4611686018427387904\], got -1",
        ),
        (
            on("hash_tokens", [1, 2], extra_keys="k"),
            "InvalidArgumentError",
            "extra_keys must be a list or tuple of keys, got str",
        ),
        (on("take_events"), "ConfigError", r"KV cache events are off; set kv_events_capacity > 0"),
    ]


# ---------------------------------------------------------------------- messages


@pytest.mark.parametrize(("setup", "error", "message"), _refusal_cases())
def test_refusals_say_exactly_what_is_wrong(
    setup: Callable[[KVBlockAllocator], Callable[[], Any]],
    error: str,
    message: str,
    make_small: Make,
) -> None:
    allocator = make_small(paused_count=3)
    call = setup(allocator)
    with pytest.raises(Exception, match=f"^{message}$") as info:
        call()
    assert type(info.value).__name__ == error


def test_register_refuses_a_lora_name_that_is_not_a_string_and_tokens_of_the_wrong_size() -> None:
    allocator = KVBlockAllocator(
        total_count=10, block_size_tokens=2, device="cpu", kv_events_capacity=10
    )
    ids = allocator.allocate_memory_blocks(1)
    with pytest.raises(Exception, match=r"^lora_name must be a string or None, got 3$"):
        allocator.register_kv_block_hashes(ids, [5], lora_name=3)  # type: ignore[arg-type]
    with pytest.raises(Exception, match=r"^token_ids has 3 tokens; 1 blocks of 2 need 2$"):
        allocator.register_kv_block_hashes(ids, [5], token_ids=[1, 2, 3])
    with pytest.raises(Exception, match=r"^token_ids must contain only ints$"):
        allocator.register_kv_block_hashes(ids, [5], token_ids=[1.5, 2.5])


def test_verify_mode_names_the_missing_or_malformed_fingerprints() -> None:
    allocator = KVBlockAllocator(
        total_count=10, block_size_tokens=2, device="cpu", verify_prefix_hits=True
    )
    with pytest.raises(
        Exception, match=r"^verify_prefix_hits is on: pass fingerprints \(see fingerprint_tokens\)$"
    ):
        allocator.match_prefix([1])
    with pytest.raises(Exception, match=r"^fingerprints must be a sequence of ints or a 1-D"):
        allocator.match_prefix([1], fingerprints="ab")


def test_the_constructor_names_a_wrong_config() -> None:
    config = AllocatorConfig(total_count=8, device="cpu")
    with pytest.raises(
        Exception, match=r"^pass either an AllocatorConfig or keyword arguments, not both$"
    ):
        KVBlockAllocator(config, total_count=8)
    with pytest.raises(Exception, match=r"^config must be an AllocatorConfig, got object$"):
        KVBlockAllocator(object())  # type: ignore[arg-type]
    assert repr(KVBlockAllocator(config)) == "KVBlockAllocator(total_count=8, policy=LRUPolicy)"


# ---------------------------------------------------------------------- counters


def test_check_invariants_joins_the_first_five_problems(make_small: Make) -> None:
    allocator = make_small(LRUPolicy())
    (
        allocator._engine.ledger.num_active,
        allocator._engine.ledger.num_paused,
        allocator._engine.ledger.num_cached,
    ) = 3, 2, 4
    allocator._engine.refs.active[2] = -1
    allocator._engine.refs.pending[1] = 1
    problems = find_invariant_problems(allocator._engine)
    assert len(problems) > 5
    with pytest.raises(InvariantError) as info:
        allocator.check_invariants()
    assert str(info.value) == "; ".join(problems[:5])
