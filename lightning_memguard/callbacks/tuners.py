"""BatchSizeTuner and AccumulationTuner: measured choices, made at fit start."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import lightning
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_memguard.callbacks._trials import (
    TrialSession,
    reload_train_dataloader,
    require_batch_size_attribute,
    set_batch_size,
)
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
    power_ladder,
)
from lightning_memguard.core.units import parse_bytes
from lightning_memguard.probes import MemoryProbe, probe_for

_SEVERITY = (OK, OVER_HEADROOM, SPILL, OOM)  # the worst outcome on any rank is everyone's


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
        cache_dir: str | None,
    ) -> None:
        self.capacity = None if capacity is None else parse_bytes(capacity, "capacity")
        if probe is not None and not isinstance(probe, MemoryProbe):
            raise TypeError(f"`probe` must have capacity(), reset_peak() and read() methods, got {probe!r}")
        if not isinstance(batch_arg_name, str) or not batch_arg_name:
            raise ValueError(f"`batch_arg_name` must be a non-empty string, got {batch_arg_name!r}")
        self.headroom = check_fraction("headroom", headroom)
        self.probe = probe
        self.batch_arg_name = batch_arg_name
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 0)
        self.timed_steps = check_int("timed_steps", timed_steps, 1)
        self.min_gain = check_fraction("min_gain", min_gain)
        self.tolerance = check_fraction("tolerance", tolerance)
        self.cache = bool(cache)
        self.cache_dir = cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "lightning-memguard")
        # learned
        self.results: list[TrialResult] = []
        self.batch_size: int | None = None
        self.accumulate_grad_batches: int | None = None
        self.from_cache = False

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        return {
            "batch_size": self.batch_size,
            "accumulate_grad_batches": self.accumulate_grad_batches,
            "results": [r.to_dict() for r in self.results],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.batch_size = state_dict.get("batch_size", self.batch_size)
        self.accumulate_grad_batches = state_dict.get("accumulate_grad_batches", self.accumulate_grad_batches)
        self.results = [TrialResult(**row) for row in state_dict.get("results", [])]

    # ------------------------------------------------------------------ measuring

    def _session(self, trainer: Trainer) -> TrialSession:
        probe = self.probe if self.probe is not None else probe_for(trainer.strategy.root_device)
        capacity = self.capacity if self.capacity is not None else probe.capacity()
        return TrialSession(
            trainer, self.batch_arg_name, probe, capacity, self.headroom, self.warmup_steps, self.timed_steps
        )

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
        )

    def _search(self, trainer: Trainer, search: SizeSearch, accumulate_for: Any = None) -> TrialResult | None:
        earlier = list(self.results)  # the session restores callback states on exit, this one's included
        with self._session(trainer) as trials:
            while (size := search.propose()) is not None:
                accumulate = accumulate_for(size) if accumulate_for else 1
                result = self._agree(trainer, trials.run(size, accumulate))
                search.observe(result)
                trials.best_rate = search.best_rate  # later trials are judged against it (a collapse is a spill)
                rank_zero_info(
                    f"{type(self).__name__}: size {size} x {accumulate}: {result.outcome}, "
                    f"{result.samples_per_sec or 0:.1f} samples/s, peak {(result.peak_bytes or 0) / 1e9:.2f} GB"
                )
        self.results = earlier + search.results
        return search.result

    # ------------------------------------------------------------------ cache

    def _cache_key(self, trainer: Trainer, pl_module: LightningModule, extra: dict[str, Any]) -> str:
        params = sum(p.numel() for p in pl_module.parameters())
        device = trainer.strategy.root_device
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        example = getattr(pl_module, "example_input_array", None)
        fields = {
            "model": f"{type(pl_module).__module__}.{type(pl_module).__qualname__}",
            "params": params,
            "input": list(example.shape) if torch.is_tensor(example) else None,
            "hparams": {k: repr(v) for k, v in sorted(dict(pl_module.hparams).items()) if k != self.batch_arg_name},
            "precision": str(trainer.precision),
            "device": name,
            "world_size": trainer.world_size,
            "torch": torch.__version__,
            "lightning": lightning.__version__,
            "tuner": type(self).__name__,
            "capacity": self.capacity,
            "headroom": self.headroom,
            "probe": type(self.probe).__name__ if self.probe is not None else None,
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
        set_batch_size(trainer, self.batch_arg_name, self.batch_size)
        if self.accumulate_grad_batches is not None:
            trainer.accumulate_grad_batches = self.accumulate_grad_batches
        reload_train_dataloader(trainer)

    def _decide(self, trainer: Trainer, pl_module: LightningModule, extra: dict[str, Any], search_fn: Any) -> None:
        if self.batch_size is not None:  # resumed from a checkpoint: re-apply, do not search again
            self._apply(trainer)
            return
        key = self._cache_key(trainer, pl_module, extra)
        cached = self._cache_load(key)
        if cached is not None:
            self.load_state_dict(cached)
            self.from_cache = True
            rank_zero_info(f"{type(self).__name__}: reusing a cached choice (batch size {self.batch_size})")
            self._apply(trainer)
            return
        search_fn()
        self._apply(trainer)
        self._cache_store(trainer, key)


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
        cache: reuse a choice stored for the same model, input, precision, device and library versions.
        cache_dir: where the cache lives (default ``~/.cache/lightning-memguard``).

    Attributes:
        results: one :class:`~lightning_memguard.core.search.TrialResult` per trial.
        batch_size: the choice.

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
        cache_dir: str | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"`mode` must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.init_size = check_int("init_size", init_size, 1)
        self.max_size = check_int("max_size", max_size, self.init_size)
        super().__init__(
            capacity=capacity, headroom=headroom, probe=probe, batch_arg_name=batch_arg_name,
            warmup_steps=warmup_steps, timed_steps=timed_steps, min_gain=min_gain, tolerance=tolerance,
            cache=cache, cache_dir=cache_dir,
        )  # fmt: skip

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        require_batch_size_attribute(trainer, self.batch_arg_name)

        def search() -> None:
            ladder = power_ladder(self.init_size, self.max_size)
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
            ``accumulate_grad_batches``, or manual optimization (in ``setup``).

    Attributes:
        results, batch_size (the micro-batch), accumulate_grad_batches, checkpointing (whether it was turned on).

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
        cache_dir: str | None = None,
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
            cache=cache, cache_dir=cache_dir,
        )  # fmt: skip

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
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
        pairs = accumulation_candidates(self.per_device_batch, min(self.min_micro_batch, self.per_device_batch))
        steps_for = dict(pairs)

        def search() -> None:
            chosen = self._search(
                trainer,
                SizeSearch([m for m, _ in pairs], "throughput", self.min_gain, self.tolerance, refine=False),
                steps_for.get,
            )
            if chosen is None and self.allow_checkpointing:
                from lightning_memguard.checkpointing import checkpoint_blocks

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
                    " `min_micro_batch` or pass allow_checkpointing=True"
                )
            self.batch_size, self.accumulate_grad_batches = chosen.size, steps_for[chosen.size]

        self._decide(trainer, pl_module, {"effective": self.effective_batch_size}, search)
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

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.checkpointing = state_dict.get("checkpointing", self.checkpointing)
