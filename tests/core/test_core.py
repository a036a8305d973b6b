"""The pure core: exact numbers in, exact decisions out."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lightning_memguard.core import (
    EpochRecord,
    Evidence,
    MemoryReading,
    SpillDetector,
    Verdict,
    fallback_possible,
    format_epoch_table,
    format_spill_message,
    judge,
    parse_bytes,
    summarize_steps,
)

GB = 10**9


def read(used: int) -> MemoryReading:
    """A reading of ``used`` bytes on a 16 GB card, no other process."""
    return MemoryReading(used, 0, 16 * GB)


def detect_spill(used, capacity, headroom, reference, rates, collapse, patience, healthy=None):
    """The spill rule on plain numbers: (verdict, reason)."""
    evidence = Evidence(read(used), capacity, headroom, reference, rates, collapse, patience, healthy)
    judgement = judge(evidence)
    return judgement.verdict, judgement.reason


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("16GB", 16 * 10**9),
        ("16GiB", 16 * 2**30),
        ("16gib", 16 * 2**30),
        ("512MB", 512 * 10**6),
        ("1.5 GB", 1_500_000_000),
        ("2048", 2048),
        (17179869184, 17179869184),
        (1.5e9, 1_500_000_000),
    ],
)
def test_parse_bytes_reads_units(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["16XB", "GB", "", "-1GB", "16 G B", "0", "nan"])
def test_parse_bytes_rejects_and_quotes_input(bad):
    with pytest.raises(ValueError, match=f"`capacity`.*{bad!r}".replace("(", r"\(").replace(")", r"\)")):
        parse_bytes(bad)


@pytest.mark.parametrize("bad", [None, True, [16], {"gb": 16}])
def test_parse_bytes_rejects_types(bad):
    with pytest.raises(TypeError, match="`capacity` must be a number of bytes"):
        parse_bytes(bad)


def test_parse_bytes_rejects_zero_and_negative_numbers():
    with pytest.raises(ValueError, match="positive size, got 0"):
        parse_bytes(0)
    with pytest.raises(ValueError, match="positive size, got -5"):
        parse_bytes(-5)


def test_summarize_steps_median_and_rate():
    stats = summarize_steps([0.2, 0.1, 0.3, 5.0], [10, 10, 10, 10])
    assert stats is not None
    assert stats.step_ms == pytest.approx(250.0)  # median of 100, 200, 300, 5000
    assert stats.samples_per_sec == pytest.approx(40 / 5.6)
    assert summarize_steps([], []) is None
    with pytest.raises(ValueError, match="2 durations but 1 sample"):
        summarize_steps([0.1, 0.2], [3])


def test_epoch_table_has_a_row_per_epoch():
    table = format_epoch_table(
        [EpochRecord(0, 10.0, 1.0, 1.5, 16.0, 100.0), EpochRecord(1, 12.5, 2.0, 2.5, 16.0, 80.0)]
    )
    lines = table.splitlines()
    assert len(lines) == 3
    assert "1.00 / 16.00" in lines[1] and "12.5" in lines[2] and "80.0" in lines[2]


def test_epoch_record_loads_older_and_newer_checkpoints_and_merges_each_figure_as_declared():
    """A logged figure is one line of ``EpochRecord`` (its merge and unit): a checkpoint written before it existed
    still loads, with the figure unknown (NaN), and one written by a newer version drops what it does not know."""
    import math

    from lightning_memguard.core.epoch_record import merge_epoch_records

    old = {"epoch": 1, "step_ms": 10.0, "peak_allocated_gb": 1.0, "peak_reserved_gb": 1.5, "capacity_gb": 16.0}
    record = EpochRecord.from_dict({**old, "a_later_figure": 3.0})
    assert record.step_ms == 10.0 and math.isnan(record.samples_per_sec)
    again = EpochRecord.from_dict(record.to_dict())
    assert again.figures() | {"samples_per_sec": 0} == record.figures() | {"samples_per_sec": 0}
    assert list(record.figures()) == list(EpochRecord.figure_names())
    ranks = [EpochRecord(2, 50.0, 2.0, 2.5, 16.0, 80.0), EpochRecord(2, 60.0, 3.0, 3.5, 15.0, 40.0)]
    assert merge_epoch_records(ranks) == EpochRecord(2, 60.0, 3.0, 3.5, 15.0, 120.0)  # max, max, max, min, sum


def test_detect_spill_signals():
    cap = 16 * GB
    assert detect_spill(cap + 1, cap, 0.05, None, [], 2.5, 2)[0] is Verdict.SPILL
    assert detect_spill(cap - 1, cap, 0.05, None, [], 2.5, 2)[0] is Verdict.SUSPECT  # near, no reference yet
    assert detect_spill(10 * GB, cap, 0.05, 100.0, [99.0, 98.0], 2.5, 2)[0] is Verdict.OK
    # memory at capacity and two collapsed steps: spill; one collapsed step: only suspect
    assert detect_spill(int(15.5 * GB), cap, 0.05, 100.0, [39.0, 39.0], 2.5, 2, 12 * GB)[0] is Verdict.SPILL
    assert detect_spill(int(15.5 * GB), cap, 0.05, 100.0, [100.0, 39.0], 2.5, 2, 12 * GB)[0] is Verdict.SUSPECT
    # no fast reading to compare with, or no growth since: a busy host, not a spill
    assert detect_spill(int(15.5 * GB), cap, 0.05, 100.0, [39.0, 39.0], 2.5, 2)[0] is Verdict.SUSPECT
    assert detect_spill(int(15.5 * GB), cap, 0.05, 100.0, [39.0, 39.0], 2.5, 2, int(15.5 * GB))[0] is Verdict.SUSPECT
    # collapsed throughput far from the capacity is a stall, not a spill
    assert detect_spill(4 * GB, cap, 0.05, 100.0, [10.0, 10.0], 2.5, 2)[0] is Verdict.SUSPECT
    # headroom 0: only strictly-at-capacity counts as near
    assert detect_spill(int(15.5 * GB), cap, 0.0, 100.0, [10.0, 10.0], 2.5, 2)[0] is Verdict.SUSPECT


def test_detector_reads_every_step_until_reference_then_only_slow_steps():
    det = SpillDetector(16 * GB, warmup_steps=2, reference_steps=3, collapse=2.5, patience=2)
    wants = [det.observe_step(0.1, 10) for _ in range(7)]  # 2 warm-up + 3 reference + 2 patience
    assert wants == [True] * 7
    assert det.reference_rate == pytest.approx(100.0)
    assert [det.observe_step(0.1, 10) for _ in range(3)] == [False, False, False]
    assert det.observe_step(0.5, 10) is True  # slow: read memory now


def test_detector_reference_ignores_warmup_and_one_outlier():
    det = SpillDetector(16 * GB, warmup_steps=2, reference_steps=5)
    for seconds in [3.0, 1.0, 0.1, 0.1, 2.0, 0.1, 0.1]:
        det.observe_step(seconds, 10)
    assert det.reference_rate == pytest.approx(100.0)


def test_detector_spills_on_third_collapsed_step_near_capacity():
    det = SpillDetector(16 * GB, warmup_steps=0, reference_steps=2)
    det.observe_step(0.1, 10)
    det.observe_step(0.1, 10)
    assert det.observe_memory(read(int(15.3 * GB))).verdict is Verdict.SUSPECT  # near the capacity while fast
    for _ in range(2):
        det.observe_step(1.0, 10)
        assert det.observe_memory(read(int(15.9 * GB))).verdict is Verdict.SUSPECT
    det.observe_step(1.0, 10)
    report = det.observe_memory(read(int(15.9 * GB)))
    assert report.verdict is Verdict.SPILL
    assert report.slowdown == pytest.approx(10.0)
    assert report.step == 5


def test_a_busy_host_is_no_spill_when_memory_has_not_grown():
    """Memory at the capacity ran fast before; the same memory with slow steps is the host, not a spill."""
    det = SpillDetector(16 * GB, warmup_steps=0, reference_steps=2)
    det.observe_step(0.1, 10)
    det.observe_step(0.1, 10)
    det.observe_memory(read(int(15.9 * GB)))
    for _ in range(6):
        det.observe_step(2.0, 10)
        report = det.observe_memory(read(int(15.9 * GB)))
        assert report.verdict is Verdict.SUSPECT
    assert report.reason == "slow steps, memory no higher than when the run was fast"
    assert det.observe_memory(read(int(15.99 * GB))).verdict is Verdict.SPILL  # grew by 0.09 GB > 0.5 % of 16 GB
    assert SpillDetector(GB).state_dict().keys() == {"reference_rate", "healthy_used_bytes"}


def test_detector_state_round_trip():
    det = SpillDetector(GB, warmup_steps=0, reference_steps=1)
    det.observe_step(0.5, 100)
    fresh = SpillDetector(GB)
    fresh.load_state_dict(det.state_dict())
    assert fresh.reference_rate == 200.0
    fresh.load_state_dict({})
    assert fresh.reference_rate == 200.0


def test_spill_message_names_numbers_and_fixes():
    det = SpillDetector(16 * GB, warmup_steps=0, reference_steps=1)
    det.observe_step(0.2, 256)
    det.observe_step(2.0, 256)
    det.observe_step(2.0, 256)
    message = format_spill_message(det.observe_memory(read(17 * GB)), 256, "/tmp/x.ckpt")
    assert "batch size 256" in message
    assert "peak 17.00 GB against 16.00 GB" in message
    assert "128.0 samples/s against 1280.0" in message and "10.0x slower" in message
    assert "Prefer No Sysmem Fallback" in message and "AccumulationTuner" in message
    assert "/tmp/x.ckpt" in message


def test_fallback_possible_by_platform():
    assert fallback_possible("Windows", "11", "WDDM")
    assert fallback_possible("Windows", "11", None)
    assert not fallback_possible("Windows", "11", "TCC")
    assert fallback_possible("Linux", "5.15.153.1-microsoft-standard-WSL2", None)
    assert not fallback_possible("Linux", "6.8.0-45-generic", None)
    assert not fallback_possible("Darwin", "23.0", None)


def test_core_does_not_import_lightning():
    code = (
        "import sys, lightning_memguard.core\n"
        "print(any(m.split('.')[0] in ('lightning', 'pytorch_lightning') for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_detector_ignores_host_side_jitter_of_an_asynchronous_gpu():
    det = SpillDetector(16 * GB, warmup_steps=2, reference_steps=4, patience=3)
    for _ in range(9):
        det.observe_step(0.1, 10)
    # the host runs ahead, then waits: single intervals swing 5x around the same mean
    wants = [det.observe_step(seconds, 10) for seconds in [0.02, 0.25, 0.03, 0.02, 0.25, 0.03] * 5]
    assert not any(wants)


def test_detector_reads_on_a_slowdown_then_rests_unless_memory_is_at_capacity():
    det = SpillDetector(16 * GB, warmup_steps=0, reference_steps=2, patience=3, read_window=3)
    for _ in range(5):
        det.observe_step(0.1, 10)
    assert det.observe_memory(read(GB)).verdict is Verdict.OK  # a fast reading: 1 GB is what the run needs when fast
    assert [det.observe_step(0.1, 10) for _ in range(2)] == [False, False]
    assert det.observe_step(0.4, 10) is True  # the window of three runs at 30 / 0.6 s = 50/s, under 100 / 1.5
    assert det.observe_memory(read(GB)).verdict is Verdict.SUSPECT  # slow, far below the capacity: a stall
    # it rests: four steps, not two, as memory has not grown since the last reading
    assert [det.observe_step(0.4, 10) for _ in range(5)] == [False] * 4 + [True]
    assert det.observe_memory(read(int(15.9 * GB))).verdict is Verdict.SPILL  # at the capacity and collapsed


def test_detector_reference_settles_on_the_steady_state():
    det = SpillDetector(16 * GB, warmup_steps=1, reference_steps=3, patience=3, refresh_every=10)
    for _ in range(4):
        det.observe_step(0.01, 10)  # the host queues work ahead: the first steps look 10x too fast
    assert det.reference_rate == pytest.approx(1000.0)
    wants = [det.observe_step(0.1, 10) for _ in range(30)]  # the real pace
    assert det.reference_rate == pytest.approx(100.0)
    assert not any(wants[-10:])  # once settled, no more reads on every slow-looking window


def test_memory_is_read_rarely_on_a_healthy_jittery_run():
    """A GPU run seen from the host: the first steps look fast while the queue fills, then intervals swing 10x."""
    import random

    rng = random.Random(0)
    det = SpillDetector(16 * GB)
    reads = 0
    host = [0.005] * 6 + [rng.choice([0.01, 0.02, 0.1, 0.11]) for _ in range(994)]
    for seconds in host:
        if det.observe_step(seconds, 32):
            reads += 1
            assert det.observe_memory(read(4 * GB)).verdict is not Verdict.SPILL
    assert reads < 100  # far fewer than one read per step, no spill called


def test_memory_near_capacity_is_watched_every_step():
    det = SpillDetector(16 * GB, warmup_steps=0, reference_steps=2, patience=3)
    for _ in range(5):
        det.observe_step(0.1, 10)
    det.observe_memory(read(int(15.3 * GB)))  # fast, already near the capacity
    verdicts = []
    for _ in range(4):
        if det.observe_step(1.0, 10):
            verdicts.append(det.observe_memory(read(int(15.9 * GB))).verdict)
    assert verdicts[-1] is Verdict.SPILL and len(verdicts) >= 3


def test_detector_rests_longer_while_slow_windows_show_no_memory_growth():
    det = SpillDetector(
        16 * GB, warmup_steps=0, reference_steps=2, patience=3, read_window=1, max_rest=8, refresh_every=1000
    )
    for _ in range(5):
        det.observe_step(0.1, 10)
    read_at = []
    for step in range(60):  # every step looks slow, memory stays at 4 GB: a stalling host, not a spill
        if det.observe_step(0.2, 10):
            read_at.append(step)
            assert det.observe_memory(read(4 * GB)).verdict is not Verdict.SPILL
    gaps = [b - a for a, b in zip(read_at, read_at[1:], strict=False)]
    assert gaps[:4] == [3, 5, 9, 9]  # rests of 2, 4, 8 steps, then no longer than max_rest
    assert len(read_at) <= 9
    # memory then climbs to the capacity: seen at the next reading, after which every step is watched
    verdicts = []
    for _ in range(8 + 3):
        if det.observe_step(1.0, 10):
            verdicts.append(det.observe_memory(read(int(15.9 * GB))).verdict)
    assert verdicts[-1] is Verdict.SPILL


def test_detector_with_patience_longer_than_its_read_window():
    det = SpillDetector(16 * GB, warmup_steps=0, reference_steps=2, patience=5, read_window=2)
    for _ in range(8):
        det.observe_step(0.1, 10)
    det.observe_memory(read(4 * GB))  # fast and far below the capacity: what a healthy step needs
    verdicts = [det.observe_memory(read(int(15.9 * GB))).verdict for _ in range(5) if det.observe_step(1.0, 10)]
    assert verdicts[-1] is Verdict.SPILL  # five collapsed steps at the capacity
    assert verdicts[:-1] == [Verdict.SUSPECT] * (len(verdicts) - 1)


def test_detector_fed_a_window_at_a_time_decides_like_step_by_step():
    """MemGuard feeds the detector five steps at a time once it has its reference (cheaper per step)."""
    host = [0.1] * 40 + [0.1, 0.3] * 20 + [1.0] * 20  # healthy, then jittery, then collapsed
    memory = [4 * GB] * 80 + [int(15.9 * GB)] * 20  # the collapse comes with memory at the capacity

    def run(batched: bool) -> tuple[int, int | None]:
        det = SpillDetector(16 * GB)
        reads, spill_at, i = 0, None, 0
        while i < len(host) and spill_at is None:
            n = 5 if batched and not det.watching else 1
            if det.observe_steps(host[i : i + n], [32] * len(host[i : i + n])):
                reads += 1
                if det.observe_memory(read(memory[min(i + n, len(host)) - 1])).verdict is Verdict.SPILL:
                    spill_at = det.steps
            i += n
        return reads, spill_at

    step_reads, step_spill = run(batched=False)
    batch_reads, batch_spill = run(batched=True)
    assert step_spill is not None and batch_spill is not None
    assert 80 < step_spill <= batch_spill <= step_spill + 4  # a window later at most
    assert batch_reads <= step_reads


def test_detector_refuses_step_times_and_sample_counts_of_different_lengths():
    det = SpillDetector(16 * GB, warmup_steps=0, reference_steps=1, patience=1)
    with pytest.raises(ValueError):  # while warming up
        det.observe_steps([0.1, 0.1], [32])
    while det.watching:
        det.observe_step(0.1, 32)
    with pytest.raises(ValueError, match="5 step times but 4 sample counts"):  # and in the steady phase
        det.observe_steps([0.1] * 5, [32] * 4)


def test_timeline_times_each_step_from_its_batch_start_to_the_next():
    from lightning_memguard.core.timeline import StepTimeline

    timeline = StepTimeline(detector=SpillDetector(16 * GB, warmup_steps=0, reference_steps=2), read_every=4)
    wants = [timeline.batch_start(0.1 * i, samples=8 if i % 2 else 2) for i in range(4)]
    assert wants == [False, True, True, True]  # no step before the first batch; then every step while watching
    assert timeline.durations == pytest.approx([0.1] * 3) and timeline.samples == [2, 8, 2]
    timeline.interrupt(0.5)  # validation: the open step (8 samples, 0.2 s) is kept aside ...
    timeline.batch_start(1.0, samples=8)  # ... and no interval spans the pause
    timeline.batch_start(1.1, samples=8)
    assert timeline.durations == pytest.approx([0.1] * 4) and timeline.open_steps == [(pytest.approx(0.2), 8)]
    stats = timeline.epoch_stats()
    assert stats is not None and stats.samples_per_sec == pytest.approx(20 / 0.4)
    timeline.start_epoch()
    assert timeline.epoch_stats() is None and not timeline.step_open
    timeline.batch_start(2.0, samples=8)
    timeline.interrupt(2.3)  # an epoch of one batch: timed by the batch itself
    assert timeline.epoch_stats().step_ms == pytest.approx(300.0)


def test_timeline_records_one_spill_per_fit_and_stops_feeding_the_detector():
    from lightning_memguard.core.timeline import StepTimeline

    detector = SpillDetector(16 * GB, warmup_steps=0, reference_steps=1)
    timeline = StepTimeline(detector=detector)
    timeline.batch_start(0.0, 8)
    timeline.batch_start(0.1, 8)
    assert timeline.judge(read(10 * GB), step=1) is None and timeline.spill is None
    report = timeline.judge(read(17 * GB), step=7)
    assert report is not None and report.step == 7 and timeline.spill is report
    assert timeline.judge(read(18 * GB), step=8) is None and timeline.spill is report  # the first one stands
    steps = detector.steps
    assert timeline.batch_start(0.2, 8) is False and detector.steps == steps  # nothing more to decide
    timeline.start_epoch()
    assert timeline.spill is report  # an epoch does not forget it; a new fit makes a new timeline
    with pytest.raises(ValueError, match="`read_every` must be >= 1, got 0"):
        StepTimeline(detector=detector, read_every=0)


def test_timeline_reads_memory_every_read_every_steps_once_steady():
    from lightning_memguard.core.timeline import StepTimeline

    detector = SpillDetector(16 * GB, warmup_steps=0, reference_steps=1, patience=1, read_window=5)
    timeline = StepTimeline(detector=detector, read_every=10)
    reads = [i for i in range(41) if timeline.batch_start(0.1 * i, 8) and timeline.judge(read(GB), step=i) is None]
    # watching for the first steps, then the detector takes 5 steps at a time (at steps 7, 12, 17, ...) and memory
    # is read at the first feed past each 10 steps
    assert reads == [1, 2, 12, 22, 32]


# ---------------------------------------------------------------- the budget search, as a step object
