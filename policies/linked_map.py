"""LinkedMap: an ordered map whose removals can be put back in place, for ghost lists."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Generic, TypeVar

_V = TypeVar("_V")


class LinkedMap(Generic[_V]):
    """An insertion-ordered map whose removals can be put back in place, newest first.

    A dictionary of links (previous key, next key, value), as in Knuth's
    dancing links: a removed entry keeps its neighbours, so :meth:`relink`
    puts it back between them in O(1), provided every later change was
    undone first (which a transaction's abort, undoing newest first,
    guarantees). Ghost lists and histories use it so that an aborted
    transaction puts an entry back in place. Iteration and
    :meth:`oldest` go oldest first; assigning an existing key keeps its
    place, as with ``OrderedDict``. Keys are never ``None``.

    Complexity: every method O(1) but iteration. Not thread-safe.
    """

    __slots__ = ("_first", "_last", "_links")

    def __init__(self) -> None:
        self._links: dict[int, list[Any]] = {}  # key -> [previous key, next key, value]
        self._first: int | None = None
        self._last: int | None = None

    def __len__(self) -> int:
        return len(self._links)

    def __contains__(self, key: object) -> bool:
        return key in self._links

    def __iter__(self) -> Iterator[int]:
        key = self._first
        while key is not None:
            yield key
            key = self._links[key][1]

    def get(self, key: int) -> _V | None:
        """The value of ``key``, or ``None``."""
        link = self._links.get(key)
        return None if link is None else link[2]

    def put(self, key: int, value: _V) -> None:
        """Set ``key`` to ``value``; a new key goes last."""
        link = self._links.get(key)
        if link is not None:
            link[2] = value
            return
        self._links[key] = [self._last, None, value]
        if self._last is None:
            self._first = key
        else:
            self._links[self._last][1] = key
        self._last = key

    def unlink(self, key: int) -> list[Any] | None:
        """Remove ``key`` if present; return its link, for :meth:`relink` (value at ``[2]``)."""
        link = self._links.pop(key, None)
        if link is None:
            return None
        previous, following, _ = link
        if previous is None:
            self._first = following
        else:
            self._links[previous][1] = following
        if following is None:
            self._last = previous
        else:
            self._links[following][0] = previous
        return link

    def unlink_oldest(self) -> tuple[int, list[Any]]:
        """Remove the oldest entry; return its key and link. The map must not be empty."""
        key = self._first
        assert key is not None
        link = self.unlink(key)
        assert link is not None
        return key, link

    def relink(self, key: int, link: list[Any]) -> None:
        """Put back ``key`` as :meth:`unlink` returned it, between its old neighbours."""
        self._links[key] = link
        previous, following, _ = link
        if previous is None:
            self._first = key
        else:
            self._links[previous][1] = key
        if following is None:
            self._last = key
        else:
            self._links[following][0] = key

    def clear(self) -> None:
        """Remove every entry."""
        self._links.clear()
        self._first = self._last = None
