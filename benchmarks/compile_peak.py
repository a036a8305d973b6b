"""What is alive at the peak of one training step, eager against compiled, with every block checkpointed.

Under ``torch.compile`` ResNet50 with every block checkpointed peaks 1.3-1.5 GB above the same model in eager mode
(``benchmarks/results/compile.json``), although on the CPU the compiled graph saves the same tensors as eager
checkpointing does. This script finds where the difference lives, and whether leaving the stem alone or joining
each stage into one checkpoint changes it, on a CUDA machine (about 8 minutes):

    python benchmarks/compile_peak.py --out OUT/compile_peak.json

For each configuration it records one forward and backward with PyTorch's allocator history
(``torch.cuda.memory._record_memory_history`` and ``_snapshot``, private to PyTorch and used only here), finds the
moment of the highest allocated total, and splits what is alive then into what the forward allocated (the saved
tensors and the output) and what the backward allocated (recomputation, gradients), grouped by the line that
allocated it: the user's or this library's Python, or the line of Inductor's generated code (which names the
buffer and its kernel). The history keeps Python stacks only: allocations made by autograd's own C++ thread in an
eager backward have none, and are grouped as "(no Python frame)"; a compiled backward runs Inductor's Python, whose
lines are named.

ResNet50, batch 256 (``--batch``), bf16 autocast, channels_last, as ``benchmarks/compile.py``; ``--train`` ends each
step with an SGD step with momentum, as training does, and the measured and recorded steps include it;
``--configurations a,b`` runs only those. Besides the hand-made graph breaks, the configurations include this
library's own graph per stage (``checkpoint_resnet(model, compile=True)``) and that split moved from the stages to
their blocks (in the first stage, or in all). ``--smoke`` checks the script on the CPU (no allocator history there:
it only runs the steps).
"""

from __future__ import annotations

import argparse
import json
import linecache
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torchvision
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import environment, free_memory, write_json  # noqa: E402

from lightning_memguard.checkpointing import apply_plan, checkpoint_resnet  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def _where(frames: list[dict[str, Any]]) -> str:
    """The allocating line: the first frame outside torch's own Python (Inductor's generated code counts as
    outside), with its source text."""
    for frame in frames:
        name = frame.get("filename", "")
        if name.endswith(".py") and not name.startswith(TORCH_DIR):
            text = linecache.getline(name, frame.get("line", 0)).strip()
            return f"{os.path.basename(name)}:{frame.get('line')} {frame.get('name', '?')}: {text[:100]}"
    return "(no Python frame)"


def peak_breakdown(trace: list[dict[str, Any]], backward_from: int, top: int = 15) -> dict[str, Any]:
    """The highest allocated total over ``trace`` (the allocator's events for one device) and what was alive then:
    bytes by phase (forward: events before ``backward_from``) and by allocating line."""
    live: dict[int, tuple[int, int, str]] = {}  # addr -> (size, event index, where)
    total = peak = 0
    at_peak: dict[int, tuple[int, int, str]] = {}
    peak_index = 0
    for i, event in enumerate(trace):
        action = event.get("action")
        if action == "alloc":
            live[event["addr"]] = (event["size"], i, _where(event.get("frames", [])))
            total += event["size"]
            if total > peak:
                peak, peak_index, at_peak = total, i, dict(live)
        elif action == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])[0]
    by_phase = {"forward": 0, "backward": 0}
    by_line: dict[str, int] = defaultdict(int)
    for size, index, where in at_peak.values():
        phase = "forward" if index < backward_from else "backward"
        by_phase[phase] += size
        by_line[f"{phase} | {where}"] += size
    lines = sorted(by_line.items(), key=lambda kv: -kv[1])[:top]
    return {
        "peak_bytes_in_step": peak,
        "peak_event": peak_index,
        "peak_in": "forward" if peak_index < backward_from else "backward",
        "alive_at_peak_by_phase": by_phase,
        "alive_at_peak_by_line": [{"where": where, "bytes": size} for where, size in lines],
    }


def one_step(
    model: nn.Module, forward: Callable, x: torch.Tensor, y: torch.Tensor, out: str, train: bool = False
) -> dict[str, Any]:
    """Three untimed steps (compiling), ten timed forward and backward passes (CUDA events, median), then one
    recorded forward and backward. ``train``: each step ends with an SGD step with momentum, as training does,
    and the measured and recorded steps include it."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9) if train else None

    def update() -> None:
        if opt is not None:
            opt.step()

    def step() -> None:
        model.zero_grad(set_to_none=True)
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=CUDA):
            nn.functional.cross_entropy(forward(x), y).backward()
        update()

    for _ in range(3):
        step()
    model.zero_grad(set_to_none=True)
    if not CUDA:
        write_json(out, {})
        return {}
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    model.zero_grad(set_to_none=True)
    img_s = round(x.shape[0] / sorted(times)[len(times) // 2] * 1e3, 1)
    free_memory()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        loss = nn.functional.cross_entropy(forward(x), y)
    torch.cuda.synchronize()
    result: dict[str, Any] = {
        "allocated_before_bytes": before,
        "saved_after_forward_bytes": torch.cuda.memory_allocated() - before,  # left for the backward (and the loss)
        "forward_peak_bytes": torch.cuda.max_memory_allocated() - before,
    }
    loss.backward()
    update()
    torch.cuda.synchronize()
    result["step_peak_bytes"] = torch.cuda.max_memory_allocated() - before
    result["img_s_forward_backward"] = img_s  # with the optimizer step where ``train``; for comparisons only
    del loss
    model.zero_grad(set_to_none=True)
    free_memory()
    write_json(out, result)  # kept if the recorded step below fails
    # the same step again with the allocator's history (alloc events with their Python stacks)
    torch.cuda.memory._record_memory_history(context="alloc", stacks="python", max_entries=2_000_000)
    try:
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(forward(x), y)
        torch.cuda.synchronize()
        backward_from = len(torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()])
        loss.backward()
        update()
        torch.cuda.synchronize()
        trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    result.update(peak_breakdown(trace, backward_from))
    return result


STAGES = ("layer1", "layer2", "layer3", "layer4")


def _blocks(model: nn.Module, stage: str) -> list[str]:
    return [f"{stage}.{i}" for i in range(len(getattr(model, stage)))]


def _break_before(modules: list[nn.Module]) -> None:
    """A Dynamo graph break before each of ``modules``: the model compiles into several graphs, each with its own
    backward, so the backward of one cannot hold another's recomputation."""
    for module in modules:
        module.register_forward_pre_hook(lambda _module, _args: torch._dynamo.graph_break())


def _every_block_breaking(per: str) -> Callable[[nn.Module], Any]:
    def checkpoint(model: nn.Module) -> None:
        checkpoint_resnet(model)
        stages = [getattr(model, s) for s in STAGES]
        _break_before(stages if per == "stage" else [block for stage in stages for block in stage])

    return checkpoint


def _split_per_block(stages: tuple[str, ...]) -> Callable[[nn.Module], Any]:
    """This library's graph per stage, but each block of ``stages`` a graph of its own (GraphSplit moved from the
    stage to its blocks; made with surgery's own helpers, private to the library and used only here)."""
    from lightning_memguard.checkpointing import surgery
    from lightning_memguard.checkpointing.wrap import GraphSplit, Swap

    def checkpoint(model: nn.Module) -> None:
        checkpoint_resnet(model, compile=True)
        swaps: list[Any] = []
        for stage in stages:
            surgery._take_off(getattr(model, stage), (GraphSplit,))
            for name in _blocks(model, stage):
                surgery._give(Swap(model.get_submodule(name), GraphSplit, {"memguard_split": name}), swaps)

    return checkpoint


CONFIGURATIONS: list[tuple[str, bool, Callable[[nn.Module], Any]]] = [
    ("eager_every_block", False, checkpoint_resnet),  # every block and the stem, each its own checkpoint
    ("compiled_every_block", True, checkpoint_resnet),
    # this library's split under compile: a graph per stage through wrap.GraphSplit
    ("compiled_every_block_split", True, lambda m: checkpoint_resnet(m, compile=True)),
    ("compiled_every_block_split_layer1_per_block", True, _split_per_block(("layer1",))),
    ("compiled_every_block_split_per_block", True, _split_per_block(STAGES)),
    ("compiled_every_block_graph_break_per_stage", True, _every_block_breaking("stage")),
    ("compiled_every_block_graph_break_per_block", True, _every_block_breaking("block")),
    # the budgets' plans under compile left the stem out: each residual block its own checkpoint
    ("compiled_every_block_but_the_stem", True, lambda m: apply_plan(m, [[b] for s in STAGES for b in _blocks(m, s)])),
    # each stage's blocks as one checkpoint: fewer block outputs kept, more brought back at once
    ("compiled_one_run_per_stage", True, lambda m: apply_plan(m, [_blocks(m, s) for s in STAGES])),
]


def _run_one(name: str, smoke: bool, out: str, batch: int, train: bool) -> dict[str, Any]:
    compiled, checkpoint = next((c, f) for n, c, f in CONFIGURATIONS if n == name)
    arch, image, batch = ("resnet18", 32, 4) if smoke else ("resnet50", 224, batch)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(batch, 3, image, image, device=DEVICE, generator=gen).to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (batch,), device=DEVICE, generator=gen)
    torch.manual_seed(0)
    model = getattr(torchvision.models, arch)(num_classes=1000).to(DEVICE).to(memory_format=torch.channels_last)
    checkpoint(model)
    forward = torch.compile(model, backend="aot_eager" if smoke else "inductor") if compiled else model
    return one_step(model, forward, x, y, out, train=train)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/compile_peak.json")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--train", action="store_true", help="each step with an SGD step, as in training")
    parser.add_argument("--configurations", help="comma-separated names (default: all)")
    parser.add_argument("--only", help="one configuration, in this process (the default runs each in its own)")
    args = parser.parse_args()
    smoke = args.smoke or not CUDA
    if args.only:
        write_json(args.out, _run_one(args.only, smoke, args.out, args.batch, args.train))
        return
    names = [n for n, _, _ in CONFIGURATIONS]
    chosen = args.configurations.split(",") if args.configurations else names
    unknown = sorted(set(chosen) - set(names))
    if unknown:
        parser.error(f"unknown configurations {unknown}; known: {names}")
    # each configuration in a process of its own: a fresh allocator and Dynamo, and one failing costs only itself
    rows: dict[str, Any] = {}
    for name in chosen:
        with tempfile.TemporaryDirectory() as tmp:
            row_file = os.path.join(tmp, "row.json")
            command = [sys.executable, os.path.abspath(__file__), "--only", name, "--out", row_file]
            command += ["--batch", str(args.batch)] + (["--train"] if args.train else [])
            done = subprocess.run(command + (["--smoke"] if smoke else []), capture_output=True, text=True)
            rows[name] = {}
            if os.path.exists(row_file):
                with open(row_file, encoding="utf-8") as f:
                    rows[name] = json.load(f)
            if done.returncode != 0:
                rows[name]["error"] = done.stderr.strip().splitlines()[-3:]
        print(name, {k: v for k, v in rows[name].items() if k != "alive_at_peak_by_line"}, flush=True)
        for line in rows[name].get("alive_at_peak_by_line", [])[:8]:
            print(f"    {line['bytes'] / 1e9:6.2f} GB  {line['where']}", flush=True)
        write_json(
            args.out,
            {"environment": environment(), "batch": 4 if smoke else args.batch, "train": args.train, "rows": rows},
        )


if __name__ == "__main__":
    main()
