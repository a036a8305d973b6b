"""torch.compile on a real GPU: what the measured choices and the checkpointing do where the model is compiled.
Run on a CUDA machine (each compile of ResNet50 takes about 45-50 s with a cold Inductor cache; a budget takes 1-6
minutes, planning included, so split them over calls of the device):

    python benchmarks/compile.py --part frontier --out OUT/compile_frontier.json
    python benchmarks/compile.py --part tuner --out OUT/compile_tuner.json
    python benchmarks/compile.py --part budgets --out OUT/compile_budgets.json  # --budgets 0.6,0.5 for a part
    python benchmarks/compile.py --merge OUT/compile_frontier.json OUT/compile_tuner.json OUT/compile_budgets.json \
        --out benchmarks/results/compile.json

(``bash benchmarks/run_gpu.sh OUT compile_frontier``, ``... compile_tuner`` and ``BUDGETS=0.6 ... compile_budgets``
run the parts.)

ResNet50, bf16 autocast, channels_last, SGD with momentum, random data on the device.

- ``frontier``: a plain loop at batch 256, 5 warm-up steps (compiling ones among them) and 25 timed steps (CUDA
  events, median), peak ``torch.cuda.max_memory_allocated()`` over the timed steps: eager; eager with this
  library's ``rebuild_bn_relu``, every block checkpointed, and ``checkpoint_sequential`` in 4 segments; compiled
  (inductor, default) as it is, at ``torch._functorch.config.activation_memory_budget`` 0.8, 0.5, 0.4 and 0.25, with
  every block checkpointed by this library, and with the rebuild (which stands aside under compile). Each
  compiled row starts from a fresh Dynamo cache and reports its warm-up (compile) time.
- ``budgets``: this library's plan under compile (``checkpoint_resnet(..., memory_budget=f, compile=...)``) at
  each fraction, then the model trained compiled under the plan's setting: the one-pass peak against the budget,
  and throughput as in ``frontier``; also the planning time and every combination the plan measured. The default
  fractions are the issue's 0.6, 0.5, 0.4 and 0.35, and 0.65 and 0.56, where compile's own 0.8 and 0.5 fit alone.
- ``--merge`` also writes ``savings_goal``: at each saving of eager mode's train peak from 40 % to 57 %, the fastest
  budget row that saves as much against the fastest of compile's own settings that does (see :func:`savings_goal`).
- ``tuner``: a Lightning Trainer. BatchSizeTuner over 128..1024 on ``torch.compile(model)``, then 5 + 15 steps of
  training at its choice (StepTimer, median); the oracle: each size compiled on its own, static
  (``dynamic=False``), trained and timed the same way; and the tuner's search time on the eager model beside it.

Compile and planning times depend on Inductor's on-disk cache: a second run on the same machine finds the graphs
it compiled before. ``--smoke`` runs a tiny version on the CPU (resnet18 at 32 px, ``backend="aot_eager"``) to
check the script.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torchvision
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import environment, free_memory, make_trainer, median, sequential_forward, write_json  # noqa: E402

from lightning_memguard import BatchSizeTuner, checkpoint_resnet  # noqa: E402
from lightning_memguard.checkpointing import apply_plan, remove_checkpointing  # noqa: E402
from lightning_memguard.testing import ImageClassifier, StepTimer  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


class Setup:
    def __init__(self, smoke: bool) -> None:
        self.arch = "resnet18" if smoke else "resnet50"
        self.image = 32 if smoke else 224
        self.batch = 8 if smoke else 256
        self.warmup, self.timed = (2, 3) if smoke else (5, 25)
        self.backend = "aot_eager" if smoke else "inductor"
        self.sizes = [2, 4, 8] if smoke else [128, 256, 512, 1024]
        self.tuner_steps = (2, 3) if smoke else (5, 15)


def make_model(cfg: Setup, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = getattr(torchvision.models, cfg.arch)(num_classes=1000).to(DEVICE)
    return model.to(memory_format=torch.channels_last)


def _now() -> Any:
    if CUDA:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def _ms(a: Any, b: Any) -> float:
    return a.elapsed_time(b) if CUDA else (b - a) * 1e3


def train_steps(model: nn.Module, forward: Callable, cfg: Setup) -> dict[str, Any]:
    """Warm-up steps (their wall time is the compile time where there is one), then timed steps."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model.train()
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    batches = [
        (
            torch.randn(cfg.batch, 3, cfg.image, cfg.image, device=DEVICE, generator=gen).to(
                memory_format=torch.channels_last
            ),
            torch.randint(0, 1000, (cfg.batch,), device=DEVICE, generator=gen),
        )
        for _ in range(2)
    ]
    free_memory()
    started = time.perf_counter()
    marks: list[Any] = []
    for i in range(cfg.warmup + cfg.timed):
        if i == cfg.warmup:
            if CUDA:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            warmup_s = time.perf_counter() - started
        x, y = batches[i % 2]
        if i >= cfg.warmup:
            marks.append(_now())
        opt.zero_grad(set_to_none=True)
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=CUDA):
            loss = nn.functional.cross_entropy(forward(x), y)
        loss.backward()
        opt.step()
    marks.append(_now())
    if CUDA:
        torch.cuda.synchronize()
    step_ms = median([_ms(a, b) for a, b in zip(marks[:-1], marks[1:], strict=True)])
    peak = torch.cuda.max_memory_allocated() if CUDA else None
    return {
        "step_ms": round(step_ms, 3),
        "img_s": round(cfg.batch / step_ms * 1e3, 1),
        "peak_bytes": peak,
        "warmup_s": round(warmup_s, 2),
    }


def _one_graph(model: nn.Module) -> None:
    """Every block checkpointed, the whole model one compiled graph (no graph per stage)."""
    plan = checkpoint_resnet(model, compile=True)
    remove_checkpointing(model)
    apply_plan(model, plan.runs)


def frontier(cfg: Setup, only: set[str] | None = None) -> dict[str, Any]:
    """The table's rows (``only``: these and the eager and compiled baselines, which the ratios need)."""
    rows: list[dict[str, Any]] = []

    def row(name: str, compiled: bool, prepare: Callable[[nn.Module], Any] | None = None, **extra: Any) -> None:
        if only is not None and name not in only | {"eager", "compile"}:
            return
        torch._dynamo.reset()
        model = make_model(cfg)
        forward = prepare(model) if prepare is not None else None
        forward = forward or model
        if compiled:
            forward = torch.compile(forward, backend=cfg.backend)
        budget = extra.get("activation_memory_budget")
        patch = torch._functorch.config.patch(activation_memory_budget=budget) if budget is not None else None
        if patch is not None:
            with patch:
                result = train_steps(model, forward, cfg)
        else:
            result = train_steps(model, forward, cfg)
        rows.append({"setting": name, "compiled": compiled, **extra, **result})
        print(json.dumps(rows[-1]), flush=True)
        del model, forward

    row("eager", False)
    row("eager_rebuild_bn_relu", False, lambda m: checkpoint_resnet(m, rebuild_bn_relu=True) and None)
    row("eager_every_block", False, lambda m: checkpoint_resnet(m) and None)
    row("eager_checkpoint_sequential_4", False, sequential_forward)
    row("compile", True)
    for budget in (0.8, 0.5, 0.4, 0.25):
        row(f"compile_activation_memory_budget_{budget}", True, activation_memory_budget=budget)
    row("compile_every_block", True, lambda m: checkpoint_resnet(m, compile=True) and None)  # a graph per stage
    row("compile_every_block_one_graph", True, _one_graph)
    row("compile_rebuild_bn_relu", True, lambda m: checkpoint_resnet(m, rebuild_bn_relu=True) and None)
    eager = rows[0]
    for r in rows:
        if CUDA:
            r["saved_vs_eager"] = round(1 - r["peak_bytes"] / eager["peak_bytes"], 4)
        r["speed_vs_eager"] = round(r["img_s"] / eager["img_s"], 4)
    return {
        "batch": cfg.batch,
        "rows": rows,
        "compile_frontier": [
            {"setting": r["setting"], "peak_bytes": r["peak_bytes"], "img_s": r["img_s"]} for r in rows if r["compiled"]
        ],
    }


def one_pass_peak(model: nn.Module, forward: Callable, x: torch.Tensor) -> int | None:
    """What the planner measures: one forward and backward's peak above what was allocated before it."""
    if not CUDA:
        return None
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        forward(x).float().sum().backward()
    torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)
    return int(torch.cuda.max_memory_allocated() - before)


def _example(cfg: Setup) -> torch.Tensor:
    """The batch a plan is measured on (the same one each call)."""
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    x = torch.randn(cfg.batch, 3, cfg.image, cfg.image, device=DEVICE, generator=gen)
    return x.to(memory_format=torch.channels_last)


def budgets(cfg: Setup, fractions: list[float], checkpoint: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Ours under compile: plan with ``compile=True`` at each budget, then train compiled under the plan's setting.
    ``checkpoint`` gets the rows so far after each budget (a long run cut short keeps what it measured)."""
    rows: list[dict[str, Any]] = []
    options = {"backend": cfg.backend}
    for fraction in fractions:
        torch._dynamo.reset()
        free_memory()
        model = make_model(cfg)
        started = time.perf_counter()
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=CUDA):
            plan = checkpoint_resnet(model, memory_budget=fraction, example_input=_example(cfg), compile=options)
        plan_s = time.perf_counter() - started
        torch._dynamo.reset()
        with plan.compiling():  # no planning batch alive: the train peak counts what frontier's rows count
            forward = torch.compile(model, **options)
            trained = train_steps(model, forward, cfg)
            peak = one_pass_peak(model, forward, _example(cfg))
        rows.append(
            {
                "fraction": fraction,
                "budget_bytes": plan.budget_bytes,
                "baseline_bytes": plan.baseline_bytes,
                "planned_peak_bytes": plan.measured_bytes,
                "measured_peak_bytes": peak,
                "held": None if peak is None else peak <= plan.budget_bytes,  # type: ignore[operator]
                "blocks": plan.blocks,
                "activation_memory_budget": plan.activation_memory_budget,
                "candidates": plan.compile_candidates,
                "plan_s": round(plan_s, 1),
                "img_s": trained["img_s"],
                "train_peak_bytes": trained["peak_bytes"],
                "environment": environment(),  # budgets are merged from several calls: each keeps its own
            }
        )
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "candidates"}), flush=True)
        checkpoint({"budgets": rows})
        del model, forward
    return {"budgets": rows}


def _lightning_model(cfg: Setup, batch: int, steps: int) -> ImageClassifier:
    return ImageClassifier(
        cfg.arch, num_classes=1000, image_size=cfg.image, batch_size=batch, steps_per_epoch=steps, pool_size=64,
        channels_last=True,
    )  # fmt: skip


def _train(cfg: Setup, module: Any, callbacks: list[Any], root: str) -> tuple[float, float]:
    """Samples/s of the timed steps at the module's batch size, and the fit's wall time."""
    warmup, timed = cfg.tuner_steps
    timer = StepTimer(skip=warmup)
    trainer = make_trainer([*callbacks, timer], warmup + timed, root)
    started = time.perf_counter()
    trainer.fit(module)
    wall = time.perf_counter() - started
    lightning_module = trainer.lightning_module
    return lightning_module.batch_size / median(timer.step_ms()) * 1e3, wall


def tuner(cfg: Setup, root: str) -> dict[str, Any]:
    warmup, timed = cfg.tuner_steps
    steps = warmup + timed + 4

    def tuned(compiled: bool) -> dict[str, Any]:
        torch._dynamo.reset()
        free_memory()
        tuner = BatchSizeTuner(init_size=cfg.sizes[0], max_size=cfg.sizes[-1], cache=False)
        module = _lightning_model(cfg, cfg.sizes[0], steps)
        img_s, wall = _train(cfg, torch.compile(module, backend=cfg.backend) if compiled else module, [tuner], root)
        return {
            "choice": tuner.batch_size,
            "choice_img_s": round(img_s, 1),
            "search_s": tuner.search_s,
            "compile_s": tuner.compile_s,
            "fit_s": round(wall, 1),
            "results": [r.to_dict() for r in tuner.results],
        }

    # first: as for a user's first run, unless Inductor's on-disk cache holds these graphs from an earlier run on
    # this machine (compile times then shrink; the step times do not change)
    compiled = tuned(True)
    print(json.dumps(compiled), flush=True)
    oracle = []  # the same static graphs, each size on its own (Inductor's cache may serve the compiled code)
    for size in cfg.sizes:
        torch._dynamo.reset()
        free_memory()
        img_s, wall = _train(
            cfg, torch.compile(_lightning_model(cfg, size, steps), backend=cfg.backend, dynamic=False), [], root
        )
        oracle.append({"size": size, "img_s": round(img_s, 1), "fit_s": round(wall, 1)})
        print(json.dumps(oracle[-1]), flush=True)
    best = max(oracle, key=lambda r: r["img_s"])
    eager = tuned(False)
    print(json.dumps(eager), flush=True)
    return {
        "tuner": {
            **{k: compiled[k] for k in ("choice", "choice_img_s", "search_s", "compile_s")},
            "oracle_best": best["size"],
            "oracle_img_s": best["img_s"],
            "choice_vs_oracle": round(compiled["choice_img_s"] / best["img_s"], 4),
            "trials": compiled["results"],
        },
        "oracle": oracle,
        "eager_tuner": eager,
    }


def savings_goal(
    frontier_rows: list[dict[str, Any]], budget_rows: list[dict[str, Any]], low: float = 0.40, high: float = 0.57
) -> dict[str, Any]:
    """Issue 14's goal, checked exactly: at every saving ``s`` of eager mode's train peak in [low, high], the fastest
    of our budget plans (trained) that saves at least ``s`` is at least as fast as the fastest of compile's own
    settings (compile alone, or with an ``activation_memory_budget``) that saves at least ``s``, where there is one.
    Between two rows' savings neither side changes, so the savings checked are the ends and each row's own saving
    and the one just past it. ``shortfalls`` lists each saving checked where ours is slower."""
    eager = next(r["peak_bytes"] for r in frontier_rows if r["setting"] == "eager")
    theirs = [
        (1 - r["peak_bytes"] / eager, r["img_s"], r["setting"])
        for r in frontier_rows
        if r["setting"] == "compile" or r["setting"].startswith("compile_activation_memory_budget")
    ]
    ours = [(1 - r["train_peak_bytes"] / eager, r["img_s"], r["fraction"]) for r in budget_rows]

    def fastest(rows: list[tuple[float, float, Any]], saving: float) -> tuple[float, float, Any] | None:
        return max((r for r in rows if r[0] >= saving), key=lambda r: r[1], default=None)

    savings = {low, high, *(x for r in theirs + ours for x in (r[0], r[0] + 1e-9) if low <= x <= high)}
    points, shortfalls = [], []
    for saving in sorted(savings):
        best, mine = fastest(theirs, saving), fastest(ours, saving)
        point = {
            "saving": round(saving, 5),
            "compile": None if best is None else {"setting": best[2], "img_s": best[1]},
            "ours": None if mine is None else {"fraction": mine[2], "img_s": mine[1]},
        }
        points.append(point)
        if best is not None and (mine is None or mine[1] < best[1]):
            shortfalls.append(point)
    return {"range": [low, high], "eager_peak_bytes": eager, "points": points, "shortfalls": shortfalls}


def merge(paths: list[str]) -> dict[str, Any]:
    """The parts in one file; budgets measured over several calls are kept together, by fraction (a later
    measurement of the same fraction replaces an earlier one)."""
    merged: dict[str, Any] = {}
    rows: dict[float, dict[str, Any]] = {}
    for path in paths:
        with open(path, encoding="utf-8") as f:
            part = json.load(f)
        rows.update({row["fraction"]: row for row in part.pop("budgets", [])})
        merged.update(part)
    if rows:
        merged["budgets"] = [rows[f] for f in sorted(rows, reverse=True)]
        if isinstance(merged.get("frontier"), dict):
            merged["savings_goal"] = savings_goal(merged["frontier"]["rows"], merged["budgets"])
    return merged


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--part", choices=("frontier", "tuner", "budgets", "all"), default="all")
    parser.add_argument("--budgets", default="0.65,0.6,0.56,0.5,0.4,0.35", help="fractions for --part budgets")
    parser.add_argument("--rows", default=None, help="--part frontier: only these settings (and the baselines)")
    parser.add_argument("--merge", nargs="+", default=None, help="JSON files of the parts to merge into --out")
    parser.add_argument("--out", default="benchmarks/results/compile.json")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if args.merge:
        write_json(args.out, merge(args.merge))
        return
    cfg = Setup(args.smoke or not CUDA)
    data: dict[str, Any] = {"environment": environment(), "arch": cfg.arch, "backend": cfg.backend}
    if args.part in ("frontier", "all"):
        if args.rows:  # some rows again, with their baselines: a table of their own beside the whole one
            data["frontier_rerun"] = frontier(cfg, set(args.rows.split(",")))
            data["frontier_rerun"].pop("compile_frontier")
        else:
            data["frontier"] = frontier(cfg)
            data["compile_frontier"] = data["frontier"].pop("compile_frontier")
    if args.part in ("budgets", "all"):
        fractions = [float(b) for b in args.budgets.split(",")]
        data.update(budgets(cfg, fractions, lambda part: write_json(args.out, {**data, **part})))
    if args.part in ("tuner", "all"):
        with tempfile.TemporaryDirectory() as root:
            data.update(tuner(cfg, root))
    write_json(args.out, data)


if __name__ == "__main__":
    main()
