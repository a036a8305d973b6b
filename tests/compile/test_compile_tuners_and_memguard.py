"""The tuners and MemGuard on a ``torch.compile``d model: each trial size runs its own static graph,
compile time is not step time, and training after the search runs the chosen size's graph.

The compiler backend is ``aot_eager`` (forward and backward graphs, no code generation) behind a recorder that
notes each graph's input shapes and charges a fixed compile time to the injected clock.
"""

from __future__ import annotations

import pytest
import torch
from conftest import FakeProbe, TinyModel, trainer_kwargs
from lightning.pytorch import Callback, Trainer
from tuner_helpers import BatchClock, FirstBatch

from lightning_memguard import AccumulationTuner, BatchSizeTuner, MemGuard, SysmemSpillError

COMPILE_S = 100.0


class Recorder:
    """A ``torch.compile`` backend: ``aot_eager``, recording every graph's tensor shapes and whether any is
    symbolic (a dynamic-shape graph), and adding ``cost`` seconds to ``clock`` for each compile."""

    def __init__(self, clock: BatchClock | None = None, cost: float = COMPILE_S) -> None:
        self.clock, self.cost = clock, cost
        self.graphs: list[tuple[bool, list[tuple[int, ...]]]] = []

    def __call__(self, gm, example_inputs):
        shapes = [tuple(t.shape) for t in example_inputs if torch.is_tensor(t)]
        dynamic = any(isinstance(t, torch.SymInt) for t in example_inputs) or any(
            isinstance(d, torch.SymInt) for shape in shapes for d in shape
        )
        self.graphs.append((dynamic, shapes))
        if self.clock is not None:
            self.clock.now += self.cost
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    def batch_sizes(self) -> list[int]:
        """The batch dimension of each static graph of the network: its input of 16 features, the (B, 16) tensor
        that is not the first layer's 32 x 16 weight (graphs without one, e.g. a logged scalar's, are left out)."""
        sizes = []
        for dynamic, shapes in self.graphs:
            rows = [s[0] for s in shapes if s[1:] == (16,)]
            if not dynamic and len(rows) == 2:
                rows.remove(32)
                sizes.append(rows[0])
        return sizes


class Compiles(Callback):
    """How many graphs had been compiled when training (after the tuner) began, and when it ended."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder

    def on_train_start(self, trainer, pl_module):
        self.at_start = len(self.recorder.graphs)

    def on_train_end(self, trainer, pl_module):
        self.at_end = len(self.recorder.graphs)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _fit(tmp_path, model, tuner, clock, recorder, dynamic=None, **kw):
    seen = Compiles(recorder)
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=[clock, tuner, seen], **kw))
    trainer.fit(torch.compile(model, backend=recorder, dynamic=dynamic))
    return trainer, seen


def test_batch_size_tuner_on_a_compiled_model_times_one_static_graph_per_size(tmp_path):
    clock = BatchClock()  # a batch of n samples takes 10 ms + 1 ms per sample; a compile takes 100 s
    recorder = Recorder(clock)
    tuner = BatchSizeTuner(
        init_size=4, max_size=16, probe=FakeProbe(), cache=False, clock=clock, warmup_steps=0, timed_steps=2
    )
    _, seen = _fit(tmp_path, TinyModel(batch_size=4, n=64), tuner, clock, recorder, limit_train_batches=3)

    assert not any(dynamic for dynamic, _ in recorder.graphs)  # never the dynamic-shape graph of a second size
    assert recorder.batch_sizes() == [4, 8, 16]
    # the compiling step is not timed: each size's step time is its own batch's, and the compile is reported apart
    assert [(r.size, r.step_ms, r.compiled) for r in tuner.results] == [
        (4, 14.0, True),
        (8, 18.0, True),
        (16, 26.0, True),
    ]
    assert all(COMPILE_S <= r.compile_s < COMPILE_S + 1 for r in tuner.results)
    assert tuner.batch_size == 16
    assert 3 * COMPILE_S <= tuner.compile_s <= tuner.search_s
    # training at the choice runs the graph its trial compiled: nothing new is compiled
    assert seen.at_end == seen.at_start == 3


def test_every_size_gets_its_graph_even_past_the_recompile_limit(tmp_path):
    clock = BatchClock()
    recorder = Recorder(clock)
    tuner = BatchSizeTuner(
        init_size=2, max_size=32, probe=FakeProbe(), cache=False, clock=clock, warmup_steps=0, timed_steps=1
    )
    with torch._dynamo.config.patch(recompile_limit=2):  # the user's limit: it holds again after the search
        _, seen = _fit(tmp_path, TinyModel(batch_size=2, n=64), tuner, clock, recorder, limit_train_batches=2)
        assert torch._dynamo.config.recompile_limit == 2
        assert torch._dynamo.config.automatic_dynamic_shapes
    assert recorder.batch_sizes() == [2, 4, 8, 16, 32]  # none fell back to eager at the limit
    assert all(r.compiled and r.compile_s >= COMPILE_S for r in tuner.results)
    assert seen.at_end == seen.at_start


def test_a_model_compiled_with_dynamic_shapes_stays_dynamic(tmp_path):
    clock = BatchClock()
    recorder = Recorder(clock)
    tuner = BatchSizeTuner(
        init_size=4, max_size=16, probe=FakeProbe(), cache=False, clock=clock, warmup_steps=0, timed_steps=2
    )
    _fit(tmp_path, TinyModel(batch_size=4, n=64), tuner, clock, recorder, dynamic=True, limit_train_batches=3)
    assert [dynamic for dynamic, _ in recorder.graphs] == [True]  # one graph, for every size, as asked
    assert [r.compile_s >= COMPILE_S for r in tuner.results] == [True, False, False]
    assert [r.step_ms for r in tuner.results] == [14.0, 18.0, 26.0]


def test_accumulation_tuner_on_a_compiled_model(tmp_path):
    clock = BatchClock()
    recorder = Recorder(clock)
    tuner = AccumulationTuner(
        16, min_micro_batch=4, probe=FakeProbe(), cache=False, clock=clock, warmup_steps=0, timed_steps=2
    )
    _, seen = _fit(tmp_path, TinyModel(batch_size=4, n=64), tuner, clock, recorder, limit_train_batches=4)
    assert not any(dynamic for dynamic, _ in recorder.graphs)
    assert sorted(recorder.batch_sizes()) == [4, 8, 16]
    assert all(r.compiled and r.compile_s >= COMPILE_S for r in tuner.results)
    # an optimizer step of 16 samples: 16 x 1 takes 26 ms, 8 x 2 36 ms, 4 x 4 56 ms; compiling is not counted
    assert sorted((r.size, r.accumulate, r.step_ms) for r in tuner.results) == [
        (4, 4, 56.0),
        (8, 2, 36.0),
        (16, 1, 26.0),
    ]
    assert (tuner.batch_size, tuner.accumulate_grad_batches) == (16, 1)
    assert seen.at_end == seen.at_start


def test_an_eager_model_reports_no_compiling(tmp_path):
    clock = BatchClock()
    tuner = BatchSizeTuner(
        init_size=4, max_size=8, probe=FakeProbe(), cache=False, clock=clock, warmup_steps=0, timed_steps=2
    )
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=1, limit_train_batches=2, callbacks=[clock, tuner]))
    trainer.fit(TinyModel(batch_size=4, n=64))
    assert [(r.compiled, r.compile_s) for r in tuner.results] == [(False, 0.0), (False, 0.0)]
    assert tuner.compile_s == 0.0


def test_the_cache_tells_a_compiled_model_from_its_eager_twin(tmp_path):
    clock = BatchClock()
    kwargs = dict(init_size=4, max_size=8, probe=FakeProbe(), cache_dir=tmp_path / "cache", clock=clock, timed_steps=1)
    eager = BatchSizeTuner(**kwargs)
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=1, limit_train_batches=2, callbacks=[clock, eager]))
    trainer.fit(TinyModel(batch_size=4, n=64))
    compiled = BatchSizeTuner(**kwargs)
    _fit(tmp_path, TinyModel(batch_size=4, n=64), compiled, clock, Recorder(clock), limit_train_batches=2)
    assert not compiled.from_cache and all(r.compiled for r in compiled.results)


class Slowdown(Callback):
    """From optimizer step ``at`` on, every batch takes ``factor`` times longer and memory sits at the capacity."""

    def __init__(self, clock: BatchClock, probe: FakeProbe, at: int, factor: float = 10.0) -> None:
        self.clock, self.probe, self.at, self.factor = clock, probe, at, factor

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step >= self.at:
            self.clock.seconds = lambda n: self.factor * (0.01 + 0.001 * n)
            self.probe.peak = int(15.5e9)


def test_memguard_reference_and_a_recompile_for_the_last_short_batch_are_not_compile_time(tmp_path):
    """The first step compiles (100 s): it must not set the reference. Each epoch's short last batch (36 samples in
    batches of 8) recompiles: not a spill. A real collapse with memory at the capacity later is one."""
    clock = BatchClock()
    recorder = Recorder(clock)
    probe = FakeProbe(capacity=16 * 10**9, peak=8 * 10**9)
    guard = MemGuard(probe=probe, clock=clock, warmup_steps=0, reference_steps=2)
    slow = Slowdown(clock, probe, at=3, factor=4.0)
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=4, callbacks=[clock, guard, slow]))
    with pytest.raises(SysmemSpillError, match="spill"):
        trainer.fit(torch.compile(TinyModel(batch_size=8, n=36), backend=recorder))
    assert len(recorder.graphs) >= 2  # the short batch did recompile
    assert guard.spill is not None and guard.spill.step >= 3  # not before: recompiles were not taken for a spill


def test_memguard_does_not_take_recompiles_for_a_spill(tmp_path):
    clock = BatchClock()
    recorder = Recorder(clock)
    probe = FakeProbe(capacity=16 * 10**9, peak=int(15.5e9))  # at the capacity throughout, never slower
    guard = MemGuard(probe=probe, clock=clock, warmup_steps=0, reference_steps=2)
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=3, callbacks=[clock, guard]))
    trainer.fit(torch.compile(TinyModel(batch_size=8, n=36), backend=recorder))
    assert guard.spill is None
    assert len(recorder.graphs) >= 2


# ---------------------------------------------------------------- the runs users make, under compile (STYLE rule 13)


def _batch_tuner(clock, probe, **kw):
    return BatchSizeTuner(
        init_size=4, max_size=16, probe=probe, cache=False, clock=clock, warmup_steps=0, timed_steps=2, **kw
    )


def test_resume_under_compile_with_a_tuner_the_checkpoint_did_not_have(tmp_path):
    """The trials compile one static graph per size and leave the checkpoint's state as it was; training goes on
    from the checkpoint on the chosen size's graph."""
    first = Trainer(**trainer_kwargs(tmp_path, max_epochs=2, limit_train_batches=4, enable_checkpointing=True))
    first.fit(TinyModel(batch_size=8, n=64))
    ckpt = first.checkpoint_callback.best_model_path

    model = TinyModel(batch_size=8, n=64)
    clock, seen_batch = BatchClock(), FirstBatch()
    recorder = Recorder(clock)
    tuner = _batch_tuner(clock, FakeProbe())
    seen = Compiles(recorder)
    trainer = Trainer(
        **trainer_kwargs(tmp_path, max_epochs=3, limit_train_batches=4, callbacks=[clock, tuner, seen, seen_batch])
    )
    trainer.fit(torch.compile(model, backend=recorder), ckpt_path=ckpt)
    assert recorder.batch_sizes() == [4, 8, 16] and not any(dynamic for dynamic, _ in recorder.graphs)
    assert all(r.compiled for r in tuner.results) and tuner.batch_size == 16
    assert (seen_batch.epoch, seen_batch.global_step) == (2, 8)  # where the checkpoint left off
    assert seen_batch.batch_samples == 16 and seen.at_end == seen.at_start  # the trial's graph, nothing new


def test_resume_under_compile_with_the_tuners_state_reapplies_it_without_measuring(tmp_path):
    clock = BatchClock()
    model = TinyModel(batch_size=4, n=64)
    tuner = _batch_tuner(clock, FakeProbe())
    first = Trainer(
        **trainer_kwargs(
            tmp_path, max_epochs=1, limit_train_batches=2, enable_checkpointing=True, callbacks=[clock, tuner]
        )
    )
    first.fit(torch.compile(model, backend=Recorder(clock)))
    ckpt = first.checkpoint_callback.best_model_path
    torch._dynamo.reset()

    model = TinyModel(batch_size=4, n=64)
    probe, recorder, seen_batch = FakeProbe(), Recorder(clock), FirstBatch()
    resumed = _batch_tuner(clock, probe)
    trainer = Trainer(
        **trainer_kwargs(tmp_path, max_epochs=2, limit_train_batches=2, callbacks=[clock, resumed, seen_batch])
    )
    trainer.fit(torch.compile(model, backend=recorder), ckpt_path=ckpt)
    assert probe.resets == 0 and resumed.batch_size == tuner.batch_size == 16  # no trial ran
    assert len(recorder.graphs) == 1 and recorder.batch_sizes() == [16]  # the chosen size's graph, and only that
    assert seen_batch.batch_samples == 16 and (seen_batch.epoch, seen_batch.global_step) == (1, 2)


def test_the_same_tuner_in_a_second_fit_under_compile_checks_its_choice_and_compiles_only_that(tmp_path):
    clock = BatchClock()
    probe = FakeProbe()
    tuner = _batch_tuner(clock, probe)
    _fit(tmp_path, TinyModel(batch_size=4, n=64), tuner, clock, Recorder(clock), limit_train_batches=2)
    searched = probe.resets  # one per trial: three sizes
    torch._dynamo.reset()
    recorder = Recorder(clock)
    _, seen = _fit(tmp_path, TinyModel(batch_size=4, n=64), tuner, clock, recorder, limit_train_batches=2)
    assert tuner.batch_size == 16 and probe.resets - searched == 1  # its choice still fits: one check, no search
    assert len(recorder.graphs) == 1 and recorder.batch_sizes() == [16]  # the check's step compiled it; training ran it
    assert seen.at_end == seen.at_start == 1


def test_a_dataset_smaller_than_the_ladder_under_compile(tmp_path):
    """100 samples: the ladder stops at 100. At 64 the epoch's last batch holds 36 samples, a new static graph:
    that step compiled and is not timed; the trial runs one more in its place."""
    clock = BatchClock()
    recorder = Recorder(clock)
    tuner = BatchSizeTuner(
        init_size=16, max_size=512, probe=FakeProbe(), cache=False, clock=clock, warmup_steps=0, timed_steps=3
    )
    _, seen = _fit(tmp_path, TinyModel(batch_size=16, n=100), tuner, clock, recorder, limit_train_batches=2)
    assert [r.size for r in tuner.results] == [16, 32, 64, 100]
    assert sorted(set(recorder.batch_sizes())) == [4, 16, 32, 36, 64, 100]  # each size, and each short last batch
    assert not any(dynamic for dynamic, _ in recorder.graphs)
    rates = {r.size: r.samples_per_sec for r in tuner.results}
    assert rates[100] == pytest.approx(100 / 0.110)
    assert rates[64] == pytest.approx(64 / 0.074)  # the compiling 36-sample step is compile time, not a rate
    assert tuner.batch_size == 100
    assert seen.at_end == seen.at_start


def test_fast_dev_run_under_compile_skips_the_search(tmp_path):
    clock = BatchClock()
    probe = FakeProbe()
    tuner = _batch_tuner(clock, probe)
    trainer = Trainer(**trainer_kwargs(tmp_path, fast_dev_run=True, callbacks=[clock, tuner]))
    model = TinyModel(batch_size=4, n=64)
    recorder = Recorder(clock)
    with pytest.warns(UserWarning, match="Skipping BatchSizeTuner since `fast_dev_run` is enabled"):
        trainer.fit(torch.compile(model, backend=recorder))
    assert probe.resets == 0 and not tuner.results and model.batch_size == 4
    assert set(recorder.batch_sizes()) == {4}  # the training step's graph and the validation step's, at 4
