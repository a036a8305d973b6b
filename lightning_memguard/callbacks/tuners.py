"""BatchSizeTuner and AccumulationTuner: measured choices, made at fit start."""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from typing import Any

import lightning
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_memguard import _compiler
from lightning_memguard.callbacks._trials import (
    TrialSession,
    deliverable_samples,
    first_batch_signature,
    reload_train_dataloader,
    require_batch_size_attribute,
    require_module_dataloaders,
    rng_kept,
    set_batch_size,
)
from lightning_memguard.callbacks.checkpointing import ActivationCheckpointing
from lightning_memguard.checkpointing import checkpoint_blocks, is_checkpointed
from lightning_memguard.core.checks import check_fraction, check_int
from lightning_memguard.core.search import (
    MODES,
    OK,
    OOM,
    OVER_HEADROOM,
    SPILL,
    SizeSearch,
    TrialResult,
    accumulation_candidates,
    capped_ladder,
    power_ladder,
)
from lightning_memguard.core.units import parse_bytes
from lightning_memguard.probes import MemoryProbe, probe_for

_SEVERITY = (OK, OVER_HEADROOM, SPILL, OOM)  # the worst outcome on any rank is everyone's


def _qualname(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _hparams(obj: Any, batch_arg_name: str) -> dict[str, str]:
    hparams = getattr(obj, "hparams", None) or {}
    return {str(k): repr(v) for k, v in sorted(dict(hparams).items(), key=str) if k != batch_arg_name}


def _require_checkpointing_first(trainer: Trainer, tuner: Callback) -> None:
    """A budgeted ActivationCheckpointing changes the model at fit start: after the tuner it would be measured
    without it, and train with it."""
    from lightning_memguard.callbacks.checkpointing import ActivationCheckpointing

    callbacks = list(trainer.callbacks)  # type: ignore[attr-defined]
    later = [c for c in callbacks[callbacks.index(tuner) + 1 :] if isinstance(c, ActivationCheckpointing)]
    if any(c.memory_budget is not None for c in later):
        raise ValueError(
            f"ActivationCheckpointing(memory_budget=...) comes after {type(tuner).__name__} in `callbacks`, so the"
            " tuner would measure the model before it is checkpointed; list ActivationCheckpointing first"
        )


class _MeasuringTuner(Callback):
    """What both tuners share: trials, agreement across ranks, state, and the result cache."""

    def __init__(
        self,
        *,
        capacity: int | str | None,
        headroom: float,
        probe: MemoryProbe | None,
        batch_arg_name: str,
        warmup_steps: int,
        timed_steps: int,
        min_gain: float,
        tolerance: float,
        cache: bool,
        cache_dir: str | os.PathLike[str] | None,
        clock: Callable[[], float] | None,
    ) -> None:
        self.capacity = None if capacity is None else parse_bytes(capacity, "capacity")
        if probe is not None and not isinstance(probe, MemoryProbe):
            raise TypeError(f"`probe` must have capacity(), reset_peak() and read() methods, got {probe!r}")
        if not isinstance(batch_arg_name, str):
            raise TypeError(f"`batch_arg_name` must be a string, got {batch_arg_name!r}")
        if not batch_arg_name:
            raise ValueError(f"`batch_arg_name` must be a non-empty string, got {batch_arg_name!r}")
        if not isinstance(cache, bool):
            raise TypeError(f"`cache` must be a bool, got {cache!r}")
        if cache_dir is not None and not isinstance(cache_dir, str | os.PathLike):
            raise TypeError(f"`cache_dir` must be a path (str or os.PathLike) or None, got {cache_dir!r}")
        if cache_dir is not None and not os.fspath(cache_dir):
            raise ValueError(f"`cache_dir` must be a non-empty path or None, got {cache_dir!r}")
        if clock is not None and not callable(clock):
            raise TypeError(f"`clock` must be a callable returning seconds, or None, got {clock!r}")
        self.headroom = check_fraction("headroom", headroom)
        self.probe = probe
        self.batch_arg_name = batch_arg_name
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 0)
        self.timed_steps = check_int("timed_steps", timed_steps, 1)
        self.min_gain = check_fraction("min_gain", min_gain)
        self.tolerance = check_fraction("tolerance", tolerance)
        self.cache = cache
        self.cache_dir = (
            os.fspath(cache_dir)
            if cache_dir is not None
            else os.path.join(os.path.expanduser("~"), ".cache", "lightning-memguard")
        )
        self.clock = clock
        # learned
        self.results: list[TrialResult] = []
        self.batch_size: int | None = None
        self.accumulate_grad_batches: int | None = None
        self.from_cache = False
        self.search_s: float | None = None  # the last search's wall time, compiling included
        self.compile_s: float | None = None  # of it, the trial steps in which torch.compile compiled
        self._restored = False  # load_state_dict ran in this fit: a resume, re-applied as it is

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        return {
            "batch_size": self.batch_size,
            "accumulate_grad_batches": self.accumulate_grad_batches,
            "results": [r.to_dict() for r in self.results],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._load(state_dict)
        self._restored = self.batch_size is not None

    def _load(self, state_dict: dict[str, Any]) -> None:
        self.batch_size = state_dict.get("batch_size", self.batch_size)
        self.accumulate_grad_batches = state_dict.get("accumulate_grad_batches", self.accumulate_grad_batches)
        self.results = [TrialResult(**row) for row in state_dict.get("results", [])]

    # ------------------------------------------------------------------ checks

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        require_module_dataloaders(trainer, type(self).__name__, self.batch_arg_name)
        _require_checkpointing_first(trainer, self)

    def _skipped(self, trainer: Trainer) -> bool:
        """Under ``fast_dev_run`` nothing is measured, as Lightning's BatchSizeFinder does."""
        if getattr(trainer, "fast_dev_run", False):
            rank_zero_warn(f"Skipping {type(self).__name__} since `fast_dev_run` is enabled: nothing measured or set")
            self._restored = False
            return True
        return False

    # ------------------------------------------------------------------ measuring

    def _probe_and_capacity(self, trainer: Trainer) -> tuple[MemoryProbe, int]:
        probe = self.probe if self.probe is not None else probe_for(trainer.strategy.root_device)
        return probe, self.capacity if self.capacity is not None else probe.capacity()

    def _session(self, trainer: Trainer) -> TrialSession:
        probe, capacity = self._probe_and_capacity(trainer)
        return TrialSession(
            trainer, self.batch_arg_name, probe, capacity, self.headroom, self.warmup_steps, self.timed_steps,
            clock=self.clock if self.clock is not None else time.perf_counter,
        )  # fmt: skip

    def _deliverable(self, trainer: Trainer) -> int | None:
        """Samples one epoch of the train loader holds on this rank (the smallest over ranks); None: no length."""
        with rng_kept():
            reload_train_dataloader(trainer)
            samples = deliverable_samples(trainer)
        if trainer.world_size > 1:
            known = torch.tensor(
                [samples if samples is not None else -1], dtype=torch.float64, device=trainer.strategy.root_device
            )
            gathered = trainer.strategy.all_gather(known).reshape(-1)
            lengths = [int(v) for v in gathered.tolist() if v >= 0]
            samples = min(lengths) if lengths else None
        return samples

    def _agree(self, trainer: Trainer, result: TrialResult) -> TrialResult:
        """Every rank adopts one result: it fits only if it fits everywhere, at the slowest rank's speed."""
        if trainer.world_size <= 1:
            return result
        local = torch.tensor(
            [
                _SEVERITY.index(result.outcome),
                result.samples_per_sec or 0.0,
                result.peak_bytes or 0,
                result.step_ms or 0,
            ],
            dtype=torch.float64,
            device=trainer.strategy.root_device,
        )
        gathered = trainer.strategy.all_gather(local).reshape(-1, 4)
        return TrialResult(
            size=result.size,
            step_ms=float(gathered[:, 3].max()),
            peak_bytes=int(gathered[:, 2].max()),
            samples_per_sec=float(gathered[:, 1].min()),
            outcome=_SEVERITY[int(gathered[:, 0].max())],
            accumulate=result.accumulate,
            compiled=result.compiled,
            compile_s=result.compile_s,
        )

    def _search(self, trainer: Trainer, search: SizeSearch, accumulate_for: Any = None) -> TrialResult | None:
        earlier = list(self.results)  # the session restores callback states on exit, this one's included
        clock = self.clock if self.clock is not None else time.perf_counter
        started = clock()
        with self._session(trainer) as trials:
            while (size := search.propose()) is not None:
                accumulate = accumulate_for(size) if accumulate_for else 1
                result = self._agree(trainer, trials.run(size, accumulate))
                search.observe(result)
                trials.best_rate = search.best_rate  # near the capacity, a collapse against it makes a spill
                rank_zero_info(
                    f"{type(self).__name__}: size {size} x {accumulate}: {result.outcome}, "
                    f"{result.samples_per_sec or 0:.1f} samples/s, peak {(result.peak_bytes or 0) / 1e9:.2f} GB"
                )
        self.results = earlier + search.results
        self.search_s, self.compile_s = round(clock() - started, 3), round(trials.compile_s, 3)
        if self.compile_s:
            rank_zero_info(
                f"{type(self).__name__}: searched for {self.search_s:.1f} s, {self.compile_s:.1f} s of it in steps"
                " where torch.compile compiled (one static graph per size; not counted in the step times)"
            )
        return search.result

    # ------------------------------------------------------------------ cache

    def _cache_key(self, trainer: Trainer, pl_module: LightningModule, extra: dict[str, Any]) -> str:
        """Everything that decides memory and speed: the model as it will train (its modules, checkpointed ones
        included), the input (the first train batch's shapes, ``example_input_array``), the datamodule, precision,
        device, the capacity judged against and the tuner's own settings."""
        params = sum(p.numel() for p in pl_module.parameters())
        device = trainer.strategy.root_device
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        example = getattr(pl_module, "example_input_array", None)
        datamodule, arg = getattr(trainer, "datamodule", None), self.batch_arg_name
        probe, capacity = self._probe_and_capacity(trainer)
        structure = hashlib.sha256(
            json.dumps([[n, type(m).__qualname__] for n, m in pl_module.named_modules()]).encode()
        ).hexdigest()
        with rng_kept():
            reload_train_dataloader(trainer)
            batch = first_batch_signature(trainer)
        fields = {
            "model": _qualname(pl_module),
            "params": params,
            "modules": structure,  # an activation-checkpointed or rebuilt block changes the classes here
            "checkpointing": [
                [type(c).__name__, repr(c.units), repr(c.memory_budget), c.bn_correct, c.rebuild_bn_relu]
                for c in trainer.callbacks  # type: ignore[attr-defined]
                if isinstance(c, ActivationCheckpointing)
            ],
            "compiled": _compiler.is_compiled(pl_module),  # a compiled model's step times are its graph's
            "input": list(example.shape) if torch.is_tensor(example) else None,
            "batch": batch,
            "hparams": _hparams(pl_module, arg),
            "datamodule": None if datamodule is None else [_qualname(datamodule), _hparams(datamodule, arg)],
            "precision": str(trainer.precision),
            "device": name,
            "world_size": trainer.world_size,
            "accumulate_grad_batches": trainer.accumulate_grad_batches,
            "torch": torch.__version__,
            "lightning": lightning.__version__,
            "tuner": type(self).__name__,
            "capacity": capacity,
            "headroom": self.headroom,
            "min_gain": self.min_gain,
            "tolerance": self.tolerance,
            "probe": type(probe).__name__,
            **extra,
        }
        return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:24]

    def _cache_path(self) -> str:
        return os.path.join(self.cache_dir, "tuner-cache.json")

    def _cache_load(self, key: str) -> dict[str, Any] | None:
        if not self.cache:
            return None
        try:
            with open(self._cache_path(), encoding="utf-8") as f:
                return json.load(f).get(key)
        except (OSError, ValueError):
            return None

    def _cache_store(self, trainer: Trainer, key: str) -> None:
        if not self.cache or trainer.global_rank != 0:
            return
        path = self._cache_path()
        try:
            os.makedirs(self.cache_dir, exist_ok=True)
            try:
                with open(path, encoding="utf-8") as f:
                    data = json.load(f)
            except (OSError, ValueError):
                data = {}
            data[key] = self.state_dict()
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(data, f)
            os.replace(tmp, path)
        except OSError as err:
            rank_zero_warn(f"{type(self).__name__}: could not write the result cache at {path}: {err}")

    def _apply(self, trainer: Trainer) -> None:
        assert self.batch_size is not None
        self._apply_model(trainer.lightning_module)
        set_batch_size(trainer, self.batch_arg_name, self.batch_size)
        if self.accumulate_grad_batches is not None:
            trainer.accumulate_grad_batches = self.accumulate_grad_batches
        reload_train_dataloader(trainer)

    def _apply_model(self, pl_module: LightningModule) -> None:
        """What the choice changed in the model, made again (AccumulationTuner: activation checkpointing)."""

    def _still_fits(self, trainer: Trainer) -> bool:
        """Re-check a choice not measured in this fit (a cache entry, a reused tuner) on its first optimizer step."""
        assert self.batch_size is not None
        self._apply_model(trainer.lightning_module)
        with self._session(trainer) as trials:
            check = self._agree(trainer, trials.run(self.batch_size, self.accumulate_grad_batches or 1, steps=1))
        if not check.fits:
            peak = (check.peak_bytes or 0) / 1e9
            rank_zero_warn(
                f"{type(self).__name__}: the earlier choice (batch size {self.batch_size} x"
                f" {self.accumulate_grad_batches or 1}) no longer fits: {check.outcome}, peak {peak:.2f} GB on its"
                " first step; measuring again"
            )
        return check.fits

    def _decide(self, trainer: Trainer, pl_module: LightningModule, extra: dict[str, Any], search_fn: Any) -> None:
        restored, self._restored = self._restored, False
        self.from_cache = False
        if self.batch_size is not None and restored:  # resumed from a checkpoint: re-apply, do not search again
            self._apply(trainer)
            return
        if self.batch_size is not None and self._still_fits(trainer):  # this instance's choice from an earlier fit
            self._apply(trainer)
            return
        self._forget()
        key = self._cache_key(trainer, pl_module, extra) if self.cache else ""
        cached = self._cache_load(key)
        if cached is not None:
            self._load(cached)
            if self._still_fits(trainer):
                self.from_cache = True
                rank_zero_info(f"{type(self).__name__}: reusing a cached choice (batch size {self.batch_size})")
                self._apply(trainer)
                return
            self._forget()
        search_fn()
        self._apply(trainer)
        self._cache_store(trainer, key)

    def _forget(self) -> None:
        self.batch_size, self.accumulate_grad_batches, self.results = None, None, []


class BatchSizeTuner(_MeasuringTuner):
    """Picks the batch size by measuring throughput on this device, never a size that spills.

    A spill-aware, throughput-aware replacement for Lightning's ``BatchSizeFinder``: at fit start it trains a few
    steps at each size of a doubling ladder (``init_size`` ... ``max_size``), counts a size as not fitting on OOM, on
    a spill, or on peak memory within ``headroom`` of the capacity, and stops climbing once a step up gains less
    than ``min_gain``. The model, optimizer, schedulers, RNG state and Trainer counters are restored afterwards,
    then the batch size is set where Lightning's tuner sets it (model, hparams or datamodule) and the dataloaders
    are rebuilt.

    Args:
        mode: ``"throughput"`` (fastest samples/s) or ``"max_fit"`` (largest size that fits without spilling).
        init_size: first size tried.
        max_size: largest size tried.
        capacity: device memory to judge against (bytes or ``"16GB"``); default: the probe's.
        headroom: fraction of capacity a trial must leave free.
        probe: memory reader; default: the Trainer device's (``SysmemSpillEmulator(...).probe`` in tests).
        batch_arg_name: the attribute that holds the batch size.
        warmup_steps: untimed steps per trial; timed_steps: timed steps per trial (median).
        min_gain: stop climbing when a doubling gains less than this fraction of throughput.
        tolerance: sizes within this fraction of the best throughput are equal; the smaller is chosen.
        cache: reuse a choice stored for the same model (as it trains: checkpointed blocks included), input (the
            first train batch's shapes), datamodule, precision, device, capacity and library versions; a cached
            choice is re-checked on its first optimizer step and measured again if it no longer fits.
        cache_dir: where the cache lives (default ``~/.cache/lightning-memguard``).
        clock: seconds for timing the trials (default ``time.perf_counter``; tests inject their own).

    Raises:
        ValueError / TypeError: a bad argument (at construction); in ``setup``, a DataLoader passed to ``fit``; in a
            trial, a loader whose batches do not hold the size set (it ignores ``batch_arg_name``).

    Under ``fast_dev_run`` nothing is measured or set (a warning says so), as Lightning's ``BatchSizeFinder`` does.
    Sizes above one epoch of the train loader are not tried (the whole epoch as one batch takes their place), and
    throughput counts the samples really delivered.

    Under ``torch.compile`` (``fit(torch.compile(model))``, a compiled submodule, ``module.compile()``) each size
    tried compiles a graph of its own, static in its shapes, as training at that size alone would (a model compiled
    with ``dynamic=True`` stays dynamic); steps in which the compiler ran are left out of the timing (the trial runs
    as many more) and counted as ``compile_s``, and training after the search runs the chosen size's graph.

    Attributes:
        results: one :class:`~lightning_memguard.core.search.TrialResult` per trial (``compiled``, ``compile_s``
            say whether it ran compiled and how long its compiling steps took).
        batch_size: the choice.
        search_s: the last search's wall time in seconds; compile_s: the part of it spent in compiling steps.

    Example:
        >>> tuner = BatchSizeTuner(init_size=16, max_size=256)
        >>> BatchSizeTuner(mode="biggest")
        Traceback (most recent call last):
        ...
        ValueError: `mode` must be one of ('throughput', 'max_fit'), got 'biggest'
    """

    def __init__(
        self,
        mode: str = "throughput",
        init_size: int = 32,
        max_size: int = 4096,
        capacity: int | str | None = None,
        headroom: float = 0.05,
        probe: MemoryProbe | None = None,
        batch_arg_name: str = "batch_size",
        warmup_steps: int = 2,
        timed_steps: int = 4,
        min_gain: float = 0.05,
        tolerance: float = 0.01,
        cache: bool = True,
        cache_dir: str | os.PathLike[str] | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if not isinstance(mode, str) or mode not in MODES:
            raise ValueError(f"`mode` must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.init_size = check_int("init_size", init_size, 1)
        self.max_size = check_int("max_size", max_size, self.init_size)
        super().__init__(
            capacity=capacity, headroom=headroom, probe=probe, batch_arg_name=batch_arg_name,
            warmup_steps=warmup_steps, timed_steps=timed_steps, min_gain=min_gain, tolerance=tolerance,
            cache=cache, cache_dir=cache_dir, clock=clock,
        )  # fmt: skip

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        require_batch_size_attribute(trainer, self.batch_arg_name)
        if self._skipped(trainer):
            return

        def search() -> None:
            ladder = capped_ladder(power_ladder(self.init_size, self.max_size), self._deliverable(trainer))
            chosen = self._search(trainer, SizeSearch(ladder, self.mode, self.min_gain, self.tolerance))
            if chosen is None:
                raise RuntimeError(
                    f"BatchSizeTuner: no batch size from {self.init_size} up fits on this device without spilling"
                    f" ({', '.join(f'{r.size}: {r.outcome}' for r in self.results)}); lower `init_size`, or use"
                    " AccumulationTuner / ActivationCheckpointing"
                )
            self.batch_size = chosen.size
            rank_zero_info(f"BatchSizeTuner: batch size {chosen.size} ({chosen.samples_per_sec:.1f} samples/s)")

        self._decide(trainer, pl_module, {"mode": self.mode, "range": [self.init_size, self.max_size]}, search)


class AccumulationTuner(_MeasuringTuner):
    """Picks micro-batch x ``accumulate_grad_batches`` for a fixed effective batch by measuring this device.

    The effective batch is split per device (world size counted), candidate micro-batches halve it while it
    divides evenly, and each is trained for a few optimizer steps with the matching accumulation. The fastest one
    that fits (no OOM, no spill, memory within the headroom) is set: the batch-size attribute (model, hparams or
    datamodule) and ``trainer.accumulate_grad_batches``. If even the smallest micro-batch does not fit and
    ``allow_checkpointing=True``, activation checkpointing is turned on and the search runs again.

    Args:
        effective_batch_size: samples per optimizer step, all devices together.
        min_micro_batch: smallest micro-batch to consider.
        allow_checkpointing: fall back to activation checkpointing when nothing fits.
        Other arguments as for :class:`BatchSizeTuner`.

    Raises:
        ValueError: an effective batch that cannot be split over the devices, a Trainer that already sets
            ``accumulate_grad_batches``, manual optimization or a DataLoader passed to ``fit`` (in ``setup``); an
            effective batch larger than one epoch of the train loader (at fit start); a loader that ignores the
            batch-size attribute (in a trial). A choice made with checkpointing turned on turns it on again
            when it is re-applied (resume, cache, a second ``fit``).

    Under ``torch.compile`` each micro-batch tried gets its own static graph and compiling steps are not timed, as
    for :class:`BatchSizeTuner`.

    Attributes:
        results, batch_size (the micro-batch), accumulate_grad_batches, checkpointing (whether it was turned on),
        search_s and compile_s (as for :class:`BatchSizeTuner`).

    Example:
        >>> tuner = AccumulationTuner(effective_batch_size=256)
        >>> AccumulationTuner(effective_batch_size=0)
        Traceback (most recent call last):
        ...
        ValueError: `effective_batch_size` must be >= 1, got 0
    """

    def __init__(
        self,
        effective_batch_size: int,
        min_micro_batch: int = 8,
        allow_checkpointing: bool = False,
        capacity: int | str | None = None,
        headroom: float = 0.05,
        probe: MemoryProbe | None = None,
        batch_arg_name: str = "batch_size",
        warmup_steps: int = 2,
        timed_steps: int = 3,
        min_gain: float = 0.0,
        tolerance: float = 0.01,
        cache: bool = True,
        cache_dir: str | os.PathLike[str] | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.effective_batch_size = check_int("effective_batch_size", effective_batch_size, 1)
        self.min_micro_batch = check_int("min_micro_batch", min_micro_batch, 1)
        if not isinstance(allow_checkpointing, bool):
            raise TypeError(f"`allow_checkpointing` must be a bool, got {allow_checkpointing!r}")
        self.allow_checkpointing = allow_checkpointing
        self.checkpointing = False
        super().__init__(
            capacity=capacity, headroom=headroom, probe=probe, batch_arg_name=batch_arg_name,
            warmup_steps=warmup_steps, timed_steps=timed_steps, min_gain=min_gain, tolerance=tolerance,
            cache=cache, cache_dir=cache_dir, clock=clock,
        )  # fmt: skip

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        super().setup(trainer, pl_module, stage)
        if self.effective_batch_size % trainer.world_size:
            raise ValueError(
                f"`effective_batch_size` {self.effective_batch_size} cannot be split evenly over"
                f" {trainer.world_size} devices"
            )
        if trainer.accumulate_grad_batches != 1 and self.accumulate_grad_batches is None:
            raise ValueError(
                f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) and AccumulationTuner both set"
                " the accumulation; remove one of them"
            )
        if not pl_module.automatic_optimization:
            raise ValueError("AccumulationTuner needs automatic optimization; this module optimizes manually")

    @property
    def per_device_batch(self) -> int:
        return self.effective_batch_size // max(self._world_size, 1)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        require_batch_size_attribute(trainer, self.batch_arg_name)
        self._world_size = trainer.world_size
        if self._skipped(trainer):
            return
        deliverable = self._deliverable(trainer)
        if deliverable is not None and deliverable < self.per_device_batch:
            raise ValueError(
                f"`effective_batch_size` {self.effective_batch_size} needs {self.per_device_batch} samples per device"
                f" for one optimizer step, but an epoch of the train loader holds only {deliverable} per device:"
                " every step would be smaller than the effective batch"
            )
        pairs = accumulation_candidates(self.per_device_batch, min(self.min_micro_batch, self.per_device_batch))
        steps_for = dict(pairs)

        def search() -> None:
            chosen = self._search(
                trainer,
                SizeSearch([m for m, _ in pairs], "throughput", self.min_gain, self.tolerance, refine=False),
                steps_for.get,
            )
            if chosen is None and self.allow_checkpointing:
                plan = checkpoint_blocks(pl_module)
                self.checkpointing = True
                rank_zero_info(f"AccumulationTuner: nothing fit; activation checkpointing on ({plan.summary()})")
                chosen = self._search(
                    trainer,
                    SizeSearch([m for m, _ in pairs], "throughput", self.min_gain, self.tolerance, refine=False),
                    steps_for.get,
                )
            if chosen is None:
                raise RuntimeError(
                    f"AccumulationTuner: not even a micro-batch of {pairs[0][0]} fits on this device without"
                    f" spilling ({', '.join(f'{r.size}: {r.outcome}' for r in self.results)}); lower"
                    " `min_micro_batch`" + ("" if self.checkpointing else ", or pass allow_checkpointing=True")
                )
            self.batch_size, self.accumulate_grad_batches = chosen.size, steps_for[chosen.size]

        extra = {
            "effective": self.effective_batch_size,
            "min_micro_batch": self.min_micro_batch,
            "allow_checkpointing": self.allow_checkpointing,
        }
        self._decide(trainer, pl_module, extra, search)
        if self.accumulate_grad_batches and self.accumulate_grad_batches > 1:
            has_bn = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in pl_module.modules())
            if has_bn:
                rank_zero_warn(
                    f"AccumulationTuner: the model has BatchNorm, whose statistics are now per micro-batch of"
                    f" {self.batch_size}, not per {self.per_device_batch}: not the same training as the direct batch"
                )
        rank_zero_info(
            f"AccumulationTuner: micro-batch {self.batch_size} x accumulate_grad_batches"
            f" {self.accumulate_grad_batches} = {self.effective_batch_size} samples per optimizer step"
        )

    _world_size = 1

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "checkpointing": self.checkpointing}

    def _load(self, state_dict: dict[str, Any]) -> None:
        super()._load(state_dict)
        self.checkpointing = state_dict.get("checkpointing", self.checkpointing)

    def _apply_model(self, pl_module: LightningModule) -> None:
        """A choice made with activation checkpointing turned on needs it on again (resume, cache, a second fit)."""
        if self.checkpointing and not any(is_checkpointed(m) for m in pl_module.modules()):
            plan = checkpoint_blocks(pl_module)
            rank_zero_info(f"AccumulationTuner: checkpointing on again, as for the choice ({plan.summary()})")
