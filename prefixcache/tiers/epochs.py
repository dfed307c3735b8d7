"""WeightEpochs: weight versions that retire cached blocks without draining requests.

An RL loop updates the model's weights every few minutes while generation
goes on. K/V computed under old weights must never serve a request admitted
under new ones, but the requests already running keep the blocks they hold
and finish. Each weight version is an *epoch*: a small int, with the caller's
tag. The epoch's key goes into the root of every hash chain a request admitted
in that epoch computes (:meth:`WeightEpochs.hash_keys`), so new requests can
never match an older epoch's blocks; the switch itself only bumps a counter
(O(1) whatever the cache holds). Blocks of retired epochs are reclaimed as
they are released, oldest first: the host tier drops them before any live
entry, and on the device they are never hit again, so a recency policy takes
them before any block used since the switch. See DESIGN.md, "Tiers".
"""

from __future__ import annotations

from prefixcache.engine.validation import is_int, require_int
from prefixcache.errors import InvalidArgumentError

_KEY_TAG = "prefixcache.weight_epoch"


class WeightEpochs:
    """The current weight epoch and the tags of every epoch so far.

    Epoch 0 exists from the start (tag ``initial_tag``). Not thread-safe.

    >>> epochs = WeightEpochs()
    >>> epochs.begin("step-100")
    1
    >>> epochs.current, epochs.tag_of(1), epochs.is_retired(0)
    (1, 'step-100', True)

    Args:
        initial_tag: the tag of epoch 0.
    """

    def __init__(self, initial_tag: str | int = 0) -> None:
        self._tags: list[str | int] = [_check_tag(initial_tag)]

    @property
    def current(self) -> int:
        """The epoch new requests are admitted in. Complexity: O(1)."""
        return len(self._tags) - 1

    def begin(self, tag: str | int) -> int:
        """Start a new epoch (new weights) tagged ``tag`` and return its number.

        Every earlier epoch is retired at once. Complexity: O(1).

        Raises:
            InvalidArgumentError: ``tag`` is not a non-empty str or an int.
        """
        self._tags.append(_check_tag(tag))
        return self.current

    def tag_of(self, epoch: int) -> str | int:
        """The tag ``epoch`` was begun with.

        Raises:
            InvalidArgumentError: no such epoch.
        """
        epoch = require_int(epoch, "epoch", minimum=0, maximum=self.current)
        return self._tags[epoch]

    def is_retired(self, epoch: int) -> bool:
        """Whether ``epoch`` is older than the current one. Complexity: O(1).

        Raises:
            InvalidArgumentError: ``epoch`` is not an int >= 0.
        """
        return require_int(epoch, "epoch", minimum=0) < self.current

    def hash_keys(self, epoch: int | None = None) -> tuple[object, ...]:
        """Extra hash keys of ``epoch`` (default: the current), for the chain's root.

        Epoch numbers, not tags, make the key: a tag used twice still starts
        a fresh chain. Complexity: O(1).
        """
        if epoch is None:
            epoch = self.current
        epoch = require_int(epoch, "epoch", minimum=0, maximum=self.current)
        return ((_KEY_TAG, epoch),)


def _check_tag(tag: object) -> str | int:
    if isinstance(tag, str) and tag:
        return tag
    if is_int(tag):
        return int(tag)
    raise InvalidArgumentError(f"an epoch tag is a non-empty str or an int, got {tag!r}")


__all__ = ["WeightEpochs"]
