"""The search core: the exact sequence of sizes tried on fake cards."""

from __future__ import annotations

import pytest

from lightning_memguard.core.search import (
    SizeSearch,
    TrialResult,
    accumulation_candidates,
    classify_trial,
    power_ladder,
)

GB = 10**9


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
