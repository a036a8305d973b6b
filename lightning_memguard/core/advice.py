"""What would fit, from a spilling run's own readings: the numbers a spill message gives after the verdict."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_memguard.core.units import size_formatter


@dataclass(frozen=True)
class FitAdvice:
    """The largest batch that would leave ``headroom`` free, and the accumulation that keeps the effective batch.

    Peak memory is close to affine in the batch size: what a step starts from (``resting``: the weights, gradients
    and optimizer state) plus a part per sample. One spilling step at a known batch size fixes both.

    Attributes:
        per_sample: bytes one sample adds to the peak.
        largest_batch: the largest batch predicted to leave the headroom free (0: not even one sample).
        micro_batch, accumulate: a split of the run's effective batch (``batch x accumulate``) whose micro-batch is
            at most ``largest_batch``, accumulating as little as possible (None when none fits).
        others: bytes other processes hold on the card.
        capacity: the card's physical memory (None: not known).
        usable: what a run may use of it: the capacity less its headroom (None: not known).
    """

    resting: int
    per_sample: float
    largest_batch: int
    effective_batch: int
    micro_batch: int | None
    accumulate: int | None
    others: int = 0
    capacity: int | None = None
    usable: int | None = None

    @classmethod
    def from_run(
        cls, peak: int, resting: int, others: int, capacity: int, headroom: float, batch: int, accumulate: int = 1
    ) -> FitAdvice | None:
        """None where the readings cannot say (no batch, or a peak not above what the step started from).

        Example:
            >>> advice = FitAdvice.from_run(26_600_000_000, 1_000_000_000, 0, 16 * 10**9, 0.05, 512)
            >>> advice.largest_batch, advice.micro_batch, advice.accumulate
            (284, 256, 2)
        """
        own = peak - others
        if batch < 1 or own <= resting:
            return None
        per_sample = (own - resting) / batch
        room = capacity * (1 - headroom) - others - resting
        largest = max(0, int(room // per_sample))
        effective = batch * accumulate
        micro = max((m for m in range(1, min(largest, effective) + 1) if effective % m == 0), default=None)
        accumulate_fit = None if micro is None else effective // micro
        usable = int(capacity * (1 - headroom))
        return cls(resting, per_sample, largest, effective, micro, accumulate_fit, others, capacity, usable)

    @property
    def held_by(self) -> str | None:
        """What leaves no room on the card, whatever the batch, its split or its checkpointing: ``"step"`` (what a
        step starts from, the weights, gradients and optimizer state, alone above the card's physical memory),
        ``"others"`` (other processes' memory, with what a step starts from above it), or None (memory is left: a
        smaller micro-batch, or checkpointing, may fit).

        Example:
            >>> FitAdvice.from_run(2_300_000, 934_000, 1_300_000, 2 * 10**6, 0.05, 32).held_by
            'others'
            >>> FitAdvice.from_run(141_500_000, 134_200_000, 0, 10**8, 0.05, 16).held_by
            'step'
            >>> FitAdvice.from_run(26_600_000_000, 1_000_000_000, 0, 16 * 10**9, 0.05, 512).held_by is None
            True
        """
        if self.capacity is None:
            return None
        if self.resting > self.capacity:
            return "step"
        if self.others > 0 and self.resting + self.others > self.capacity:
            return "others"
        return None

    def holder(self) -> str | None:
        """Who holds the memory that leaves no room on the card (see :attr:`held_by`), in words with its figures;
        None where memory is left.

        Example:
            >>> words = FitAdvice.from_run(2_300_000, 934_000, 1_300_000, 2 * 10**6, 0.05, 32).holder()
            >>> words.startswith("other processes hold 1.3 MB of the card's 2.0 MB, and what a step starts from")
            True
            >>> "(the weights, gradients and optimizer state: 0.9 MB) does not fit beside them" in words
            True
        """
        held_by, capacity = self.held_by, self.capacity
        if held_by is None or capacity is None:
            return None
        size = size_formatter(capacity, 2)
        step = f"the weights, gradients and optimizer state: {size(self.resting)}"
        if held_by == "step":
            besides = f" (and other processes hold {size(self.others)})" if self.others > 0 else ""
            return f"what a step starts from ({step}) alone exceeds the card's {size(capacity)}{besides}"
        return (
            f"other processes hold {size(self.others)} of the card's {size(capacity)}, and what a step starts from"
            f" ({step}) does not fit beside them"
        )

    def sentence(self) -> str:
        """The advice in words, with its figures, each in the unit that fits it (GB, MB or kB).

        Example:
            >>> words = FitAdvice(10**9, 50 * 10**6, 284, 512, 256, 2).sentence()
            >>> "each sample adds 50.0 MB): a batch of at most 284 fits" in words
            True
            >>> "512 fits as 256 x accumulate_grad_batches=2" in words, "checkpointing is not needed" in words
            (True, True)
            >>> small_card = FitAdvice(134_400_000, 1_630_000, 4, 16, 4, 4).sentence()
            >>> "starts from 134.4 MB, and each sample adds 1.6 MB)" in small_card
            True
            >>> too_small = FitAdvice.from_run(141_500_000, 134_200_000, 0, 10**8, 0.05, 16).sentence()
            >>> "alone exceeds the card's 100.0 MB: no batch size" in too_small
            True
            >>> "a lighter optimizer state" in too_small, "ActivationCheckpointing" in too_small
            (True, False)
        """
        resting, per_sample = size_formatter(self.resting, 2), size_formatter(self.per_sample, 2)  # each in its unit
        start = (
            f"From this run's readings (a step starts from {resting(self.resting)}, and each sample adds"
            f" {per_sample(self.per_sample)}): "
        )
        holder = self.holder()
        if holder is not None:  # no batch, split or checkpointing fits: only holding less does
            free = (
                "close the other application or wait until it frees its memory (`nvidia-smi` lists it), or "
                if self.held_by == "others"
                else ""
            )
            return start + (
                f"{holder}: no batch size, accumulation or activation checkpointing can fit; {free}make what a step"
                " starts from smaller: a lighter optimizer state (SGD, or an 8-bit or factored optimizer, instead of"
                " Adam's two moments the size of the weights), a smaller model, or the weights, gradients and"
                " optimizer state sharded across devices (FSDP)."
            )
        if self.largest_batch < 1 or self.micro_batch is None:
            return start + (
                "not even a batch of one fits beside what a step starts from; activation checkpointing"
                " (ActivationCheckpointing), a smaller model or lower precision is needed."
            )
        return start + (
            f"a batch of at most {self.largest_batch} fits; the effective batch of {self.effective_batch} fits as"
            f" {self.micro_batch} x accumulate_grad_batches={self.accumulate}"
            f" (AccumulationTuner(effective_batch_size={self.effective_batch}) measures the fastest split);"
            " activation checkpointing is not needed."
        )
