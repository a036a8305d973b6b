"""What autocast's weight cache held inside checkpointed blocks: a step's peak with it kept and with it off.

``benchmarks/families.py``'s ``fused_loss_every_block`` row (every block checkpointed, the fused loss), on a fresh
model per measurement, twice:

- ``cache_kept``: the library as it was before the cache went off inside a checkpoint (``weight_casts_uncached``
  replaced by a null context, so autocast keeps every checkpointed block's bf16 weight copies to the forward's end);
- ``cache_off``: the library as it is.

On CUDA each of the two is measured in alternating rounds, in one process: the peak of one forward and backward of
activations alone (``families.activation_only_peak``: gradients allocated before it, no optimizer step). On the CPU
(``--cpu``, a small batch) each measurement runs in a process of its own and the peak is the process's resident set
(``ru_maxrss``) above what it held before the step, glibc's large allocations given back at once
(``MALLOC_MMAP_THRESHOLD_``). The parameters' bf16 bytes in the checkpointed blocks are what the difference can be at
most.

    python benchmarks/autocast_cache.py --models bert,gpt2,llama,t5,whisper
    python benchmarks/autocast_cache.py --cpu --models bert,gpt2,whisper \
        --out benchmarks/results/autocast_cache_cpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import families  # noqa: E402
from _common import environment, free_memory, median, write_json  # noqa: E402

from lightning_memguard.checkpointing import is_checkpointed, wrap  # noqa: E402
from lightning_memguard.levers import pointwise  # noqa: E402

TRIALS = ("cache_kept", "cache_off")
ROW = "fused_loss_every_block"


@contextlib.contextmanager
def trial(name: str) -> Any:
    """The library's checkpoints with autocast's cache kept (as before) or off (as now)."""
    if name not in TRIALS:
        raise ValueError(f"unknown trial {name!r}: one of {TRIALS}")
    uncached = wrap.weight_casts_uncached
    if name == "cache_kept":
        wrap.weight_casts_uncached = pointwise.weight_casts_uncached = contextlib.nullcontext
    try:
        yield
    finally:
        wrap.weight_casts_uncached = pointwise.weight_casts_uncached = uncached


def checkpointed_weight_bytes(model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16) -> int:
    """The bytes of the floating-point weights inside checkpointed modules, in ``dtype``: the most the cache held."""
    weights = {id(p): p for m in model.modules() if is_checkpointed(m) for p in m.parameters()}  # shared ones once
    return sum(p.numel() for p in weights.values() if p.is_floating_point() and p.requires_grad) * dtype.itemsize


def prepared(name: str, setting: families.Setting) -> tuple[torch.nn.Module, list[Any]]:
    batches = families.make_batches(name, setting, count=1)
    model = families.make_model(name, setting)
    families.apply(name, ROW, model, batches[0][0], setting)
    return model, batches


def cpu_peak(name: str, which: str, batch: int) -> dict[str, Any]:
    """One measurement on the CPU, in this process: the resident set's peak above the step's start (Linux)."""
    import resource

    setting = families.Setting(False, torch.device("cpu"), 224, batch, 1024, batch, 1, 1)
    with trial(which):
        model, batches = prepared(name, setting)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)  # allocated before the step, as activation_only_peak has them
        with open("/proc/self/statm", encoding="ascii") as f:
            resting = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        with setting.autocast():
            loss = families.loss_of(model, batches[0])
        loss.backward()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if peak <= before:  # the process's peak came before the step: the step's own is not known
        raise RuntimeError(f"{name}: the process's resident peak was reached before the step; nothing measured")
    return {"peak_above_start": peak - resting, "checkpointed_weight_bf16": checkpointed_weight_bytes(model)}


def run_cpu(models: list[str], batch: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    for name in models:
        row: dict[str, Any] = {}
        for which in TRIALS:
            done = subprocess.run(
                [sys.executable, __file__, "--one", name, which, "--batch", str(batch)],
                env=env, capture_output=True, text=True, check=True,
            )  # fmt: skip
            row[which] = json.loads(done.stdout.strip().splitlines()[-1])
        row["lower_by"] = row["cache_kept"]["peak_above_start"] - row["cache_off"]["peak_above_start"]
        out[name] = row
        print(name, row, flush=True)
    return out


def run_cuda(models: list[str], rounds: int) -> dict[str, Any]:
    setting = families.Setting.make(False)
    out: dict[str, Any] = {}
    for name in models:
        peaks: dict[str, list[float]] = {which: [] for which in TRIALS}
        weights = 0
        for i in range(rounds):
            for which in TRIALS if i % 2 == 0 else reversed(TRIALS):
                with trial(which):
                    model, batches = prepared(name, setting)
                    weights = checkpointed_weight_bytes(model)
                    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
                    for _ in range(2):  # warm-up steps: AdamW's state, the allocator's segments
                        opt.zero_grad(set_to_none=True)
                        with setting.autocast():
                            loss = families.loss_of(model, batches[0])
                        loss.backward()
                        opt.step()
                    peaks[which].append(families.activation_only_peak(model, opt, batches[0], setting) / 1e9)
                del model, opt, batches, loss
                free_memory()
        row = {which: {"activation_only_gb": median(v), "each_gb": v} for which, v in peaks.items()}
        row["lower_by_gb"] = row["cache_kept"]["activation_only_gb"] - row["cache_off"]["activation_only_gb"]
        row["checkpointed_weight_bf16_gb"] = weights / 1e9
        out[name] = row
        print(name, json.dumps(row), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="bert,gpt2,llama,t5,whisper")
    parser.add_argument("--cpu", action="store_true", help="on the CPU, each measurement in a process of its own")
    parser.add_argument("--batch", type=int, default=2, help="--cpu: sequences (or clips) per batch")
    parser.add_argument("--rounds", type=int, default=2, help="CUDA: measurements of each trial, alternating")
    parser.add_argument("--out", default="benchmarks/results/autocast_cache.json")
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "TRIAL"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        torch.set_num_threads(min(2, os.cpu_count() or 1))
        print(json.dumps(cpu_peak(args.one[0], args.one[1], args.batch)))
        return
    models = [m for m in args.models.split(",") if m]
    if unknown := [m for m in models if m not in families.FUSED]:
        parser.error(f"not a model with the fused loss: {unknown}")
    if not args.cpu and not torch.cuda.is_available():
        parser.error("needs a CUDA device (or --cpu)")
    results = run_cpu(models, args.batch) if args.cpu else run_cuda(models, args.rounds)
    config = {"models": models, "row": ROW, "cpu": args.cpu, "batch": args.batch if args.cpu else None}
    write_json(args.out, {"environment": environment(), "config": config, "models": results})


if __name__ == "__main__":
    main()
