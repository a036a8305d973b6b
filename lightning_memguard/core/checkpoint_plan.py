"""Which blocks to checkpoint for a memory budget: profiles in, a choice and its predicted peak out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class BlockProfile:
    """One block measured on a real batch.

    Attributes:
        name: the block's qualified name in the model.
        saved_bytes: activations it saves for backward (freed by checkpointing it).
        input_bytes: its inputs (still kept when it is checkpointed).
        forward_ms: its forward time (paid again in backward when it is checkpointed).
    """

    name: str
    saved_bytes: int
    input_bytes: int
    forward_ms: float

    @property
    def saving(self) -> int:
        return max(0, self.saved_bytes - self.input_bytes)


def predict_peak(baseline: int, chosen: Sequence[BlockProfile]) -> int:
    """Peak after checkpointing ``chosen``: their savings leave, the largest one comes back while it is recomputed.

    Example:
        >>> a, b = BlockProfile("a", 100, 10, 1.0), BlockProfile("b", 50, 10, 1.0)
        >>> predict_peak(1000, [a, b])
        970
    """
    if not chosen:
        return baseline
    return baseline - sum(p.saving for p in chosen) + max(p.saved_bytes for p in chosen)


def order_by_value(profiles: Sequence[BlockProfile]) -> list[BlockProfile]:
    """Most memory saved per millisecond of recomputation first (ties: larger saving first)."""
    return sorted(profiles, key=lambda p: (-p.saving / max(p.forward_ms, 1e-6), -p.saving, p.name))


def choose_blocks(profiles: Sequence[BlockProfile], baseline: int, budget: int) -> tuple[list[BlockProfile], int]:
    """The cheapest set of blocks, greedily by value, whose predicted peak fits ``budget``.

    Returns the chosen blocks (in value order) and the predicted peak. If no set fits, every block is chosen.

    Example:
        >>> cheap = BlockProfile("cheap", saved_bytes=400, input_bytes=100, forward_ms=1.0)
        >>> dear = BlockProfile("dear", saved_bytes=400, input_bytes=100, forward_ms=4.0)
        >>> small = BlockProfile("small", saved_bytes=60, input_bytes=50, forward_ms=1.0)
        >>> chosen, peak = choose_blocks([dear, small, cheap], baseline=1000, budget=800)
        >>> [p.name for p in chosen], peak
        (['cheap', 'dear'], 800)
    """
    chosen: list[BlockProfile] = []
    for profile in order_by_value(profiles):
        if predict_peak(baseline, chosen) <= budget:
            break
        chosen.append(profile)
    return chosen, predict_peak(baseline, chosen)
