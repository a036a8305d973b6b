"""Where checkpointing every block costs time: timm's own switch against ours, and ablations between them, on one
model in one process. Run on a CUDA machine:

    python benchmarks/checkpoint_overhead.py --model convnext_tiny --profile --out checkpoint_overhead.json

The families benchmark (``benchmarks/families.py``) found timm ``convnext_tiny`` (bf16 autocast, batch 128 at 224
px, channels_last) 13 % slower with ``checkpoint_blocks(model)`` than with ``model.set_grad_checkpointing(True)``
for the same activation memory. Every row here is built, changed and timed by families.py's own functions
(``make_model``, ``make_batches``, ``apply``, ``train_steps``: AdamW, median step by CUDA events, activation peak
above the resting model), each on a fresh model from the same seed:

- ``plain``, ``family_switch`` (timm's ``set_grad_checkpointing(True)``), ``ours_every_block``
  (``checkpoint_blocks(model)``), as families.py applies them;
- ``wrapper_*``: each of the family's blocks (``find_units(model)``: timm's checkpointed blocks, not a ResNet's stem)
  replaced in its container by a small module whose forward checkpoints it: ``wrapper_timm_checkpoint_seq`` with
  timm's own ``checkpoint_seq([block], x)`` (whatever timm passes to ``torch.utils.checkpoint`` in this install),
  ``wrapper_nonreentrant`` / ``wrapper_reentrant`` with ``torch.utils.checkpoint`` and ``use_reentrant`` False / True
  (``preserve_rng_state`` left at its default, as timm leaves it), ``wrapper_nonreentrant_context_fn`` with our
  ``context_fn`` (``FrozenBatchNormStats``, as ``CheckpointedUnit.forward`` passes it), and
  ``wrapper_nonreentrant_no_rng`` with ``preserve_rng_state=False``;
- for a language or speech model (``--model bert``, ``gpt2``, ``llama``, ``t5``, ``whisper``: Hugging Face's
  ``activation_checkpointing_enable`` is its switch; no wrapper rows, since its layers take more than one tensor):
  ``fused_loss_every_block`` as families.py applies it, and ``ours_switch_blocks`` / ``fused_loss_switch_blocks``,
  the same with only the family's blocks checkpointed (``find_units(model)``, the switch's own set: not the
  embeddings' stem that ``checkpoint_blocks(model)`` adds);
- ``ours_switch_blocks_but_last`` (any model) and ``fused_loss_switch_blocks_but_last``: the family's blocks but the
  last one, whose recomputation comes as backward begins. Left unchecked it is not free: on an H100 BERT-base's step
  held 0.26 GB more (docs/measured.md#last-block), its activations held with the head's at the forward's end;
- ``ours_bn_correct_off``: ``checkpoint_blocks(model, bn_correct=False)``, the library's switch for the path
  without ``context_fn``;
- ABLATIONS (monkeypatches of ``lightning_memguard.checkpointing.wrap`` for the row only, undone after it; not
  settings of the library): ``ours_minimal_forward`` (the class swap kept, ``CheckpointedUnit.forward`` reduced to
  ``checkpoint(self._memguard_forward, *args, use_reentrant=False)``: no ``_compiler.compiling()``, no ``__dict__``
  look-ups, no ``context_fn``) and ``ours_no_rng_state`` (ours with ``preserve_rng_state=False``).

After its timed steps every row runs a few more steps timed by phase (forward, backward, optimizer) with CUDA events
and, on the host, the time each phase's Python call takes to return (each step begins synchronized, so a host time
near the GPU time means the phase is launch-bound). ``--passes 2`` (the default) measures all rows again in the
reverse order, so that drift (clocks, the allocator, cuDNN's benchmark picks) is not taken for a row's cost.
``--profile`` runs one more step of ``family_switch`` and ``ours_every_block`` (``--profile-rows``) under
``torch.profiler`` and prints, for each, the top 15 ops by self CUDA time, GPU kernels by time and ops by self CPU
time, and the GPU's busy time (kernels, memory copies and sets, as a union of intervals) against the span they
cover; between the two rows, the ops and kernels whose call counts differ and the largest differences in self CUDA
and self CPU time. ``--smoke`` runs with 1 phase step and 1 pass.

Results are written after every row; a row that fails is recorded with its error. ``--smoke`` runs a tiny version
on the CPU (families.py's smoke models at 32 px, batch 2; 1 warm-up and 2 timed steps): every row's code path, not
a measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import inspect
import io
import math
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import families  # noqa: E402
from _common import environment, free_memory, median, write_json  # noqa: E402
from families import Setting, apply, compare, loss_of, make_batches, make_model, train_steps  # noqa: E402

from lightning_memguard.checkpointing import checkpoint_blocks, find_units  # noqa: E402
from lightning_memguard.checkpointing import wrap as memguard_wrap  # noqa: E402
from lightning_memguard.levers import apply_fused_loss  # noqa: E402

MODELS = {  # --model: families.py's name for it
    "convnext_tiny": "convnext_tiny",
    "resnet50": "resnet50",
    "vit_small_patch16_224": "vit_small",
    "vit_small": "vit_small",
    "efficientnet_b0": "efficientnet_b0",
    "bert": "bert",  # the language and speech models: Hugging Face's switch, no wrapper rows
    "gpt2": "gpt2",
    "llama": "llama",
    "t5": "t5",
    "whisper": "whisper",
}
ROWS = {
    "plain": "no checkpointing",
    "family_switch": "timm's model.set_grad_checkpointing(True): checkpoint_seq over each stage's blocks",
    "ours_every_block": "checkpoint_blocks(model), as families.py applies it (class swap, context_fn)",
    "wrapper_timm_checkpoint_seq": "each block in a wrapper calling timm's checkpoint_seq([block], x)",
    "wrapper_nonreentrant": "each block in a wrapper: checkpoint(block, x, use_reentrant=False)",
    "wrapper_reentrant": "each block in a wrapper: checkpoint(block, x, use_reentrant=True)",
    "wrapper_nonreentrant_context_fn": "wrapper_nonreentrant + our context_fn (FrozenBatchNormStats)",
    "wrapper_nonreentrant_no_rng": "wrapper_nonreentrant + preserve_rng_state=False",
    "ours_bn_correct_off": "checkpoint_blocks(model, bn_correct=False): ours without context_fn",
    "ours_minimal_forward": "ABLATION (monkeypatch): class swap kept, forward = checkpoint(use_reentrant=False) only",
    "ours_no_rng_state": "ABLATION (monkeypatch): ours with preserve_rng_state=False",
    "ours_switch_blocks": "checkpoint_blocks(model, units=<find_units(model)>): the family's blocks only, no stem",
    "fused_loss_every_block": "families.py's row: apply_fused_loss, then checkpoint_blocks(model) (language, speech)",
    "fused_loss_switch_blocks": "apply_fused_loss, then the family's blocks only, no stem (language, speech)",
    "ours_switch_blocks_but_last": "the family's blocks but the last, whose recomputation comes as backward begins",
    "fused_loss_switch_blocks_but_last": "apply_fused_loss, then the family's blocks but the last (language, speech)",
}
FUSED_ROWS = ("fused_loss_every_block", "fused_loss_switch_blocks", "fused_loss_switch_blocks_but_last")
SWITCH_BLOCKS = {  # the family's own blocks (find_units), and how many of them at the end left unchecked
    "ours_switch_blocks": 0,
    "fused_loss_switch_blocks": 0,
    "ours_switch_blocks_but_last": 1,
    "fused_loss_switch_blocks_but_last": 1,
}
PROFILED = ("family_switch", "ours_every_block")
TOP = 15


# -- the rows ------------------------------------------------------------------------------------------------------


class CheckpointedBlock(nn.Module):
    """A block replaced by this wrapper in its container: its forward calls ``call(block, x)``, which checkpoints it
    (the block's own ``__call__``, as timm's ``checkpoint_seq`` calls it)."""

    def __init__(self, block: nn.Module, call: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.block = block
        self.call = call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.call(self.block, x)


def _timm_call(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    from timm.models._manipulate import checkpoint_seq

    return checkpoint_seq([block], x)  # type: ignore[no-any-return]


def _with_context_fn(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    def context_fn() -> tuple[Any, Any]:  # CheckpointedUnit.forward's, for a block that is a run of its own
        return contextlib.nullcontext(), memguard_wrap.FrozenBatchNormStats(memguard_wrap.tracked_batchnorms([block]))

    return checkpoint(block, x, use_reentrant=False, context_fn=context_fn)  # type: ignore[no-any-return]


WRAPPER_CALLS: dict[str, Callable[[nn.Module, torch.Tensor], torch.Tensor]] = {
    "wrapper_timm_checkpoint_seq": _timm_call,
    "wrapper_nonreentrant": functools.partial(checkpoint, use_reentrant=False),
    "wrapper_reentrant": functools.partial(checkpoint, use_reentrant=True),
    "wrapper_nonreentrant_context_fn": _with_context_fn,
    "wrapper_nonreentrant_no_rng": functools.partial(checkpoint, use_reentrant=False, preserve_rng_state=False),
}


def wrap_blocks(model: nn.Module, call: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> int:
    """Replace each of the family's blocks (``find_units``) in its container by a :class:`CheckpointedBlock`."""
    blocks = find_units(model)
    for name, block in blocks:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, CheckpointedBlock(block, call))
    return len(blocks)


def _minimal_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
    """ABLATION: CheckpointedUnit.forward reduced to the checkpoint call, as timm makes it."""
    return checkpoint(self._memguard_forward, *args, use_reentrant=False, **kwargs)


@contextlib.contextmanager
def patched(row: str) -> Iterator[None]:
    """The monkeypatch an ABLATION row runs under (nothing for the others), undone when it ends."""
    if row == "ours_minimal_forward":
        target, name, value = memguard_wrap.CheckpointedUnit, "forward", _minimal_forward
    elif row == "ours_no_rng_state":
        target, name = memguard_wrap, "checkpoint"
        value = functools.partial(torch.utils.checkpoint.checkpoint, preserve_rng_state=False)
    else:
        yield
        return
    before = target.__dict__[name]
    setattr(target, name, value)
    try:
        yield
    finally:
        setattr(target, name, before)


def prepare(name: str, row: str, model: nn.Module, example: torch.Tensor, setting: Setting) -> dict[str, Any]:
    """Change ``model`` as ``row`` says; what was done."""
    if row in FUSED_ROWS and name not in families.FUSED:
        raise ValueError(f"{row} is for the language and speech models, not {name}")
    if row in ("plain", "family_switch", "ours_every_block", "fused_loss_every_block"):
        return apply(name, row, model, example, setting)  # as families.py does
    if row in SWITCH_BLOCKS:
        if row in FUSED_ROWS:
            apply_fused_loss(model.model, counted_only=True)  # type: ignore[arg-type]  # as families.py's row
        units = [unit for unit, _ in find_units(model)]
        plan = checkpoint_blocks(model, units=units[: len(units) - SWITCH_BLOCKS[row]])
        return {"blocks": len(plan.blocks), "checkpointed": plan.blocks, "fused_loss": row in FUSED_ROWS}
    if row in WRAPPER_CALLS:
        if name not in families.VISION:  # a Hugging Face layer takes more than one tensor
            raise ValueError(f"{row} wraps single-input blocks: the vision models only, not {name}")
        return {"blocks": wrap_blocks(model, WRAPPER_CALLS[row])}
    if row == "ours_bn_correct_off":
        plan = checkpoint_blocks(model, bn_correct=False)
        return {"blocks": len(plan.blocks), "candidates": plan.candidates}
    if row in ("ours_minimal_forward", "ours_no_rng_state"):  # the entrance as families.py calls it, patched
        return apply(name, "ours_every_block", model, example, setting)
    raise ValueError(f"unknown row {row!r}")


# -- phases and the profile ----------------------------------------------------------------------------------------


def _sync(setting: Setting) -> None:
    if setting.device.type == "cuda":
        torch.cuda.synchronize()


def phase_steps(
    model: nn.Module, batches: list, setting: Setting, steps: int, profile: bool
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """After the timed steps: one warm-up step of a fresh AdamW (not in the smoke run), ``steps`` steps timed by
    phase, and with ``profile`` one more under ``torch.profiler``. Each step begins synchronized. Per phase (forward
    with the loss, backward, optimizer): the GPU's time between CUDA events (the host's on the CPU) and the host's
    time until its call returns; medians in ms."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model.train()
    cuda = setting.device.type == "cuda"
    gpu: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": []}
    host: dict[str, list[float]] = {k: [] for k in gpu}

    def step(batch: tuple[torch.Tensor, ...], labelled: bool = False) -> tuple[list[float], list[Any]]:
        label = torch.profiler.record_function if labelled else lambda _: contextlib.nullcontext()
        opt.zero_grad(set_to_none=True)
        _sync(setting)
        marks, events = [time.perf_counter()], []
        if cuda:
            events.append(torch.cuda.Event(enable_timing=True))
            events[-1].record()
        for phase in gpu:
            with label(f"phase: {phase}"):
                if phase == "forward":
                    with setting.autocast():
                        loss = loss_of(model, batch)
                elif phase == "backward":
                    loss.backward()
                else:
                    opt.step()
            marks.append(time.perf_counter())
            if cuda:
                events.append(torch.cuda.Event(enable_timing=True))
                events[-1].record()
        _sync(setting)
        return marks, events

    if not setting.smoke:
        step(batches[0])  # AdamW's state made here, not in a timed step
    for i in range(steps):
        marks, events = step(batches[(i + 1) % len(batches)])
        for j, phase in enumerate(gpu):
            host[phase].append((marks[j + 1] - marks[j]) * 1e3)
            gpu[phase].append(events[j].elapsed_time(events[j + 1]) if cuda else host[phase][-1])
    phases = {f"{phase}_gpu_ms": median(v) for phase, v in gpu.items()}
    phases.update({f"{phase}_host_ms": median(v) for phase, v in host.items()})
    summary = None
    if profile:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        try:  # a profiler that cannot run (CUPTI refused) must not lose the row's timing
            with torch.profiler.profile(activities=activities) as prof:
                marks, events = step(batches[1 % len(batches)], labelled=True)
            wall = events[0].elapsed_time(events[-1]) if cuda else (marks[-1] - marks[0]) * 1e3
            summary = profile_summary(prof, wall)
        except Exception as error:  # noqa: BLE001
            summary = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc(limit=-4)}
    return phases, summary


def _us(event: Any, *names: str) -> float:
    """An event's time in µs under the first attribute this torch has (``self_device_time_total``, once
    ``self_cuda_time_total``)."""
    for name in names:
        value = getattr(event, name, None)
        if value is not None:
            return float(value)
    return 0.0


def _self_device(event: Any) -> float:
    return _us(event, "self_device_time_total", "self_cuda_time_total")


def _self_cpu(event: Any) -> float:
    return _us(event, "self_cpu_time_total")


def profile_summary(prof: Any, step_ms: float) -> dict[str, Any]:
    """What one profiled step shows: every op's count and self times (ms; the GPU's own events, kernels, copies and
    sets, apart as ``[gpu] <name>``), the top ones, the phases' host times, and the GPU's busy time (the union of
    its events) against the span they cover."""
    ops: dict[str, dict[str, Any]] = {}
    phases: dict[str, float] = {}
    intervals = []
    for e in prof.events():  # key_averages' figures, many times faster (seconds for a CPU step's 30,000 events)
        on_device = getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA
        if e.key.startswith("phase: ") or getattr(e, "is_user_annotation", False):  # a range, not work
            if not on_device and e.key.startswith("phase: "):  # on the host: the phase's whole time, not its self
                phase = e.key.removeprefix("phase: ")
                phases[phase] = phases.get(phase, 0.0) + _us(e, "cpu_time_total") / 1e3
            continue
        key = f"[gpu] {e.key}" if on_device else e.key
        op = ops.setdefault(key, {"count": 0, "self_cuda_ms": 0.0, "self_cpu_ms": 0.0})
        op["count"] += 1
        op["self_cuda_ms"] += _self_device(e) / 1e3
        op["self_cpu_ms"] += 0.0 if on_device else _self_cpu(e) / 1e3
        if on_device and e.time_range.end > e.time_range.start:
            intervals.append((e.time_range.start, e.time_range.end))
    intervals.sort()
    busy, last = 0.0, None
    for start, end in intervals:  # the union of intervals, in µs
        if last is None or start > last:
            busy += end - start
            last = end
        elif end > last:
            busy += end - last
            last = end
    span = max(end for _, end in intervals) - intervals[0][0] if intervals else 0.0
    host = [k for k in ops if not k.startswith("[gpu] ")]
    device = [k for k in ops if k.startswith("[gpu] ")]
    top = sorted(host, key=lambda k: -ops[k]["self_cuda_ms"])[:TOP]
    return {
        "step_ms": step_ms,  # under the profiler: slower than the timed steps
        "gpu_busy_ms": busy / 1e3 if intervals else None,
        "gpu_span_ms": span / 1e3 if intervals else None,
        "gpu_idle_in_span_ms": (span - busy) / 1e3 if intervals else None,
        "device_events": len(intervals),
        "phases_host_ms": phases,
        "top_self_cuda": [{"op": k, **ops[k]} for k in top if ops[k]["self_cuda_ms"] > 0],
        "top_kernels": [{"op": k, **ops[k]} for k in sorted(device, key=lambda k: -ops[k]["self_cuda_ms"])[:TOP]],
        "top_self_cpu": [{"op": k, **ops[k]} for k in sorted(host, key=lambda k: -ops[k]["self_cpu_ms"])[:TOP]],
        "ops": ops,
    }


def profile_diff(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Between two profiled rows: the ops whose call counts differ, and the largest differences in self CUDA time
    (b minus a, ms)."""
    keys = sorted(set(a["ops"]) | set(b["ops"]))
    zero = {"count": 0, "self_cuda_ms": 0.0, "self_cpu_ms": 0.0}
    rows = [(k, a["ops"].get(k, zero), b["ops"].get(k, zero)) for k in keys]
    counts = [{"op": k, "count_a": x["count"], "count_b": y["count"]} for k, x, y in rows if x["count"] != y["count"]]
    cuda = sorted(rows, key=lambda r: -abs(r[2]["self_cuda_ms"] - r[1]["self_cuda_ms"]))
    cpu = sorted(rows, key=lambda r: -abs(r[2]["self_cpu_ms"] - r[1]["self_cpu_ms"]))
    return {
        "count_differences": counts,
        "self_cuda_differences": [
            {
                "op": k,
                "a_ms": x["self_cuda_ms"],
                "b_ms": y["self_cuda_ms"],
                "b_minus_a_ms": y["self_cuda_ms"] - x["self_cuda_ms"],
            }
            for k, x, y in cuda[:TOP]
            if y["self_cuda_ms"] != x["self_cuda_ms"]
        ],
        "self_cpu_differences": [
            {
                "op": k,
                "a_ms": x["self_cpu_ms"],
                "b_ms": y["self_cpu_ms"],
                "b_minus_a_ms": y["self_cpu_ms"] - x["self_cpu_ms"],
            }
            for k, x, y in cpu[:TOP]
            if y["self_cpu_ms"] != x["self_cpu_ms"]
        ],
    }


# -- one row -------------------------------------------------------------------------------------------------------


def measure(name: str, row: str, setting: Setting, phases: int, profile: bool) -> dict[str, Any]:
    """One row on a fresh model: families.py's timed steps, then the phase steps (and the profile); an exception is
    recorded, not raised."""
    result: dict[str, Any] = {"row": row}
    began = time.perf_counter()
    model: nn.Module | None = None
    batches: list = []
    try:
        with patched(row):
            model = make_model(name, setting)
            batches = make_batches(name, setting)
            result.update(prepare(name, row, model, batches[0][0], setting))
            result.update(train_steps(model, batches, setting))
            result["phases"], summary = phase_steps(model, batches, setting, phases, profile)
            if summary is not None:
                result["profile"] = summary
    except Exception as error:  # noqa: BLE001 - one row's failure (an OOM included) must not lose the others
        result["error"] = f"{type(error).__name__}: {error}"
        result["traceback"] = traceback.format_exc(limit=-6)
    finally:
        del model, batches
        gc.collect()
        free_memory()
    result["wall_s"] = time.perf_counter() - began
    return result


def combine(passes: list[dict[str, Any]]) -> dict[str, Any]:
    """A row over its passes: step time and phases the median of the passes' medians, memory from the first pass,
    each pass's own figures beside them."""
    good = [p for p in passes if "error" not in p]
    if not good:
        return {**passes[0], "passes": passes}
    out: dict[str, Any] = {k: v for k, v in good[0].items() if k not in ("phases", "profile", "wall_s")}
    out["step_ms"] = median([p["step_ms"] for p in good])
    out["step_ms_by_pass"] = [p.get("step_ms") for p in passes]
    out["activation_peak_gb_by_pass"] = [p.get("activation_peak_gb") for p in passes]
    out["phases"] = {k: median([p["phases"][k] for p in good]) for k in good[0]["phases"]}
    out["wall_s"] = sum(p["wall_s"] for p in passes)
    profiles = [p["profile"] for p in passes if "profile" in p]
    if profiles:
        out["profile"] = profiles[0]
    errors = [p["error"] for p in passes if "error" in p]
    if errors:
        out["errors_in_some_passes"] = errors
    return out


def versus_switch(rows: dict[str, dict[str, Any]]) -> None:
    """Each row's step time against the family switch's, in place."""
    switch = rows.get("family_switch", {}).get("step_ms")
    for row in rows.values():
        if switch and "step_ms" in row:
            row["vs_switch_pct"] = 100 * (row["step_ms"] / switch - 1)


# -- output --------------------------------------------------------------------------------------------------------


def _gb(gb: float) -> str:
    return f"{gb:7.3f} GB" if gb >= 0.1 else f"{gb * 1e3:7.3f} MB"  # the smoke run's figures are small


def line(row: dict[str, Any], label: str = "") -> str:
    if "error" in row:
        return f"{row['row']:<32}{label} ERROR {row['error'][:150]}"
    text = f"{row['row']:<32}{label} {row['step_ms']:8.1f} ms {_gb(row['activation_peak_gb'])}"
    if "time_cost_pct" in row:
        text += f"  vs plain {row['time_cost_pct']:+6.1f} %"
    if "vs_switch_pct" in row:
        text += f"  vs switch {row['vs_switch_pct']:+6.1f} %"
    ph = row.get("phases")
    if ph:
        text += (
            f"  fwd {ph['forward_gpu_ms']:6.1f}/{ph['forward_host_ms']:6.1f}"
            f"  bwd {ph['backward_gpu_ms']:6.1f}/{ph['backward_host_ms']:6.1f}"
            f"  opt {ph['optimizer_gpu_ms']:5.1f}/{ph['optimizer_host_ms']:5.1f}"
        )
    if "step_ms_by_pass" in row and len(row["step_ms_by_pass"]) > 1:
        text += "  passes " + " ".join("-" if v is None else f"{v:.1f}" for v in row["step_ms_by_pass"])
    return text


def print_profile(row: str, summary: dict[str, Any]) -> None:
    if "error" in summary:
        print(f"-- profile {row}: ERROR {summary['error'][:200]}")
        return
    busy = summary["gpu_busy_ms"]
    gpu = (
        f"GPU busy {busy:.1f} ms of a {summary['gpu_span_ms']:.1f} ms span ({summary['gpu_idle_in_span_ms']:.1f} ms"
        f" idle), {summary['device_events']} kernels/copies/sets"
        if busy is not None
        else "no GPU events"
    )
    hosts = ", ".join(f"{k} {v:.1f}" for k, v in summary["phases_host_ms"].items())
    print(f"-- profile {row}: profiled step {summary['step_ms']:.1f} ms; {gpu}; host ms by phase: {hosts}")
    tables = (
        ("ops by self CUDA", "top_self_cuda"),
        ("GPU kernels", "top_kernels"),
        ("ops by self CPU", "top_self_cpu"),
    )
    for title, key in [(title, key) for title, key in tables if summary[key]]:  # no GPU tables on the CPU
        print(f"   {f'top {TOP} {title} time':<80} {'count':>6} {'self CUDA ms':>12} {'self CPU ms':>12}")
        for op in summary[key]:
            print(f"   {op['op'][:80]:<80} {op['count']:6d} {op['self_cuda_ms']:12.3f} {op['self_cpu_ms']:12.3f}")


def print_diff(a: str, b: str, diff: dict[str, Any]) -> None:
    print(f"-- profile {b} minus {a}")
    counts = diff["count_differences"]
    print(f"   ops with different call counts: {len(counts)}")
    for op in counts[:TOP]:
        print(f"   {op['op'][:80]:<80} {op['count_a']:6d} -> {op['count_b']:6d}")
    for title, key in (("self CUDA", "self_cuda_differences"), ("self CPU", "self_cpu_differences")):
        print(f"   largest differences in {title} time (ms): {a} -> {b}")
        for op in diff[key]:
            print(f"   {op['op'][:80]:<80} {op['a_ms']:9.3f} -> {op['b_ms']:9.3f} ({op['b_minus_a_ms']:+.3f})")


def timm_checkpointing() -> dict[str, Any]:
    """What timm's switch passes to ``torch.utils.checkpoint`` in this install."""
    import timm
    from timm.models import _manipulate

    parameters = inspect.signature(_manipulate.checkpoint_seq).parameters
    use = getattr(getattr(timm, "layers", None), "use_reentrant_ckpt", None)
    try:
        source = inspect.getsource(_manipulate.checkpoint_seq)
    except (OSError, TypeError):  # no source installed
        source = ""
    start, depth, end = source.find("torch.utils.checkpoint.checkpoint("), 0, len(source)
    for i in range(max(start, 0), len(source)):  # the call, to its closing parenthesis
        depth += {"(": 1, ")": -1}.get(source[i], 0)
        if depth == 0 and source[i] == ")":
            end = i + 1
            break
    return {
        "timm": timm.__version__,
        "checkpoint_seq_parameters": list(parameters),
        "use_reentrant": use() if use is not None else None,  # None: not passed, torch's default
        "TIMM_REENTRANT_CKPT": os.environ.get("TIMM_REENTRANT_CKPT"),
        "preserve_rng_state": (
            parameters["preserve_rng_state"].default if "preserve_rng_state" in parameters else "not passed: True"
        ),
        "checkpoint_call": " ".join(source[start:end].split())[:300] if start >= 0 else None,
    }


def _cpu_name() -> str | None:
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as f:
        for text in f:
            if text.startswith("model name"):
                return text.split(":", 1)[1].strip()
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/checkpoint_overhead.json")
    parser.add_argument("--model", default="convnext_tiny", choices=sorted(MODELS))
    parser.add_argument(
        "--rows", default=None, help="comma-separated, from: " + ", ".join(ROWS) + "; default: the model's rows"
    )
    parser.add_argument("--warmup", type=int, default=None, help="default: 5 (smoke: 1)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per row; default: 15 (smoke: 2)")
    parser.add_argument("--phase-steps", type=int, default=None, help="steps timed by phase; default: 5 (smoke: 1)")
    parser.add_argument("--passes", type=int, default=None, help="passes over the rows, each reversing the order")
    parser.add_argument("--profile", action="store_true", help="profile one step of --profile-rows")
    parser.add_argument("--profile-rows", default=",".join(PROFILED))
    parser.add_argument("--smoke", action="store_true", help="a tiny CPU version: every row runs, nothing measured")
    args = parser.parse_args()
    vision = MODELS[args.model] in families.VISION
    taken = [r for r in ROWS if r not in (FUSED_ROWS if vision else WRAPPER_CALLS)]  # the rows this model takes
    rows = [r for r in args.rows.split(",") if r] if args.rows is not None else taken
    profiled = [r for r in args.profile_rows.split(",") if r] if args.profile else []
    unknown = [r for r in rows + profiled if r not in ROWS]
    if unknown:
        parser.error(f"unknown row: {unknown}")
    setting = Setting.make(args.smoke)
    setting = setting._replace(
        warmup=setting.warmup if args.warmup is None else args.warmup,
        steps=setting.steps if args.steps is None else args.steps,
    )
    phases = args.phase_steps if args.phase_steps is not None else (1 if args.smoke else 5)
    passes = args.passes if args.passes is not None else (1 if args.smoke else 2)
    if args.smoke:
        torch.set_num_threads(1)  # tiny models: threads only wait on each other, and on a shared machine far longer
    else:
        if not torch.cuda.is_available():
            parser.error("needs a CUDA device (or --smoke)")
        torch.backends.cudnn.benchmark = True  # as families.py
    name = MODELS[args.model]
    env = environment()
    env.update(
        cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        cpu=_cpu_name(),
        cpu_count=os.cpu_count(),
    )
    result: dict[str, Any] = {
        "environment": env,
        "timm_checkpointing": timm_checkpointing() if name in families.VISION else None,
        "config": vars(args),
        "setting": families._plain(setting),
        "model": name,
        "timm_model": families.VISION[name][1 if args.smoke else 0] if name in families.VISION else None,
        "rows_described": {r: ROWS[r] for r in rows},
    }
    if name in families.VISION:
        env["timm"] = result["timm_checkpointing"]["timm"]
    else:
        import transformers

        env["transformers"] = transformers.__version__
    by_pass: dict[str, list[dict[str, Any]]] = {r: [] for r in rows}
    result["rows"] = combined = {}  # type: ignore[var-annotated]
    for p in range(passes):
        for row in rows if p % 2 == 0 else rows[::-1]:
            measured = measure(name, row, setting, phases, profile=row in profiled and p == 0)
            by_pass[row].append(measured)
            print(line(measured, f" [pass {p + 1}]"), flush=True)
            combined.update({r: combine(v) for r, v in by_pass.items() if v})
            compare(combined)
            versus_switch(combined)
            with contextlib.redirect_stdout(io.StringIO()):  # after every row: a run cut short keeps what it measured
                write_json(args.out, result)
    summaries = {r: combined[r]["profile"] for r in profiled if "profile" in combined.get(r, {})}
    usable = [r for r, summary in summaries.items() if "error" not in summary]
    if len(usable) >= 2:
        a, b = usable[:2]
        result["profile_diff"] = {"a": a, "b": b, **profile_diff(summaries[a], summaries[b])}
    call = result["timm_checkpointing"]["checkpoint_call"] if result["timm_checkpointing"] else "(Hugging Face's)"
    print(f"== {result['timm_model'] or name} ({'smoke, ' if args.smoke else ''}{passes} pass(es)); the switch's"
          f" checkpoint call: {call}")  # fmt: skip
    print(f"{'row':<32} {'step':>11} {'activation':>10}  (phases: GPU ms / host ms to return)")
    for row in rows:
        print(line(combined[row]), flush=True)
    for row, summary in summaries.items():
        print_profile(row, summary)
    if "profile_diff" in result:
        print_diff(result["profile_diff"]["a"], result["profile_diff"]["b"], result["profile_diff"])
    finite = all(math.isfinite(r.get("step_ms", math.nan)) for r in combined.values())
    result["all_rows_finite"] = finite
    write_json(args.out, result)


if __name__ == "__main__":
    main()
