"""The search core: the exact sequence of sizes tried on fake cards."""

from __future__ import annotations

import pytest

from lightning_memguard.core.reading import MemoryReading
from lightning_memguard.core.search import (
    PREDICTED,
    AccumulationSearch,
    Forecast,
    SizeSearch,
    TrialResult,
    accumulation_candidates,
    power_ladder,
    trial_outcome,
)
from lightning_memguard.core.spill import Evidence

GB = 10**9


def classify_trial(peak, capacity, headroom, rate, best_rate, collapse):
    """What the spill rule says of one trial's reading and throughput."""
    return trial_outcome(Evidence(MemoryReading(peak, 0, capacity), capacity, headroom, best_rate, [rate], collapse))


def run(search: SizeSearch, card) -> list[int]:
    """Drive a search against a fake card: card(size) -> (samples/s, peak bytes, outcome)."""
    while (size := search.propose()) is not None:
        rate, peak, outcome = card(size)
        search.observe(TrialResult(size, size / rate * 1e3 if rate else None, peak, rate, outcome))
    return [r.size for r in search.results]


def h200(size):  # measured shape: throughput still creeping up at 2048
    rates = {32: 1030, 64: 2475, 128: 4304, 256: 4712, 512: 4900, 1024: 5047, 2048: 5076}
    return rates[size], size * 46 * 10**6, "ok"


def rtx4080(size):  # throughput peaks at 64 and drifts down
    rates = {32: 1050, 64: 1221, 128: 1143, 256: 1094, 512: 900}
    return rates[size], size * 43 * 10**6, "ok"


def spilling_16gb(size):  # 16 GB card with fallback: over the capacity from 384 on
    peak = int(size * 46.5 * 10**6)
    rate = {32: 900, 64: 2400, 128: 3772, 256: 4524, 384: 1930, 512: 880}[size]
    return rate, peak, classify_trial(peak, 16 * GB, 0.05, rate, None, 2.5)


def test_ladder():
    assert power_ladder(32, 2048) == [32, 64, 128, 256, 512, 1024, 2048]
    assert power_ladder(8, 8) == [8]
    with pytest.raises(ValueError, match="need 1 <= start <= stop"):
        power_ladder(64, 32)


def test_clean_card_climbs_until_the_gain_is_small():
    search = SizeSearch(power_ladder(32, 2048), min_gain=0.05)
    assert run(search, h200) == [32, 64, 128, 256, 512]  # 256 -> 512 gained 4 %
    assert search.result.size == 512


def test_card_whose_throughput_peaks_in_the_middle():
    search = SizeSearch(power_ladder(32, 512))
    assert run(search, rtx4080) == [32, 64, 128]
    assert search.result.size == 64


def test_spilling_card_stops_at_the_cliff_and_refines_below_it():
    search = SizeSearch(power_ladder(32, 512))
    assert run(search, spilling_16gb) == [32, 64, 128, 256, 512, 384]
    assert search.result.size == 256
    assert [r.outcome for r in search.results][-2:] == ["spill", "spill"]


def test_max_fit_takes_the_largest_that_fits():
    search = SizeSearch(power_ladder(32, 512), mode="max_fit")
    assert run(search, spilling_16gb) == [32, 64, 128, 256, 512, 384]
    assert search.result.size == 256

    def oom_above_300(size):
        return (1000.0, size, "ok") if size <= 300 else (None, None, "oom")

    search = SizeSearch(power_ladder(64, 1024), mode="max_fit")
    assert run(search, oom_above_300) == [64, 128, 256, 512, 384]
    assert search.result.size == 256


def test_tolerance_prefers_the_smaller_size():
    def flat(size):
        return {32: 1000, 64: 1990, 128: 2100}[size], size, "ok"

    search = SizeSearch([32, 64, 128], min_gain=0.0, tolerance=0.06)
    run(search, flat)
    assert search.result.size == 64  # 1990 is within 6 % of 2100 and uses less memory


def test_nothing_fits_gives_no_result_and_never_an_untried_size():
    search = SizeSearch([32, 64])
    run(search, lambda size: (None, None, "oom"))
    assert search.result is None
    assert [r.size for r in search.results] == [32]


def test_observe_must_match_the_proposal():
    search = SizeSearch([32, 64])
    search.propose()
    with pytest.raises(ValueError, match="observed size 64, but the search proposed 32"):
        search.observe(TrialResult(64, 1.0, 1, 10.0, "ok"))


def test_bad_arguments():
    with pytest.raises(ValueError, match="`mode` must be one of"):
        SizeSearch([32], mode="fast")
    with pytest.raises(ValueError, match="`candidates` must be positive integers, got \\[0\\]"):
        SizeSearch([0])


def test_accumulation_candidates():
    assert accumulation_candidates(256, 32) == [(32, 8), (64, 4), (128, 2), (256, 1)]
    assert accumulation_candidates(24, 8) == [(12, 2), (24, 1)]
    assert accumulation_candidates(7) == [(7, 1)]
    with pytest.raises(ValueError, match="per-device batch must be >= 1"):
        accumulation_candidates(0)


def test_classify_trial():
    assert classify_trial(17 * GB, 16 * GB, 0.05, 100.0, None, 2.5) == "spill"
    assert classify_trial(int(15.6 * GB), 16 * GB, 0.05, 100.0, None, 2.5) == "over_headroom"
    assert classify_trial(10 * GB, 16 * GB, 0.05, 30.0, 100.0, 2.5) == "ok"  # slow far from the capacity: just slow
    assert classify_trial(int(15.6 * GB), 16 * GB, 0.05, 30.0, 100.0, 2.5) == "spill"  # collapsed at the capacity
    assert classify_trial(10 * GB, 16 * GB, 0.05, 90.0, 100.0, 2.5) == "ok"


# ---------------------------------------------------------------- predicting before probing


def affine_card(base: int, per_sample: int, capacity: int = 16 * GB, ran: list[int] | None = None):
    """A card whose peak is ``base + per_sample * size`` and whose throughput rises with the size; above the
    capacity it spills (and the size is recorded in ``ran``, as every size run)."""

    def card(size):
        if ran is not None:
            ran.append(size)
        peak = base + per_sample * size
        if peak > capacity:
            return 50.0, peak, "spill"
        return 1000.0 * size / (size + 320), peak, "ok" if peak <= capacity * 0.95 else "over_headroom"

    return card


def test_a_size_the_measured_line_puts_clearly_above_the_capacity_is_not_run_and_the_largest_fit_is():
    """1 GB resting + 50 MB a sample on a 16 GB card: 512 would need 26.6 GB. It is not run; 280, the largest
    multiple of 8 predicted to leave the 5 % headroom (15.2 GB), is run instead, fits, and is the choice."""
    ran: list[int] = []
    search = SizeSearch([64, 128, 256, 512, 1024], forecast=Forecast(16 * GB, 0.05), min_gain=0.0)
    run(search, affine_card(GB, 50 * 10**6, ran=ran))
    assert ran == [64, 128, 256, 280]
    rows = [(r.size, r.outcome, r.peak_bytes) for r in search.results]
    assert rows[3] == (512, PREDICTED, 1 * GB + 512 * 50 * 10**6)  # the figure it was judged by
    assert search.result.size == 280
    # the same card measured size by size (no forecast) spills at 512 and ends on the same choice, or a smaller one
    blind = SizeSearch([64, 128, 256, 512, 1024], min_gain=0.0)
    run(blind, affine_card(GB, 50 * 10**6))
    assert ("spill" in [r.outcome for r in blind.results]) and blind.result.size <= 280


def test_a_size_near_the_capacity_is_still_measured():
    """Within the margin the line is not trusted: 300 is predicted at 16.0 GB on a 16 GB card, and is run."""
    ran: list[int] = []
    search = SizeSearch([75, 150, 300], forecast=Forecast(16 * GB, 0.05), min_gain=0.0)
    run(search, affine_card(GB, 50 * 10**6, ran=ran))
    assert ran[:3] == [75, 150, 300]  # (then the refinement between 150 and 300, as without a forecast)
    assert PREDICTED not in [r.outcome for r in search.results]


def test_one_measured_size_predicts_nothing():
    forecast = Forecast(16 * GB, 0.05)
    one = [TrialResult(64, 1.0, 4 * GB, 100.0, "ok")]
    assert forecast.peak(one, 4096) is None and not forecast.clearly_over(one, 4096)
    flat = [*one, TrialResult(128, 1.0, 4 * GB, 100.0, "ok")]  # no rise: no line
    assert forecast.largest_fit(flat) is None and not forecast.clearly_over(flat, 10**6)


def test_the_accumulation_search_does_not_run_a_micro_batch_predicted_to_spill():
    ran: list[int] = []
    search = AccumulationSearch([32, 64, 128, 256, 512], forecast=Forecast(16 * GB, 0.05))
    card = affine_card(GB, 50 * 10**6, ran=ran)
    while (size := search.propose()) is not None:
        rate, peak, outcome = card(size)
        search.observe(TrialResult(size, 1.0, peak, rate, outcome))
    assert ran == [32, 64, 128, 256]
    assert [(r.size, r.outcome) for r in search.results][-1] == (512, PREDICTED)
    assert search.result.size == 256
