"""The tuners' result cache: what is on disk after every read and write, whatever the file held,
however many processes wrote it at once, and a key that knows how much data an epoch holds."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import re
import time
import warnings

import pytest
from conftest import TinyModel, trainer_kwargs
from lightning.pytorch import Trainer
from tuner_helpers import BatchClock, PerSample

from lightning_memguard import AccumulationTuner, BatchSizeTuner
from lightning_memguard.tuning.cache import CACHE_FILE, FileLock, ResultCache, check_entry

QUICK = dict(warmup_steps=1, timed_steps=1)
ROW = {"size": 8, "step_ms": 5.0, "peak_bytes": 10, "samples_per_sec": 1600.0, "outcome": "ok"}
ENTRY = {"batch_size": 8, "accumulate_grad_batches": None, "results": [ROW]}


def _tuner(kind, model, cache_dir, clock, **kw):
    probe = PerSample(model, capacity=int(100e9))
    if kind == "batch":
        return BatchSizeTuner(init_size=4, max_size=16, probe=probe, clock=clock, cache_dir=cache_dir, **QUICK, **kw)
    return AccumulationTuner(16, min_micro_batch=4, probe=probe, clock=clock, cache_dir=cache_dir, **QUICK, **kw)


def _fit(kind, cache_dir, n=64):
    """One fit with a tuner whose cache lives in ``cache_dir``; the tuner, the model and the cache warnings."""
    clock, model = BatchClock(), TinyModel(batch_size=4, n=n)
    tuner = _tuner(kind, model, cache_dir, clock)
    root = os.path.join(os.path.dirname(cache_dir), "root")  # the Trainer's files apart from the cache's
    trainer = Trainer(**trainer_kwargs(root, max_epochs=1, max_steps=1, callbacks=[clock, tuner]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model)
    said = [str(w.message) for w in caught if "cache" in str(w.message) or "earlier choice" in str(w.message)]
    return tuner, model, said


def _read(folder):
    with open(os.path.join(folder, CACHE_FILE), encoding="utf-8") as f:
        return json.load(f)


def _files(folder):
    return sorted(os.listdir(folder))


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """For each tuner: the key and entry one fit stores (the real key of the fits below)."""
    found = {}
    for kind in ("batch", "accumulation"):
        folder = tmp_path_factory.mktemp(kind)
        tuner, _, said = _fit(kind, folder)
        assert not tuner.from_cache and not said
        ((key, entry),) = _read(folder).items()
        found[kind] = key, entry
    return found


def test_a_stored_choice_is_reused(tmp_path, stored):
    key, entry = stored["batch"]
    (tmp_path / CACHE_FILE).write_text(json.dumps({key: entry}), encoding="utf-8")
    tuner, model, said = _fit("batch", tmp_path)
    assert tuner.from_cache and said == [] and tuner.batch_size == model.batch_size == entry["batch_size"]
    assert _read(tmp_path) == {key: entry} and _files(tmp_path) == [CACHE_FILE]


# ---------------------------------------------------------------- every bad entry: a miss with one warning

_ACC = {"batch_size": 8, "accumulate_grad_batches": 2, "checkpointing": False}
_ACC_ROW = {**ROW, "accumulate": 2}
_MARGIN = {"size": 8, "accumulate": 1, "runner_up": 4, "runner_up_accumulate": 1, "gap": 0.1, "noise": 0.0,
           "remeasured": False}  # fmt: skip

BAD_ENTRIES = {
    "null": ("batch", None, "an entry must be an object, got None"),
    "a list": ("batch", [8], r"an entry must be an object, got \[8\]"),
    "a number": ("batch", 8, "an entry must be an object, got 8"),
    "no batch_size": ("batch", {"accumulate_grad_batches": None, "results": [ROW]}, r"lacks \['batch_size'\]"),
    "an unknown field": ("batch", {**ENTRY, "speed": 1}, r"unknown fields \['speed'\]"),
    "batch_size None": ("batch", {**ENTRY, "batch_size": None}, "batch_size must be a positive int, got None"),
    "batch_size 0": ("batch", {**ENTRY, "batch_size": 0}, "batch_size must be a positive int, got 0"),
    "batch_size -8": ("batch", {**ENTRY, "batch_size": -8}, "batch_size must be a positive int, got -8"),
    "batch_size '8'": ("batch", {**ENTRY, "batch_size": "8"}, "batch_size must be a positive int, got '8'"),
    "batch_size 8.0": ("batch", {**ENTRY, "batch_size": 8.0}, "batch_size must be a positive int, got 8.0"),
    "batch_size true": ("batch", {**ENTRY, "batch_size": True}, "batch_size must be a positive int, got True"),
    "accumulate -1": ("batch", {**ENTRY, "accumulate_grad_batches": -1}, "must be None, got -1"),
    "accumulate 4": ("batch", {**ENTRY, "accumulate_grad_batches": 4}, "must be None, got 4"),
    "results a dict": ("batch", {**ENTRY, "results": {}}, r"results must be a list, got \{\}"),
    "results of numbers": ("batch", {**ENTRY, "results": [8]}, r"results\[0\] must be an object, got 8"),
    "a row lacking outcome": (
        "batch", {**ENTRY, "results": [{k: v for k, v in ROW.items() if k != "outcome"}]}, r"lacks \['outcome'\]"
    ),
    "a row with a bad outcome": (
        "batch", {**ENTRY, "results": [{**ROW, "outcome": "great"}]}, "outcome must be one of .*got 'great'"
    ),
    "a row with a string size": (
        "batch", {**ENTRY, "results": [{**ROW, "size": "8"}]}, r"results\[0\].size must be a positive int, got '8'"
    ),
    "a row with NaN": (
        "batch", {**ENTRY, "results": [{**ROW, "step_ms": float("nan")}]}, "step_ms must be None or a number"
    ),
    "a choice that never ran": ("batch", {**ENTRY, "batch_size": 12}, "batch_size 12 is not among the trials"),
    "a margin that is a list": ("batch", {**ENTRY, "margin": [0.1]}, r"margin must be None or an object, got \[0.1\]"),
    "a margin lacking its noise": (
        "batch", {**ENTRY, "margin": {k: v for k, v in _MARGIN.items() if k != "noise"}}, r"lacks \['noise'\]"
    ),
    "a margin with a string gap": (
        "batch", {**ENTRY, "margin": {**_MARGIN, "gap": "5 %"}}, r"margin.gap must be a number in \[-1, 1\], got '5 %'"
    ),
    "a margin of another size": (
        "batch", {**ENTRY, "margin": {**_MARGIN, "size": 4}}, "margin.size 4 is not the choice, batch_size 8"
    ),
    "a choice that did not fit": (
        "batch", {**ENTRY, "results": [{**ROW, "outcome": "spill"}]}, "batch_size 8 is not among the trials"
    ),
    "accumulate None": (
        "accumulation", {**_ACC, "accumulate_grad_batches": None, "results": [_ACC_ROW]}, "must be a positive int"
    ),
    "accumulate -1 (acc)": (
        "accumulation", {**_ACC, "accumulate_grad_batches": -1, "results": [_ACC_ROW]}, "must be a positive int"
    ),
    "checkpointing 'yes'": (
        "accumulation", {**_ACC, "checkpointing": "yes", "results": [_ACC_ROW]}, "checkpointing must be a bool"
    ),
    "no checkpointing": (
        "accumulation", {"batch_size": 8, "accumulate_grad_batches": 2, "results": [_ACC_ROW]}, "lacks"
    ),
    "another effective batch": (
        "accumulation",
        {**_ACC, "batch_size": 4, "results": [{**_ACC_ROW, "size": 4}]},
        "batch_size 4 x accumulate_grad_batches 2 is not 16 samples a step",
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(BAD_ENTRIES))
def test_a_bad_entry_is_a_miss_with_one_warning_and_is_replaced(tmp_path, stored, name):
    kind, bad, reason = BAD_ENTRIES[name]
    key, good = stored[kind]
    other = {"batch_size": "kept as it is"}  # another key's entry: not this fit's business
    (tmp_path / CACHE_FILE).write_text(json.dumps({key: bad, "other": other}), encoding="utf-8")
    tuner, model, said = _fit(kind, tmp_path)
    assert len(said) == 1, said
    assert f"the entry {key} of the result cache {tmp_path / CACHE_FILE} is ignored" in said[0]
    assert re.search(reason, said[0]), said[0]  # the warning says what is wrong
    assert not tuner.from_cache and tuner.results  # measured again
    assert (tuner.batch_size, tuner.accumulate_grad_batches) == (good["batch_size"], good["accumulate_grad_batches"])
    assert model.batch_size == tuner.batch_size
    assert _read(tmp_path) == {key: good, "other": other}  # replaced by what was measured, the rest kept
    assert _files(tmp_path) == [CACHE_FILE]


# ---------------------------------------------------------------- every bad file: a miss with one warning

BAD_FILES = {
    "an empty list": (b"[]", "it holds a JSON list, not an object of entries"),
    "a number": (b"42", "it holds a JSON int, not an object of entries"),
    "a string": (b'"cache"', "it holds a JSON str"),
    "null": (b"null", "it holds a JSON NoneType"),
    "truncated JSON": (b'{"abc": {"batch_size": 8, ', "it is not valid JSON"),
    "an empty file": (b"", "it is not valid JSON"),
    "bytes that are not UTF-8": (b"\xff\xfe{}", "it is not valid JSON"),
    "nesting too deep": (b"[" * 100_000 + b"]" * 100_000, "it is not valid JSON"),
}


@pytest.mark.parametrize("name", list(BAD_FILES))
def test_a_file_that_holds_no_object_of_entries_is_a_miss_and_is_replaced(tmp_path, stored, name):
    content, reason = BAD_FILES[name]
    key, good = stored["batch"]
    (tmp_path / CACHE_FILE).write_bytes(content)
    tuner, _, said = _fit("batch", tmp_path)
    assert len(said) == 1 and f"the result cache {tmp_path / CACHE_FILE} is ignored: {reason}" in said[0], said
    assert not tuner.from_cache and tuner.batch_size == good["batch_size"]
    assert _read(tmp_path) == {key: good} and _files(tmp_path) == [CACHE_FILE]


def test_a_cache_file_that_is_a_folder_is_reported_once_and_left_alone(tmp_path, stored):
    (tmp_path / CACHE_FILE).mkdir()
    (tmp_path / CACHE_FILE / "mine.txt").write_text("x", encoding="utf-8")
    for _ in range(2):  # no stray temporary file, run after run
        tuner, _, said = _fit("batch", tmp_path)
        assert len(said) == 1 and f"the result cache {tmp_path / CACHE_FILE} cannot be read" in said[0], said
        assert tuner.batch_size == stored["batch"][1]["batch_size"]
        assert _files(tmp_path) == [CACHE_FILE] and _files(tmp_path / CACHE_FILE) == ["mine.txt"]


def test_a_cache_folder_that_is_a_file_is_reported_once(tmp_path, stored):
    folder = tmp_path / "not-a-folder"
    folder.write_text("mine", encoding="utf-8")
    tuner, _, said = _fit("batch", folder)
    assert len(said) == 1 and f"{folder / CACHE_FILE} cannot be read (its folder is a file)" in said[0], said
    assert tuner.batch_size == stored["batch"][1]["batch_size"] and folder.read_text(encoding="utf-8") == "mine"


@pytest.mark.skipif(os.name == "nt" or os.geteuid() == 0, reason="permissions as a user on POSIX")
def test_a_cache_folder_that_cannot_be_written_is_reported_once(tmp_path, stored):
    folder = tmp_path / "locked"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        tuner, _, said = _fit("batch", folder)
    finally:
        folder.chmod(0o700)
    assert len(said) == 1 and f"could not write the result cache {folder / CACHE_FILE}" in said[0], said
    assert not tuner.from_cache and _files(folder) == []


def test_cache_dir_expands_the_home_folder(tmp_path, monkeypatch, stored):
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir(), cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("USERPROFILE", str(home))
    monkeypatch.chdir(cwd)
    clock, model = BatchClock(), TinyModel(batch_size=4)
    tuner = BatchSizeTuner(
        init_size=4, max_size=16, probe=PerSample(model, capacity=int(100e9)), clock=clock, cache_dir="~/x", **QUICK
    )
    assert tuner.cache_dir == str(home / "x")
    Trainer(**trainer_kwargs(tmp_path, max_epochs=1, max_steps=1, callbacks=[clock, tuner])).fit(model)
    assert list(_read(home / "x").values())[0]["batch_size"] == tuner.batch_size
    assert _files(cwd) == []  # no literal "./~/x"


# ---------------------------------------------------------------- concurrent writers


def _store_many(folder, writer, count, start):
    cache = ResultCache(folder)
    start.wait()
    for i in range(count):
        row = {**ROW, "size": writer * 100 + i + 1}
        entry = {"batch_size": row["size"], "accumulate_grad_batches": None, "results": [row]}
        assert cache.store(f"w{writer}-{i}", entry)


def test_processes_storing_at_once_keep_every_entry(tmp_path):
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    start = ctx.Event()
    writers = [ctx.Process(target=_store_many, args=(str(tmp_path), w, 20, start)) for w in range(4)]
    for p in writers:
        p.start()
    start.set()
    for p in writers:
        p.join(120)
    assert [p.exitcode for p in writers] == [0, 0, 0, 0]
    data = _read(tmp_path)
    assert sorted(data) == sorted(f"w{w}-{i}" for w in range(4) for i in range(20))
    assert all(
        data[f"w{w}-{i}"]["batch_size"] == w * 100 + i + 1 and check_entry(data[f"w{w}-{i}"], accumulates=False)
        for w in range(4)
        for i in range(20)
    )
    assert _files(tmp_path) == [CACHE_FILE]  # no lock or temporary file left


def test_a_lock_left_by_a_dead_process_is_broken(tmp_path):
    lock = tmp_path / f"{CACHE_FILE}.lock"
    lock.write_text("12345 gone", encoding="utf-8")
    old = time.time() - 60
    os.utime(lock, (old, old))
    assert ResultCache(str(tmp_path), stale_after=10).store("k", ENTRY)
    assert _read(tmp_path) == {"k": ENTRY} and _files(tmp_path) == [CACHE_FILE]


def test_a_lock_held_too_long_is_a_warning_and_nothing_is_written(tmp_path):
    said = []
    cache = ResultCache(str(tmp_path), warn=said.append, lock_timeout=0.2, stale_after=60)
    with FileLock(str(tmp_path / f"{CACHE_FILE}.lock")):
        assert not cache.store("k", ENTRY)
    assert len(said) == 1 and "another process has held the lock for over 0.2 s" in said[0]
    assert _files(tmp_path) == []  # the holder's lock is gone with it, and nothing else was made


def test_a_failed_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    said = []
    cache = ResultCache(str(tmp_path), warn=said.append)
    assert cache.store("k", ENTRY)

    def full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    assert not cache.store("k2", ENTRY)
    assert len(said) == 1 and "No space left on device" in said[0]
    assert _read(tmp_path) == {"k": ENTRY} and _files(tmp_path) == [CACHE_FILE]


def test_a_temporary_file_left_by_a_killed_writer_is_removed(tmp_path):
    orphan = tmp_path / ".tuner-cache-abc.tmp"
    orphan.write_text("{", encoding="utf-8")
    old = time.time() - 60
    os.utime(orphan, (old, old))
    assert ResultCache(str(tmp_path)).store("k", ENTRY)
    assert _files(tmp_path) == [CACHE_FILE]


# ---------------------------------------------------------------- the data an epoch holds


def test_a_choice_made_on_more_data_is_not_reused_on_less(tmp_path):
    kwargs = dict(init_size=4, max_size=64, cache_dir=str(tmp_path / "c"), **QUICK)
    chosen = {}
    for n, expect_cached in ((64, False), (32, False), (64, True), (32, True)):
        clock, model = BatchClock(), TinyModel(batch_size=4, n=n)
        tuner = BatchSizeTuner(probe=PerSample(model, capacity=int(100e9)), clock=clock, **kwargs)
        Trainer(**trainer_kwargs(tmp_path, max_epochs=1, max_steps=1, callbacks=[clock, tuner])).fit(model)
        assert tuner.from_cache is expect_cached, n
        assert tuner.batch_size == model.batch_size <= n
        chosen.setdefault(n, tuner.batch_size)
        assert tuner.batch_size == chosen[n]
    assert chosen == {64: 64, 32: 32}  # the smaller set's choice is capped by it, and not reused on the larger
    assert len(_read(tmp_path / "c")) == 2


def test_a_cached_choice_larger_than_the_epoch_is_measured_again(tmp_path, stored):
    key, good = stored["batch"]  # an entry under this fit's key whose choice is larger than the epoch
    big = {**good, "batch_size": 128, "results": [{**good["results"][0], "size": 128, "outcome": "ok"}], "margin": None}
    (tmp_path / CACHE_FILE).write_text(json.dumps({key: big}), encoding="utf-8")
    tuner, model, said = _fit("batch", tmp_path)
    assert said == [
        "BatchSizeTuner: the earlier choice (batch size 128) is larger than one epoch of the train loader (64"
        " samples); measuring again"
    ]
    assert not tuner.from_cache and tuner.batch_size == model.batch_size == good["batch_size"]


def test_a_reused_tuner_measures_again_on_an_epoch_smaller_than_its_choice(tmp_path):
    clock = BatchClock()
    model = TinyModel(batch_size=4, n=64)
    tuner = BatchSizeTuner(
        init_size=4, max_size=64, probe=PerSample(model, capacity=int(100e9)), clock=clock, cache=False, **QUICK
    )
    Trainer(**trainer_kwargs(tmp_path, max_epochs=1, max_steps=1, callbacks=[clock, tuner])).fit(model)
    assert tuner.batch_size == 64

    small = TinyModel(batch_size=4, n=32)
    tuner.probe = PerSample(small, capacity=int(100e9))
    Trainer(**trainer_kwargs(tmp_path, max_epochs=1, max_steps=1, callbacks=[clock, tuner])).fit(small)
    assert [r.size for r in tuner.results] == [4, 8, 16, 32]  # measured again, up to the epoch
    assert tuner.batch_size == small.batch_size == 32


# ---------------------------------------------------------------- a choice kept with its margin


def _reuse_line(caplog):
    return [r.getMessage() for r in caplog.records if "reusing a cached choice" in r.getMessage()]


def test_the_choice_is_stored_with_its_margin(stored):
    """One timed step a trial: the noise is not known (0.0); 16 stood 27.8 % above the runner-up, 8 (x 2)."""
    margin = {"size": 16, "accumulate": 1, "runner_up": 8, "gap": 0.2778, "noise": 0.0, "remeasured": False}
    assert stored["batch"][1]["margin"] == {**margin, "runner_up_accumulate": 1}
    assert stored["accumulation"][1]["margin"] == {**margin, "runner_up_accumulate": 2}


def test_a_cached_choice_within_the_noise_is_reused_with_a_line_saying_so(tmp_path, stored, caplog):
    """Reused, not measured again: within the noise the two run alike fast as far as can be measured, and a new
    search would choose between equals again (at the cost of a search); the line says so, and how to measure."""
    key, entry = stored["accumulation"]
    close = {**entry["margin"], "gap": 0.02, "noise": 0.05, "remeasured": True}
    (tmp_path / CACHE_FILE).write_text(json.dumps({key: {**entry, "margin": close}}), encoding="utf-8")
    with caplog.at_level(logging.INFO):
        tuner, model, said = _fit("accumulation", tmp_path)
    assert tuner.from_cache and said == [] and (model.batch_size, tuner.accumulate_grad_batches) == (16, 1)
    assert _reuse_line(caplog) == [
        "AccumulationTuner: reusing a cached choice (batch size 16; 16 x 1 and 8 x 2 are within the measurement's"
        " noise (±5.0 %: 2.0 % apart, each measured twice); chose 16 x 1 by the larger micro-batch (the nearer to the"
        " direct batch): either trains about as fast (`cache=False` measures again))"
    ]
    assert tuner.margin.within_noise and _read(tmp_path) == {key: {**entry, "margin": close}}


def test_a_cached_choice_beyond_the_noise_says_its_margin(tmp_path, stored, caplog):
    key, entry = stored["batch"]
    (tmp_path / CACHE_FILE).write_text(json.dumps({key: entry}), encoding="utf-8")
    with caplog.at_level(logging.INFO):
        tuner, _, said = _fit("batch", tmp_path)
    assert tuner.from_cache and said == []
    assert _reuse_line(caplog) == [
        "BatchSizeTuner: reusing a cached choice (batch size 16; 16 is 27.8 % faster than 8, the noise unknown (one"
        " timed step))"
    ]


@pytest.mark.parametrize("kind", ["batch", "accumulation"])
def test_an_entry_written_before_margins_were_kept_is_reused(tmp_path, stored, caplog, kind):
    key, entry = stored[kind]
    older = {k: v for k, v in entry.items() if k != "margin"}
    older["results"] = [{k: v for k, v in row.items() if k != "spread"} for row in older["results"]]
    (tmp_path / CACHE_FILE).write_text(json.dumps({key: older}), encoding="utf-8")
    with caplog.at_level(logging.INFO):
        tuner, model, said = _fit(kind, tmp_path)
    assert tuner.from_cache and said == [] and model.batch_size == entry["batch_size"]
    (line,) = _reuse_line(caplog)
    assert line.endswith("its margin over the other sizes was not recorded (an entry from an earlier version))")
