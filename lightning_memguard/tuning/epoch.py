"""What one epoch of training really runs: the loader's length, the Trainer's batch limit and ``drop_last``.

The tuners choose a batch size (or a micro-batch and its accumulation) from this, the ladder stops where it says,
and the cache keys on it: one notion of "samples an epoch really runs", computed as Lightning computes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class EpochLength:
    """One epoch of the train loader on one rank, as the Trainer will run it, at any batch size.

    Attributes:
        samples: samples the loader's sampler (or dataset) holds per epoch on this rank; None: no length (an
            iterable dataset).
        limit: ``Trainer(limit_train_batches)`` (``overfit_batches`` where that is set): an int caps the batches
            of an epoch, a float keeps that fraction of them (rounded down, as Lightning does).
        drop_last: the loader drops a last batch smaller than the batch size.
        val_check: validation runs every this many batches of an epoch (an int ``Trainer(val_check_interval)``
            with ``check_val_every_n_epoch`` set): Lightning refuses to train when an epoch runs fewer batches, so
            no size may make it; None: no such rule (a fraction, a time, batches counted across epochs).

    Example:
        >>> epoch = EpochLength(100, limit=2)
        >>> epoch.batches(16), epoch.samples_at(16), epoch.samples_at(64)
        (2, 32, 100)
        >>> epoch.holds(4, accumulate=4), epoch.holds(8, accumulate=2)
        (False, True)
        >>> EpochLength(100, limit=0.25).largest_batch()  # at 34, 0.25 of its 3 batches is none
        33
        >>> EpochLength(64, val_check=3).largest_batch()  # at 32, two batches: validation every 3 never comes
        31
    """

    samples: int | None
    limit: int | float = 1.0
    drop_last: bool = False
    val_check: int | None = None

    def __post_init__(self) -> None:
        if self.samples is not None and self.samples < 0:
            raise ValueError(f"an epoch cannot hold {self.samples} samples")
        if isinstance(self.limit, bool) or self.limit < 0:
            raise ValueError(f"the batch limit must be an int or a float >= 0, got {self.limit!r}")
        if self.val_check is not None and self.val_check < 1:
            raise ValueError(f"validation must come every >= 1 batches, got {self.val_check!r}")

    @classmethod
    def of_loaders(
        cls, loaders: Sequence[tuple[int | None, bool]], limit: int | float = 1.0, val_check: int | None = None
    ) -> EpochLength:
        """One epoch of several loaders that make each batch together (a ``CombinedLoader``), all built with the
        same batch size: ``loaders`` holds each one's (samples, drop_last).

        Every loader must deliver whole batches, so the one with the fewest samples bounds the size, taken to drop
        its last batch if any loader does: this epoch never claims more than each loader runs. (Under
        ``max_size_cycle`` a longer loader runs more batches; a size is judged by the shortest all the same.)
        Loaders without length bound nothing.

        Example:
            >>> EpochLength.of_loaders([(64, False), (40, False)])
            EpochLength(samples=40, limit=1.0, drop_last=False, val_check=None)
            >>> EpochLength.of_loaders([(None, False), (40, True)], limit=2).largest_batch(accumulate=2)
            20
        """
        known = [samples for samples, _ in loaders if samples is not None]
        return cls(min(known) if known else None, limit, any(drop for _, drop in loaders), val_check)

    def batches(self, size: int) -> int | None:
        """Batches one epoch runs at batch size ``size``; None: unknown (no length, and no int limit)."""
        if size < 1:
            raise ValueError(f"a batch size must be >= 1, got {size}")
        if self.samples is None:
            return self.limit if isinstance(self.limit, int) else None
        full = self.samples // size if self.drop_last else -(-self.samples // size)
        if isinstance(self.limit, int):
            return min(full, self.limit)
        return int(full * self.limit)  # Lightning's `_parse_num_batches`, to the same rounding

    def samples_at(self, size: int) -> int | None:
        """Samples one epoch runs at batch size ``size`` (the last batch may hold fewer); None: unknown."""
        batches = self.batches(size)
        if batches is None or self.samples is None:
            return None
        return min(batches * size, self.samples)

    def holds(self, size: int, accumulate: int = 1) -> bool:
        """Whether one epoch runs at least one whole optimizer step: ``accumulate`` full batches of ``size``, and
        at least ``val_check`` batches.

        Lightning steps the optimizer at an epoch's end whatever the accumulation, so in an epoch shorter than
        that every optimizer step would hold fewer samples than ``size * accumulate``; and it refuses an epoch
        of fewer batches than an int ``val_check_interval``. Unknown counts as holding.
        """
        if accumulate < 1:
            raise ValueError(f"the accumulation must be >= 1, got {accumulate}")
        batches = self.batches(size)
        if batches is None:
            return True
        if batches < max(accumulate, self.val_check or 1):
            return False
        samples = self.samples_at(size)
        return samples is None or samples >= size * accumulate

    def last_batch(self, size: int) -> int | None:
        """Samples in the last batch one epoch runs at ``size`` (``size`` when every batch is full); None: unknown."""
        batches, samples = self.batches(size), self.samples_at(size)
        if batches is None or samples is None or batches == 0:
            return None
        return samples - (batches - 1) * size

    def stand_in(self, accumulate: int = 1) -> int | None:
        """The size that takes the place of sizes one epoch cannot run a whole optimizer step of: the largest that
        can, unless its epoch would end in a short batch; then the largest size down to half of it whose batches are
        all full, else the largest whose last batch holds at least half a batch (and two samples: a BatchNorm
        layer in training cannot take one). None: no bound known.

        Example:
            >>> EpochLength(64, val_check=4).largest_batch()  # 21 + 21 + 21 + 1
            21
            >>> EpochLength(64, val_check=4).stand_in()  # 4 full batches
            16
            >>> EpochLength(100, val_check=3).stand_in(), EpochLength(100, limit=2).stand_in(accumulate=2)
            (25, 50)
        """
        top = self.largest_batch(accumulate)
        if not top or self.last_batch(top) in (None, top):
            return top
        holding = [s for s in range(top, 0, -1) if self.holds(s, accumulate)]
        whole = [s for s in holding if 2 * s >= top and self.last_batch(s) == s]
        if whole:
            return whole[0]
        half_full = [s for s in holding if 2 * (self.last_batch(s) or 0) >= s and (self.last_batch(s) or 0) >= 2]
        return half_full[0] if half_full else top

    def largest_batch(self, accumulate: int = 1) -> int | None:
        """The largest batch size at which one epoch holds a whole optimizer step (0: none); None: no bound known.

        ``holds`` is monotone in the size (fewer and fewer batches, and a step of more and more samples), so this
        is a bisection.
        """
        if self.samples is None:
            return None if self.holds(1, accumulate) else 0
        if not self.holds(1, accumulate):
            return 0
        low, high = 1, max(self.samples, 1)  # holds(low); above `samples` no step is whole
        while low < high:
            mid = (low + high + 1) // 2
            if self.holds(mid, accumulate):
                low = mid
            else:
                high = mid - 1
        return low
