"""Adapting a run in the middle of training: how many micro-batches each loaded batch is split into, when to try
fewer again, and the record of every change. Pure numbers, no Lightning.

A batch split into ``chunks`` micro-batches, each one's loss weighted by its share of what the loss averages over
(its samples, its labelled tokens; 1 for a sum: :data:`WEIGHTINGS`) and its gradients accumulated before the one
optimizer step, trains exactly as the whole batch does: same samples per optimizer step, same data order, same
optimizer and scheduler steps, same gradients. Only the peak memory falls, with the saved activations of one
micro-batch instead of the whole batch. A loss that couples the samples of a batch (an in-batch contrastive loss)
has no such weighting (:func:`judge_weighting` finds none) and is never split.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from lightning_memguard.core.advice import FitAdvice


@dataclass(frozen=True)
class Adaptation:
    """One change of the run's configuration, as it is said, logged and kept in checkpoints.

    Attributes:
        step: the optimizer step (``trainer.global_step``) at which the change took effect.
        batch: samples of the loaded batch (per device); ``before`` and ``after``: micro-batches it is split into.
        checkpointing: activation checkpointing turned on by this change.
        why: what made it (``"spill"``, ``"out of memory"``, ``"memory freed"``) with its figures.
        accumulate: Lightning's own accumulation (``accumulate_grad_batches``): loaded batches per optimizer step.
        validation: the change is to the validation batches (no backward: their outputs and logged figures are the
            same, only the peak falls).
        weighting: how each micro-batch's loss is weighted (a key of :data:`WEIGHTINGS`; "" before the first split).
        savers: the savers that keep the batch whole (the levers' plan: checkpointing, pointwise recomputation) taken
            or removed by this change, in words ("" where none were).
        savers_off: this change removed them (the memory freed: the step fits without them).
        switch_s: wall seconds the switch itself took (planning and applying the savers, or removing them); None
            where it was not timed (a split alone, a record from before it was kept).

    Example:
        >>> Adaptation(31, 256, 1, 2, False, "256 x 1 spilled (20.8 GB on a 16.0 GB card)").line()
        'step 31: 256 x 1 spilled (20.8 GB on a 16.0 GB card); now 128 x 2, the same 256 samples per optimizer step'
        >>> Adaptation(40, 64, 1, 2, False, "validation spilled (16.9 GB on a 16.0 GB card)", validation=True).line()
        'step 40: validation spilled (16.9 GB on a 16.0 GB card); validation batches now run as 32 x 2'
        >>> Adaptation(80, 128, 2, 1, False, "memory freed", accumulate=2).line()
        'step 80: memory freed; now 128 x 1 (x 2 batches accumulated), the same 256 samples per optimizer step'
        >>> Adaptation(12, 32, 1, 2, False, "out of memory", weighting="sum").line()
        "step 12: out of memory; now 16 x 2, the same 32 samples per optimizer step; each micro-batch's loss added ..."
        >>> Adaptation(5, 32, 1, 1, True, "out of memory", savers="levers: block recomputed", switch_s=0.25).line()
        'step 5: out of memory; the savers, in 0.25 s: levers: block recomputed; now 32 x 1, activation ...'
        >>> Adaptation(9, 32, 1, 1, False, "memory freed", savers="levers: ...", savers_off=True, switch_s=0.01).line()
        'step 9: memory freed; the savers removed, in 0.01 s (levers: ...); now 32 x 1, the same 32 samples per ...'
    """

    step: int
    batch: int
    before: int
    after: int
    checkpointing: bool
    why: str
    accumulate: int = 1
    validation: bool = False
    weighting: str = ""
    savers: str = ""
    savers_off: bool = False
    switch_s: float | None = None

    def line(self) -> str:
        shape = f"{micro_batch(self.batch, self.after)} x {self.after}"
        if self.validation:
            return f"step {self.step}: {self.why}; validation batches now run as {shape}"
        if self.accumulate > 1:
            shape += f" (x {self.accumulate} batches accumulated)"
        extra = ", activation checkpointing on" if self.checkpointing else ""
        samples = self.batch * self.accumulate
        took = f", in {self.switch_s:.2f} s" if self.switch_s is not None else ""
        why = self.why
        if self.savers and self.savers_off:
            why += f"; the savers removed{took} ({self.savers})"
        elif self.savers:
            why += f"; the savers{took}: {self.savers}"
        line = f"step {self.step}: {why}; now {shape}{extra}, the same {samples} samples per optimizer step"
        if self.after > 1 and self.weighting:
            line += f"; each micro-batch's loss {WEIGHTINGS[self.weighting]}"
        return line

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# How a micro-batch's loss is weighted so that the micro-batches' gradients add up to the whole batch's: by what its
# loss averages over, or (a sum) not at all. What the adaptation's line says of each.
WEIGHTINGS = {
    "samples": "weighted by its samples (a mean over samples)",
    "tokens": "weighted by its labelled tokens (a token mean, labels of -100 ignored)",
    "next_tokens": "weighted by its labelled tokens after each row's first (a causal LM's shifted token mean)",
    "sum": "added as it is (a sum over samples)",
    "declared": "weighted by the count declared (`adapt_loss`)",
}


def loss_coefficients(weighting: str, counts: Sequence[float]) -> list[float]:
    """What each micro-batch's loss is multiplied by so that their sum is the whole batch's loss: its share of what
    the loss averages over (``counts``: its samples, tokens, or a declared count), or 1 for a sum.

    Example:
        >>> loss_coefficients("samples", [16, 16]), loss_coefficients("tokens", [30, 10])
        ([0.5, 0.5], [0.75, 0.25])
        >>> loss_coefficients("sum", [2, 3])
        [1.0, 1.0]
    """
    if weighting == "sum":
        return [1.0] * len(counts)
    total = float(sum(counts))
    return [float(c) / total if total > 0 else 0.0 for c in counts]


def judge_weighting(
    whole: float, parts: Sequence[float], counts: Mapping[str, Sequence[float]], tolerance: float = 5e-3
) -> str | None:
    """Which weighting makes the losses of a sub-batch's parts (``parts``) add up to the loss of the sub-batch whole
    (``whole``): of those in ``counts`` (a weighting and each part's count under it), the one that comes closest, if
    it is within ``tolerance`` of the largest loss. None: none does, the loss couples the samples of a batch (an
    in-batch contrastive loss, a loss normalised by the batch), so no split keeps its gradients.

    Example:
        >>> counts = {"samples": [1, 3], "sum": [1, 3]}
        >>> judge_weighting(2.5, [1.0, 3.0], counts), judge_weighting(4.0, [1.0, 3.0], counts)
        ('samples', 'sum')
        >>> judge_weighting(0.9, [0.0, 1.1], counts) is None  # one sample alone has no negatives
        True
    """
    scale = max(abs(whole), *(abs(p) for p in parts), 1e-12)
    best, best_gap = None, math.inf
    for weighting, each in counts.items():
        joined = sum(c * p for c, p in zip(loss_coefficients(weighting, each), parts, strict=True))
        gap = abs(joined - whole)
        if gap < best_gap:
            best, best_gap = weighting, gap
    return best if best_gap <= tolerance * scale else None


def micro_batch(batch: int, chunks: int) -> int:
    """The largest micro-batch of ``batch`` samples split into ``chunks`` near-equal parts.

    Example:
        >>> micro_batch(256, 2), micro_batch(100, 3)
        (128, 34)
    """
    return math.ceil(batch / chunks)


def chunks_to_fit(batch: int, chunks: int, advice: FitAdvice | None) -> int:
    """How many micro-batches a batch that did not fit in ``chunks`` should be split into: enough that the largest
    fits where the run's own readings say (``advice``), and at least twice as many as now; never more than the
    batch's samples. Where the readings say not even one sample fits, ``chunks`` itself: no split can help.

    Example:
        >>> advice = FitAdvice.from_run(26_600_000_000, 1_000_000_000, 0, 16 * 10**9, 0.05, 512)  # 284 fits
        >>> chunks_to_fit(512, 1, advice), chunks_to_fit(512, 1, None), chunks_to_fit(3, 2, None)
        (2, 2, 3)
        >>> chunks_to_fit(512, 1, FitAdvice.from_run(26_600_000_000, 15_190_000_000, 0, 16 * 10**9, 0.05, 512))
        1
    """
    if advice is not None and advice.largest_batch < 1:
        return chunks
    wanted = chunks * 2
    if advice is not None:
        # advice.largest_batch is per loaded micro-batch of the spilling step: that step held batch / chunks samples
        wanted = max(wanted, math.ceil(batch / advice.largest_batch))
    return min(wanted, batch)


def chunks_with_savers(batch: int, chunks: int, floor: int, measured_on: int, room: int) -> int:
    """How many micro-batches a batch needs beside savers whose plan did not meet ``room`` (bytes for a step's
    activations): their measured floor (``floor`` bytes on ``measured_on`` samples) taken per sample, enough that the
    largest micro-batch fits ``room``, and at least twice as many as now; never more than the batch's samples. Where
    not even one sample fits, ``chunks`` itself: no split can help.

    Example:
        >>> chunks_with_savers(32, 1, floor=41_000, measured_on=32, room=27_000)  # 1.3 kB a sample: 21 fit
        2
        >>> chunks_with_savers(32, 1, 41_000, 32, 5_000), chunks_with_savers(32, 4, 41_000, 32, 27_000)
        (11, 8)
        >>> chunks_with_savers(32, 1, 41_000, 32, 1_000)
        1
    """
    per_sample = floor / max(measured_on, 1)
    fits = int(room // per_sample) if per_sample > 0 else batch
    if fits < 1:
        return chunks
    return min(max(chunks * 2, math.ceil(batch / fits)), batch)


def chunks_to_grow(batch: int, chunks: int, fits: Any) -> int | None:
    """Fewer micro-batches for a batch that runs in ``chunks``: the fewest whose largest micro-batch ``fits(size)``
    says fits, or None when none fewer does.

    Example:
        >>> chunks_to_grow(256, 4, lambda size: size <= 128), chunks_to_grow(256, 2, lambda size: size <= 128)
        (2, None)
        >>> chunks_to_grow(256, 4, lambda size: True)
        1
    """
    for fewer in range(1, chunks):
        if fits(micro_batch(batch, fewer)):
            return fewer
    return None


class GrowBack:
    """When a run that split its batches tries fewer micro-batches again: every ``every`` optimizer steps at first;
    after an attempt that had to be undone (it spilled again), twice as long, so a card that stays full costs a
    bounded number of attempts.

    Example:
        >>> grow = GrowBack(every=100)
        >>> grow.due(50), grow.due(100)
        (False, True)
        >>> grow.tried(100, undone=True)
        >>> grow.due(250), grow.due(300)
        (False, True)
        >>> grow.resumed(1000)
        >>> grow.due(1000), grow.due(1001), grow.interval
        (False, True, 200)
    """

    def __init__(self, every: int, start: int = 0) -> None:
        if every < 1:
            raise ValueError(f"`every` must be >= 1, got {every!r}")
        self.every = every
        self.interval = every
        self.last = start

    def restart(self, step: int) -> None:
        """A new split took effect at ``step``: the next attempt comes one interval later."""
        self.last = step

    def resumed(self, step: int) -> None:
        """A run resumed at ``step`` (a new process, perhaps on another card, or on this one freed): the next attempt
        comes after its first step, which gives the reading it is judged by; the interval stays as it was."""
        self.last = step + 1 - self.interval

    def due(self, step: int) -> bool:
        return step - self.last >= self.interval

    def tried(self, step: int, undone: bool) -> None:
        """An attempt at ``step``; ``undone``: it spilled again and was undone (the interval doubles)."""
        self.last = step
        self.interval = self.interval * 2 if undone else self.every
