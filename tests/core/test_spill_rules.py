"""Each signal of the spill rule on its own (``core.spill.RULES``), then how ``judge`` weighs them.

Adding a signal is a field of ``MemoryReading``, a rule in ``core/spill.py`` listed in ``RULES``, and a test here.
"""

from __future__ import annotations

import pytest

from lightning_memguard.core.reading import MemoryReading
from lightning_memguard.core.spill import (
    RULES,
    Evidence,
    Verdict,
    above_capacity,
    at_capacity,
    collapsed_at_capacity,
    counted_in_system_ram,
    judge,
    slow_steps,
)

GB = 10**9
CARD = 16 * GB
AT_CAPACITY = int(15.5 * GB)  # within the 5 % headroom of a 16 GB card


def evidence(used: int, rates=(), shared=None, pinned=None, **known) -> Evidence:
    """A reading of ``used`` bytes on a 16 GB card; the run's reference is 100 samples/s, two steps of patience."""
    reading = MemoryReading(used, used, CARD, 0, shared=shared, pinned=pinned)
    return Evidence(reading, CARD, 0.05, 100.0 if rates else None, list(rates), 2.5, 2, **known)


def test_above_capacity_is_decisive_on_its_own():
    assert above_capacity(evidence(CARD + 1)).verdict is Verdict.SPILL
    assert above_capacity(evidence(CARD)) is None  # exactly full is possible without spilling


def test_counted_in_system_ram_above_its_threshold_less_what_is_pinned_there_before_or_offloaded():
    assert counted_in_system_ram(evidence(8 * GB, shared=None)) is None  # not counted here (every platform but Windows)
    finding = counted_in_system_ram(evidence(8 * GB, shared=2 * GB))
    assert finding.verdict is Verdict.SPILL and "2.00 GB" in finding.reason
    assert counted_in_system_ram(evidence(8 * GB, shared=200 * 2**20)) is None  # below 256 MiB: Windows' own moves
    assert counted_in_system_ram(evidence(8 * GB, shared=2 * GB, pinned=2 * GB)) is None  # pinned loaders' buffers
    assert counted_in_system_ram(evidence(8 * GB, shared=2 * GB, shared_baseline=2 * GB)) is None  # before the run
    assert counted_in_system_ram(evidence(8 * GB, shared=2 * GB, offload=2 * GB)) is None  # offloaded on purpose
    collapsed = counted_in_system_ram(evidence(8 * GB, rates=[30.0, 30.0], shared=2 * GB))
    assert collapsed.reason.endswith("and the steps slowed down")


def test_collapsed_at_capacity_needs_memory_grown_past_the_fast_runs():
    assert collapsed_at_capacity(evidence(AT_CAPACITY, [30.0, 30.0], healthy_used=12 * GB)).verdict is Verdict.SPILL
    # no fast reading to compare with, or memory no higher than when fast: a busy host, not a spill
    assert collapsed_at_capacity(evidence(AT_CAPACITY, [30.0, 30.0])).verdict is Verdict.SUSPECT
    assert collapsed_at_capacity(evidence(AT_CAPACITY, [30.0, 30.0], healthy_used=AT_CAPACITY)).verdict is (
        Verdict.SUSPECT
    )
    assert collapsed_at_capacity(evidence(AT_CAPACITY, [100.0, 30.0], healthy_used=12 * GB)) is None  # one step
    assert collapsed_at_capacity(evidence(8 * GB, [30.0, 30.0], healthy_used=4 * GB)) is None  # far from capacity


def test_at_capacity_alone_is_only_suspect():
    assert at_capacity(evidence(AT_CAPACITY)).verdict is Verdict.SUSPECT
    assert at_capacity(evidence(15 * GB)) is None


def test_slow_steps_far_from_capacity_are_only_suspect():
    assert slow_steps(evidence(4 * GB, [100.0, 30.0])).verdict is Verdict.SUSPECT
    assert slow_steps(evidence(4 * GB, [100.0, 90.0])) is None
    assert slow_steps(evidence(AT_CAPACITY, [30.0, 30.0])) is None  # at the capacity, the other rules speak
    assert slow_steps(evidence(4 * GB)) is None  # no reference yet: nothing is slow


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.__name__)
def test_every_rule_is_quiet_on_a_healthy_run(rule):
    assert rule(evidence(8 * GB, [99.0, 98.0], shared=0, pinned=0, healthy_used=8 * GB)) is None


def test_judge_takes_the_first_spill_over_any_suspicion_and_keeps_every_finding():
    e = evidence(AT_CAPACITY, [30.0, 30.0], shared=3 * GB, healthy_used=AT_CAPACITY)
    judgement = judge(e)
    assert judgement.verdict is Verdict.SPILL and judgement.reason.startswith("Windows counts 3.00 GB")
    assert [f.verdict for f in judgement.findings] == [Verdict.SPILL, Verdict.SUSPECT, Verdict.SUSPECT]
    assert judge(evidence(8 * GB, [99.0, 98.0])).verdict is Verdict.OK
    # a rule of one's own is one more function in the list
    assert judge(e, rules=[at_capacity]).reason == "memory at the capacity"
