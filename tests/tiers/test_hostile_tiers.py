"""Issue 28, "How to test": hostile programs over the tier classes, on both engines.

Where ``tests/properties/test_hostile_api.py`` drives the allocator alone, these
programs drive the whole tier stack a scheduler embeds (a ``KVBlockAllocator``,
its :class:`HostTier`, the :class:`TieredCache` over both, the
:class:`RequestCache` over that and their :class:`WeightEpochs`): valid request
steps (admit, append, preempt, finish, copies taken) mixed with calls of every
public method of those classes with arguments drawn from a hostile pool (IDs
and hashes held or not, the 64-bit edges, bools, floats, None, strings, nested
lists, unhashable request IDs) and from what the stack holds now. After every
call:

- a call that raises raises the library's error (a bare ``TypeError`` or
  ``KeyError`` fails the test) and leaves the whole stack exactly as it was
  (:func:`deep_state`, every attribute of every object reachable from the
  stack, the allocator by :func:`state_digest`);
- ``TieredCache.check()`` (which checks the host tier and the allocator) holds.

The methods are listed from the classes themselves (:func:`public_methods`),
so a method a class gains is called hostilely without a change here.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from prefixcache import KVBlockAllocator, PrefixCacheError
from prefixcache.engine.native_engine import native_available
from prefixcache.testing import deep_state
from prefixcache.tiers import HostTier, RequestCache, TieredCache
from prefixcache.tiers.epochs import WeightEpochs

BLOCK = 2
INT64_MAX = (1 << 63) - 1
HOSTILE: list[Any] = [
    -1,
    0,
    1,
    3,
    INT64_MAX,
    INT64_MAX + 1,
    -(1 << 63) - 1,
    1 << 64,
    True,
    2.5,
    float("nan"),
    None,
    "1",
    b"\x01",
    [],
    [[1]],
    {},
    [None],
    [1.5],
    [True],
    [-1],
    [1 << 64],
    np.int64(2),
    np.array([[1, 2]]),
    np.array([1.5]),
    torch.tensor([1, 2], dtype=torch.int64),
]
"""Values wrong for most parameters, or right by a hair."""

SKIPPED = {"check", "take_events", "take_transfer", "stats", "counters", "find_problems"}
"""Read-only or draining methods: called as valid steps, nothing to refuse."""


def public_methods(obj: object) -> list[str]:
    """The public methods of ``obj``'s class, minus the read-only and draining ones."""
    return sorted(
        name
        for name, member in inspect.getmembers(type(obj), inspect.isfunction)
        if not name.startswith("_") and name not in SKIPPED
    )


class Stack:
    """The tier stack under test, with the request IDs it has seen."""

    def __init__(self, engine: str) -> None:
        self.allocator = KVBlockAllocator(
            total_count=10, block_size_tokens=BLOCK, device="cpu", engine=engine
        )
        self.host = HostTier(4, block_size=BLOCK)
        self.epochs = WeightEpochs()
        self.tiered = TieredCache(self.allocator, self.host, epochs=self.epochs)
        self.requests = RequestCache(self.tiered)
        self.request_ids: list[Any] = ["r0"]
        self.objects: dict[str, Any] = {
            "host": self.host,
            "tiered": self.tiered,
            "requests": self.requests,
            "epochs": self.epochs,
        }

    def state(self) -> Any:
        return deep_state((self.allocator, self.host, self.tiered, self.requests, self.epochs))

    def known_hashes(self) -> list[int]:
        return [h for h, _ in self.allocator._engine.registered_chains()] + list(self.host._slot_of)

    def held_ids(self) -> list[int]:
        ids = np.arange(self.allocator.total_count - 1)
        active, _ = self.allocator.reference_counts(ids)
        return ids[active.numpy() > 0].tolist()


def argument(stack: Stack, name: str, data: st.DataObject) -> Any:
    """A value for the parameter ``name``: from what the stack holds, or hostile."""
    hashes = stack.known_hashes() or [1]
    ids = stack.held_ids() or [0]
    pools: dict[str, st.SearchStrategy[Any]] = {
        "block_hashes": st.lists(st.sampled_from([*hashes, 7, -1, 0]), max_size=4),
        "block_hash": st.sampled_from([*hashes, 7]),
        "parent_hash": st.one_of(st.none(), st.sampled_from(hashes)),
        "block_ids": st.lists(st.sampled_from([*ids, 9, 10]), max_size=4),
        "slots": st.lists(st.integers(-1, 5), max_size=3),
        "tokens": st.lists(st.integers(0, 3), max_size=7),
        "request_id": st.sampled_from([*stack.request_ids, "new", ["unhashable"]]),
        "tag": st.one_of(st.integers(0, 3), st.text(max_size=2)),
    }
    valid = pools.get(name, st.integers(0, 4))
    return data.draw(st.one_of(valid, st.sampled_from(HOSTILE)), label=name)


def hostile_call(stack: Stack, data: st.DataObject) -> None:
    """One public method of one tier object, with drawn arguments, under the checks."""
    owner = data.draw(st.sampled_from(sorted(stack.objects)), label="object")
    obj = stack.objects[owner]
    name = data.draw(st.sampled_from(public_methods(obj)), label="method")
    method: Callable[..., Any] = getattr(obj, name)
    args, kwargs = [], {}
    for parameter in inspect.signature(method).parameters.values():
        required = parameter.default is inspect.Parameter.empty
        if not required and not data.draw(st.booleans(), label=f"pass {parameter.name}"):
            continue
        value = argument(stack, parameter.name, data)
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY:
            kwargs[parameter.name] = value
        elif parameter.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:
            args.append(value)
    before = stack.state()
    try:
        method(*args, **kwargs)
    except PrefixCacheError:
        assert stack.state() == before, f"{owner}.{name}{tuple(args)}{kwargs} refused but changed"
    except Exception as error:  # anything else is what this test hunts
        pytest.fail(f"{owner}.{name}{tuple(args)!r}{kwargs!r} raised bare {error!r}")
    stack.tiered.check()


def valid_step(stack: Stack, data: st.DataObject) -> None:
    """A scheduler's step: admit a prompt, grow it, preempt, finish, or take the copies."""
    step = data.draw(st.sampled_from(["admit", "append", "preempt", "finish", "copies"]))
    request_id = data.draw(st.sampled_from([*stack.request_ids, f"r{len(stack.request_ids)}"]))
    try:
        if step == "admit":
            tokens = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=9))
            stack.requests.admit(request_id, tokens)
            if request_id not in stack.request_ids:
                stack.request_ids.append(request_id)
        elif step == "append":
            stack.requests.append(request_id, data.draw(st.lists(st.integers(0, 3), max_size=3)))
        elif step == "preempt":
            stack.requests.preempt(request_id)
        elif step == "finish":
            stack.requests.finish(request_id)
        else:
            stack.tiered.take_transfer()
    except PrefixCacheError:
        pass  # not running, not known: a valid-looking step the stack refuses
    stack.tiered.check()


ENGINES = ["python", "native"]


@pytest.mark.parametrize("engine", ENGINES)
@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,  # the same programs on every CI run
    phases=[Phase.explicit, Phase.generate],  # a failure reports at once, unshrunk
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_hostile_tier_programs_change_nothing_when_refused(
    engine: str, data: st.DataObject
) -> None:
    if engine == "native" and not native_available():
        pytest.skip("the native engine is not built")
    stack = Stack(engine)
    for _ in range(data.draw(st.integers(5, 30), label="steps")):
        if data.draw(st.booleans(), label="hostile"):
            hostile_call(stack, data)
        else:
            valid_step(stack, data)


def test_deep_state_sees_a_change_anywhere_in_the_stack() -> None:
    """The checker itself: a change deep inside any object shows, a no-op does not."""
    stack = Stack("python")
    stack.requests.admit("r0", [0, 1, 2, 3, 0])
    before = stack.state()
    assert stack.state() == before
    stack.host._clock += 1
    assert stack.state() != before
    stack.host._clock -= 1
    stack.requests._requests["r0"].tokens.append(5)
    assert stack.state() != before
    stack.requests._requests["r0"].tokens.pop()
    assert stack.state() == before


FOUND = [
    ("epochs", "is_retired", (None,), {}),
    ("host", "count_query", ([], 0), {}),
    ("host", "count_query", (1, 2), {}),
    ("host", "lookup", (-1,), {}),
    ("host", "lookup", ([[1]],), {}),
    ("host", "pin", (1 << 64,), {}),
    ("host", "touch", (3,), {}),
    ("host", "unpin", (0,), {}),
    ("host", "put", (-1, [None]), {"depth": 0}),
    ("host", "put", ([1], None), {"depth": 0}),
    ("host", "slot_of", ([1.5],), {}),
    ("requests", "admit", ([-1], [0, 1]), {}),
    ("requests", "admit", ("r1", [0, 1]), {"ranges": 2}),
    ("requests", "append", ([True], []), {}),
    ("requests", "block_ids_of", ([1],), {}),
    ("requests", "epoch_of", (["x"],), {}),
    ("requests", "finish", ({},), {}),
    ("requests", "hashes_of", ([1],), {}),
    ("requests", "preempt", (["x"],), {}),
]
"""What these programs found on the code before the fix: each raised a bare TypeError."""


@pytest.mark.parametrize(("owner", "name", "args", "kwargs"), FOUND)
def test_what_the_programs_found_is_refused_with_the_librarys_error(
    owner: str, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    stack = Stack("python")
    stack.requests.admit("r0", [0, 1, 2, 3, 0])
    before = stack.state()
    with pytest.raises(PrefixCacheError):
        getattr(stack.objects[owner], name)(*args, **kwargs)
    assert stack.state() == before
    assert [1] not in [stack.host]  # __contains__ of an unhashable answers, never raises
