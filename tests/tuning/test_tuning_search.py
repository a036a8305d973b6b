"""The search core: the exact sequence of sizes tried on fake cards; the pure tuning modules load no Lightning."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
from conftest import FakeProbe, TinyModel, trainer_kwargs
from lightning.pytorch import Trainer
from lightning.pytorch.utilities.data import extract_batch_size
from tuner_helpers import BatchClock

from lightning_memguard import AccumulationTuner
from lightning_memguard.core.reading import MemoryReading
from lightning_memguard.core.spill import Evidence
from lightning_memguard.core.throughput import TrialTiming, group_steps, time_trial
from lightning_memguard.tuning.search import (
    PREDICTED,
    AccumulationSearch,
    Forecast,
    Margin,
    SizeSearch,
    TrialResult,
    accumulation_candidates,
    power_ladder,
    trial_outcome,
)

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


# ---------------------------------------------------------------- the noise, every micro-batch, a trial's row


def measured_twice(first, again=None, spread=0.08, peak_per_sample=10**6):
    """A card that gives each size's throughput ``first[size]`` with the trial's ``spread``, and on its second
    measurement ``again[size]`` (or ``first[size]``): card(size, nth) -> TrialResult."""

    def card(size, nth):
        rate = (again or first)[size] if nth > 1 else first[size]
        return TrialResult(size, size / rate * 1e3, size * peak_per_sample, rate, "ok", spread=spread)

    return card


def drive(search, card) -> list[int]:
    while (size := search.propose()) is not None:
        search.observe(card(size, 1 + [r.size for r in search.results].count(size)))
    return [r.size for r in search.results]


def test_a_pair_within_the_noise_is_measured_again_and_the_tie_rule_decides_if_it_still_is():
    """128 is 5 % faster than 64, each trial ±8 %: both are measured again, smaller first; still within the noise,
    the one with the smaller peak memory is taken, and the margin says so."""
    rates = {32: 1000.0, 64: 1900.0, 128: 2000.0}
    search = SizeSearch([32, 64, 128])
    assert drive(search, measured_twice(rates, {64: 1950.0, 128: 1960.0})) == [32, 64, 128, 64, 128]
    assert search.result.size == 64 and search.result.samples_per_sec == 1925.0  # the two measurements' mean
    assert search.margin == Margin(64, 1, 128, 1, gap=-0.0278, noise=0.08, remeasured=True)
    assert search.margin.within_noise and search.remeasured == [(64, 128)]


def test_a_pair_measured_again_that_stands_apart_is_decided_by_throughput():
    search = SizeSearch([32, 64, 128])
    assert drive(search, measured_twice({32: 1000.0, 64: 1900.0, 128: 2000.0}, {64: 1500.0, 128: 2100.0})) == [
        32, 64, 128, 64, 128
    ]  # fmt: skip
    assert search.result.size == 128 and not search.margin.within_noise and search.margin.remeasured
    # 64's two measurements disagree: its noise is half their gap, 11.8 %, and 128 stands 17 % above it
    assert (search.margin.gap, search.margin.noise) == (0.1707, 0.1176)


def test_without_a_spread_nothing_is_measured_again():
    """One timed step a trial: no spread, the noise is not known; the climb and the choice are as they were."""
    search = SizeSearch([32, 64, 128])
    assert drive(search, measured_twice({32: 1000.0, 64: 1900.0, 128: 2000.0}, spread=None)) == [32, 64, 128]
    assert search.result.size == 128 and search.margin == Margin(128, 1, 64, 1, gap=0.05, noise=0.0)
    # no re-measure allowed: within the noise the tie rule decides at once
    search = SizeSearch([32, 64, 128], remeasures=0)
    assert drive(search, measured_twice({32: 1000.0, 64: 1900.0, 128: 2000.0})) == [32, 64, 128]
    assert search.result.size == 64 and search.margin.within_noise and not search.margin.remeasured


def test_max_fit_has_no_throughput_decision_to_measure_again():
    search = SizeSearch([32, 64, 128], mode="max_fit")
    assert drive(search, measured_twice({32: 1000.0, 64: 1900.0, 128: 2000.0})) == [32, 64, 128]
    assert search.result.size == 128 and search.margin is None


def test_the_accumulation_search_measures_every_micro_batch_up_to_the_direct_batch():
    """Throughput is not monotonic in the micro-batch: 8 x 2 slower than 4 x 4 does not end the search, and the
    direct batch, the fastest here, is measured and chosen. Only a micro-batch that does not fit ends it."""
    card = measured_twice({4: 1000.0, 8: 900.0, 16: 1200.0}, spread=None)
    search = AccumulationSearch([4, 8, 16])
    assert drive(search, card) == [4, 8, 16] and search.result.size == 16

    def oom_from_16(size, nth):
        return TrialResult(size, None, None, None, "oom") if size >= 16 else card(size, nth)

    search = AccumulationSearch([4, 8, 16, 32])
    assert drive(search, oom_from_16) == [4, 8, 16] and search.result.size == 4  # 32 needs more memory still


def test_the_accumulation_search_measures_a_close_pair_again_and_keeps_the_larger_micro_batch():
    """16 x 2 is 7.8 % faster than 32 x 1, beyond `min_gain`, but within the trials' ±10 %: both are measured again;
    still within it, the larger micro-batch, the nearer to the direct batch, is kept."""
    search = AccumulationSearch([8, 16, 32], min_gain=0.05)
    assert drive(search, measured_twice({8: 900.0, 16: 1100.0, 32: 1020.0}, spread=0.1)) == [8, 16, 32, 16, 32]
    assert search.result.size == 32
    assert search.margin == Margin(32, 1, 16, 1, gap=-0.0727, noise=0.1, remeasured=True)


def test_a_trial_row_times_whole_optimizer_steps():
    """step_ms is the median whole optimizer step, samples_per_sec that step's samples over it: the identity holds
    whatever the steps' spread or count; the short step at an epoch's end and the warmup are not timed."""
    steps = [(9.0, 64), (0.2, 64), (0.3, 64), (0.25, 64), (0.35, 64), (0.05, 16)]
    timing = time_trial(steps, per_step=64, warmup=1)
    assert timing == TrialTiming(step_ms=275.0, samples_per_sec=232.727, spread=0.2727, steps=4)
    assert timing.samples_per_sec * timing.step_ms / 1e3 == pytest.approx(64, rel=1e-5)
    # an epoch of 4 batches (the last short) at accumulation 2: Lightning steps at the epoch's end
    batches = [(0.1, 32, False), (0.1, 32, False), (0.1, 32, False), (0.03, 8, False)]
    assert group_steps([batches, batches], 2) == [(0.2, 64, False), (0.13, 40, False)] * 2


# ---------------------------------------------------------------- a trial's row from a real Trainer


class JitteryClock(BatchClock):
    """A batch of n samples takes 2 ms + 1 ms per sample, times 1.0, 1.15 and 0.85 in turn: each trial's steps
    spread by about ±15 %, whatever this machine's speed."""

    def __init__(self) -> None:
        super().__init__()
        self.batches = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.batches += 1
        self.now += (0.002 + 0.001 * extract_batch_size(batch)) * (1.0, 1.15, 0.85)[self.batches % 3]


def _accumulation_fit(tmp_path, n):
    clock = JitteryClock()
    tuner = AccumulationTuner(
        16, min_micro_batch=4, probe=FakeProbe(), clock=clock, cache=False, warmup_steps=1, timed_steps=3
    )
    Trainer(**trainer_kwargs(tmp_path, max_epochs=1, max_steps=1, callbacks=[clock, tuner])).fit(
        TinyModel(batch_size=4, n=n)
    )
    return tuner


def test_a_trial_row_from_a_trainer_holds_its_definitions(tmp_path):
    """40 samples: at 16 x 1 every epoch ends on a batch of 8, at 8 x 2 on a step of one batch (Lightning steps at
    an epoch's end). The rows time whole optimizer steps only, so samples_per_sec x step_ms is the samples of one;
    before, steps were cut every `accumulate` batches across epochs and a short step's rate went into the median."""
    tuner = _accumulation_fit(tmp_path, n=40)
    rows = [r for r in tuner.results if r.fits]
    assert [(r.size, r.accumulate) for r in rows][:3] == [(4, 4), (8, 2), (16, 1)]
    for r in rows:
        assert r.samples_per_sec * r.step_ms / 1e3 == pytest.approx(r.size * r.accumulate, rel=1e-5), r
        assert r.spread is not None, r  # several steps timed: their spread is known


def test_the_accumulation_tuner_measures_a_close_pair_again_and_says_so(tmp_path, caplog):
    """16 x 1 is 10 % faster than 8 x 2 with each trial's steps ±15 %: both are measured again, and the choice, by
    the tie rule, is said with the noise."""
    with caplog.at_level(logging.INFO):
        tuner = _accumulation_fit(tmp_path, n=64)
    assert [(r.size, r.accumulate) for r in tuner.results] == [(4, 4), (8, 2), (16, 1), (8, 2), (16, 1)]
    assert (tuner.batch_size, tuner.accumulate_grad_batches) == (16, 1)
    said = [r.getMessage() for r in caplog.records if "noise" in r.getMessage()]
    assert said == [
        "AccumulationTuner: 16 x 1 and 8 x 2 are within the measurement's noise (±15.0 %: 10.0 % apart); measuring"
        " both again",
        "AccumulationTuner: 16 x 1 and 8 x 2 are within the measurement's noise (±15.0 %: 10.0 % apart, each measured"
        " twice); chose 16 x 1 by the larger micro-batch (the nearer to the direct batch)",
    ]


def test_the_pure_tuning_modules_do_not_import_lightning():
    """The search, the epoch, the cache file and the settings are the tuners' pure core (the package's docstring
    lists them), as ``lightning_memguard.core`` is."""
    pure = ", ".join(f"lightning_memguard.tuning.{m}" for m in ("search", "epoch", "cache", "tuner_settings", "adapt"))
    code = (
        f"import sys, {pure}\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'lightning', 'pytorch_lightning'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_with_batchnorm_a_micro_batch_within_the_machines_noise_of_the_direct_batch_keeps_the_direct_batch():
    """A busy machine: 32 x 4 measured ±12 %, the others ±2 %. 64 x 2 is 10 % faster than 128 x 1, beyond those
    two's own spreads but within the machine's noise. Without BatchNorm, 64 x 2 is chosen (weighed against 32 x 4,
    the fastest other); with it, 64 x 2 and 128 are weighed against each other and the machine's ±12 %, measured again,
    and the direct batch is kept: the micro-batch would change BatchNorm's statistics for a gain within the noise."""
    first = {32: 1050.0, 64: 1100.0, 128: 1000.0}
    spreads = {32: 0.12, 64: 0.02, 128: 0.02}

    def card(size, nth):
        rate = first[size]
        return TrialResult(size, size / rate * 1e3, size * 10**6, rate, "ok", spread=spreads[size])

    search = AccumulationSearch([32, 64, 128], min_gain=0.05)
    assert drive(search, card) == [32, 64, 128, 32, 64] and search.result.size == 64
    search = AccumulationSearch([32, 64, 128], min_gain=0.05, batch_statistics=True)
    assert drive(search, card) == [32, 64, 128, 64, 128]
    assert search.result.size == 128
    assert search.margin == Margin(128, 1, 64, 1, gap=-0.0909, noise=0.12, remeasured=True)


def test_with_batchnorm_a_micro_batch_beyond_the_machines_noise_is_still_chosen():
    first = {32: 900.0, 64: 1300.0, 128: 1000.0}  # 64 x 2 is 23 % faster than 128 x 1, the noise ±8 %

    search = AccumulationSearch([32, 64, 128], min_gain=0.05, batch_statistics=True)
    assert drive(search, measured_twice(first)) == [32, 64, 128] and search.result.size == 64
    assert search.margin == Margin(64, 1, 128, 1, gap=0.2308, noise=0.08)
