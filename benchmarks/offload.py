"""What overlapped activation offload (``lightning_memguard.levers.offload``) costs per GB moved, and how much of it
hides behind compute. Run on a CUDA machine (about 4 minutes on an H200):

    PYTHONPATH=$PWD python3 benchmarks/offload.py --out OUT_DIR

Two models, each trained with SGD under bf16 autocast: GPT-2 small built from its config (transformers,
``GPT2Config()``: 12 layers, 768 wide) at 16 x 1024 tokens, and torchvision's ResNet50 at batch 256, 224 px,
channels_last. For each, rows on a fresh model from the same seed, in alternating rounds (the order reversed every
other round): ``plain``; ``all`` (every block offloaded); ``first_k`` (the first k blocks, k chosen so the bytes
moved are about 1, 2 and 4 GB); ``checkpointed`` (every block checkpointed whole, ``checkpoint_blocks``) and
``checkpointed_inputs`` (the same, and every block's input, the one tensor its checkpoint keeps, offloaded: the
levers' ``block_offload``), whose cost is also given against ``checkpointed`` (``cost_vs_checkpointed_pct``). Each
row: the median step time after warm-up (each step synchronized), the step's peak above its start (activations and
gradients), the bytes moved each way and the pinned host memory held.

Also: the pinned host <-> device bandwidth, each way (a 1 GiB copy); each block's forward and backward time in a
plain step (CUDA events in hooks) and the time between the last block's forward and its backward; from those, the
cost :func:`~lightning_memguard.levers.offload.exposed_transfer_ms` predicts for each row at the measured bandwidth
(against what was measured) and on a PCIe 4 x16 link (25 GB/s, the seed's card); the cost per GB moved (ms/GB) and
the hidden bytes (the most moved at no more than 3 % cost), measured and estimated for PCIe 4; and one step's
gradients with every block offloaded against the plain model's (and plain against plain, the floor).

``--profile ROW,...`` also records one step of each row named (after its warm-up, the offload entered) under
``torch.profiler`` and writes the trace (OUT_DIR/offload_trace_<model>_<row>.json, for chrome://tracing or Perfetto)
and, in the results, what it says of the copies (:func:`stream_summary`): each CUDA stream's busy time, the copies'
time each way and how much of it ran while a kernel ran on another stream, the compute stream's idle gaps, and the
host's time in the CUDA calls that can wait for the device or the driver (synchronizations, copies, pinned and device
allocations): why copies that should hide do not.

``--smoke`` runs tiny models on the CPU, the copies made at once by a stand-in for the streams: the code path, not a
measurement. Writes OUT_DIR/offload.json (default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import environment, write_json  # noqa: E402

from lightning_memguard.checkpointing import checkpoint_blocks  # noqa: E402
from lightning_memguard.levers.offload import ActivationOffload, HostCopies, exposed_transfer_ms  # noqa: E402

GB = 10**9
PCIE4_GB_S = 25.0
HIDDEN_COST = 0.03  # a cost this small counts as hidden
TARGETS_GB = (1, 2, 4)
CHECKPOINTED = ("checkpointed", "checkpointed_inputs")  # rows with every block checkpointed whole


class Workload:
    """A fresh model, its chain of blocks, and one training step on a fixed batch."""

    def __init__(self, name: str, smoke: bool, device: torch.device, checkpointed: bool = False) -> None:
        torch.manual_seed(0)
        self.name, self.device = name, device
        with torch.device(device):
            if name == "gpt2":
                from transformers import GPT2Config, GPT2LMHeadModel

                config = GPT2Config(n_layer=3, n_embd=64, n_head=2, vocab_size=512) if smoke else GPT2Config()
                self.model: nn.Module = GPT2LMHeadModel(config)
                shape = (2, 64) if smoke else (16, 1024)
                self.ids = torch.randint(0, config.vocab_size, shape)
                self.blocks = list(self.model.transformer.h)
            else:
                from torchvision.models.resnet import Bottleneck, ResNet

                depths = [1, 1, 1, 1] if smoke else [3, 4, 6, 3]  # ResNet50's, or one block a stage
                self.model = ResNet(Bottleneck, depths).to(memory_format=torch.channels_last)
                batch, px = (2, 32) if smoke else (256, 224)
                self.images = torch.randn(batch, 3, px, px).to(memory_format=torch.channels_last)
                self.labels = torch.randint(0, 1000, (batch,))
                self.blocks = [b for layer in (self.model.layer1, self.model.layer2, self.model.layer3,
                                               self.model.layer4) for b in layer]  # fmt: skip
        if checkpointed:  # every block whole: each keeps only its input for the recomputation
            checkpoint_blocks(self.model, units=[type(self.blocks[0])])
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-4)

    def loss(self) -> torch.Tensor:
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            if self.name == "gpt2":
                return self.model(input_ids=self.ids, labels=self.ids).loss
            return nn.functional.cross_entropy(self.model(self.images), self.labels)

    def step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.loss().backward()
        self.optimizer.step()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the device's cache only: the pinned host blocks stay cached for the next row


def offloader(work: Workload, offloaded: Sequence[int], smoke: bool) -> ActivationOffload:
    if smoke:
        return ActivationOffload(work.blocks, offloaded=offloaded, min_bytes=1, streams=HostCopies(),
                                 host_allocator=lambda n: torch.empty(n, dtype=torch.uint8))  # fmt: skip
    return ActivationOffload(work.blocks, offloaded=offloaded)


def timed_row(work: Workload, offload: ActivationOffload | None, warmup: int, steps: int) -> dict[str, Any]:
    """Warm-up steps, then ``steps`` steps each synchronized: the median and the step's peak above its start."""
    device = work.device
    with offload or _nothing():
        for _ in range(warmup):
            work.step()
        times, peaks = [], []
        for _ in range(steps):
            _sync(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                start_bytes = torch.cuda.memory_allocated(device)
            start = time.perf_counter()
            work.step()
            _sync(device)
            times.append((time.perf_counter() - start) * 1e3)
            if device.type == "cuda":
                peaks.append(torch.cuda.max_memory_allocated(device) - start_bytes)
        row = {
            "step_ms": statistics.median(times),
            "steps_ms": [round(t, 2) for t in times],
            "peak_above_start_gb": max(peaks) / GB if peaks else None,
        }
        if offload is not None:
            row |= {
                "moved_gb": offload.moved_bytes / GB,
                "host_gb": offload.host_bytes / GB,
                "block_bytes": offload.block_bytes,
                "dropped": offload.dropped,
            }
    return row


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def block_times(work: Workload) -> dict[str, Any]:
    """Each block's forward and backward time in a plain step (CUDA events in hooks; wall clock on the CPU), and
    the time between the last block's forward and its backward."""
    cuda = work.device.type == "cuda"

    def mark() -> Any:
        if cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def ms(a: Any, b: Any) -> float:
        return a.elapsed_time(b) if cuda else (b - a) * 1e3

    n = len(work.blocks)
    f_start: list[Any] = [None] * n
    f_end: list[Any] = [None] * n
    b_start: list[Any] = [None] * n
    hooks = []
    for i, block in enumerate(work.blocks):

        def pre(module: nn.Module, args: Any, i: int = i) -> None:
            f_start[i] = mark()

        def post(module: nn.Module, args: Any, output: Any, i: int = i) -> None:
            f_end[i] = mark()
            out = output if isinstance(output, torch.Tensor) else output[0]
            out.register_hook(lambda grad: b_start.__setitem__(i, mark()))

        hooks += [block.register_forward_pre_hook(pre), block.register_forward_hook(post)]
    for _ in range(1 if work.device.type == "cpu" else 3):
        work.optimizer.zero_grad(set_to_none=True)
        loss = work.loss()
        loss.backward()
        end = mark()
        _sync(work.device)
    for hook in hooks:
        hook.remove()
    forward = [ms(f_start[i], f_end[i]) for i in range(n)]
    backward = [ms(b_start[i], b_start[i - 1]) for i in range(1, n)]
    backward.insert(0, ms(b_start[0], end))  # block 0's backward and what runs after it (the stem, the embedding)
    return {"forward_ms": forward, "backward_ms": backward, "between_ms": ms(f_end[-1], b_start[-1])}


def bandwidth_gb_s(device: torch.device, nbytes: int) -> dict[str, float]:
    """Pinned host <-> device copies of ``nbytes``, each way: the median of five, GB/s."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    result = {}
    for way, (dst, src) in {"to_host": (host, dev), "to_device": (dev, host)}.items():
        times = []
        for _ in range(6):
            _sync(device)
            start = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            _sync(device)
            times.append(time.perf_counter() - start)
        result[way] = nbytes / statistics.median(times[1:]) / GB
    return result


WAITING_CALLS = (
    "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaStreamWaitEvent", "cudaMemcpyAsync",
    "cudaMemcpy", "cudaHostAlloc", "cudaMallocHost", "cudaFreeHost", "cudaHostRegister", "cudaMalloc", "cudaFree",
)  # fmt: skip
"""The host's CUDA calls that can wait for the device or the driver: a copy to pageable memory returns when it is done,
a pinned or device allocation or free can serialize with the device."""
IDLE_GAP_US = 50.0  # a gap between kernels on the compute stream longer than this counts as idle


def _merged(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """The time two sets of merged spans share."""
    total, j = 0.0, 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            total += min(end, b[k][1]) - max(start, b[k][0])
            k += 1
    return total


def stream_summary(events: list[dict[str, Any]]) -> dict[str, Any]:
    """What a chrome trace of one step (``torch.profiler``'s, its ``traceEvents``) says of the copies and the compute,
    in milliseconds: per CUDA stream its busy time (kernels, copies, memsets: spans merged) and kernel count; the
    compute stream (the one with the most kernel time); the copies each way (device to host, host to device) with
    their time and the part of it during which a kernel ran on the compute stream (hidden); the compute stream's
    idle gaps between its first and last kernel longer than :data:`IDLE_GAP_US`; and the host's time in each of
    :data:`WAITING_CALLS` (calls, total, longest).

    Example:
        >>> trace = [
        ...     {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 100, "args": {"stream": 7}},
        ...     {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 300, "dur": 100, "args": {"stream": 7}},
        ...     {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 50, "dur": 100,
        ...      "args": {"stream": 20}},
        ...     {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 120, "dur": 170, "args": {}},
        ... ]
        >>> summary = stream_summary(trace)
        >>> summary["compute_stream"], summary["idle_gaps_ms"], summary["copies"]["to_host"]
        (7, 0.2, {'count': 1, 'ms': 0.1, 'hidden_ms': 0.05})
        >>> summary["host_waits"]["cudaStreamSynchronize"]
        {'calls': 1, 'ms': 0.17, 'longest_ms': 0.17}
    """
    spans: dict[int, list[tuple[float, float]]] = {}
    kernels: dict[int, list[tuple[float, float]]] = {}
    copies: dict[str, list[tuple[float, float]]] = {"to_host": [], "to_device": []}
    waits: dict[str, list[float]] = {}
    for event in events:
        if event.get("ph") != "X" or "dur" not in event:
            continue
        cat, name = event.get("cat", ""), event.get("name", "")
        start, end = float(event["ts"]), float(event["ts"]) + float(event["dur"])
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            stream = int(event.get("args", {}).get("stream", -1))
            spans.setdefault(stream, []).append((start, end))
            if cat == "kernel":
                kernels.setdefault(stream, []).append((start, end))
            elif "DtoH" in name:
                copies["to_host"].append((start, end))
            elif "HtoD" in name:
                copies["to_device"].append((start, end))
        elif cat in ("cuda_runtime", "cuda_driver") and name in WAITING_CALLS:
            waits.setdefault(name, []).append(float(event["dur"]))
    compute = max(kernels, key=lambda s: sum(e - b for b, e in kernels[s]), default=None)
    busy = _merged(kernels.get(compute, [])) if compute is not None else []
    gaps = [b - a for (_, a), (b, _) in zip(busy, busy[1:], strict=False) if b - a > IDLE_GAP_US]

    def ms(us: float) -> float:
        return round(us / 1e3, 4)

    return {
        "streams": {
            str(stream): {
                "busy_ms": ms(sum(e - b for b, e in _merged(found))),
                "kernels": len(kernels.get(stream, [])),
            }
            for stream, found in sorted(spans.items())
        },
        "compute_stream": compute,
        "idle_gaps": len(gaps),
        "idle_gaps_ms": ms(sum(gaps)),
        "copies": {
            way: {
                "count": len(found),
                "ms": ms(sum(e - b for b, e in _merged(found))),
                "hidden_ms": ms(_overlap(_merged(found), busy)),
            }
            for way, found in copies.items()
        },
        "host_waits": {
            name: {"calls": len(times), "ms": ms(sum(times)), "longest_ms": ms(max(times))}
            for name, times in sorted(waits.items())
        },
    }


def profiled_step(work: Workload, offload: ActivationOffload | None, warmup: int, trace_path: str) -> dict[str, Any]:
    """One step of ``work`` under ``torch.profiler`` after ``warmup`` steps, the offload entered around all of them:
    the trace written to ``trace_path`` and :func:`stream_summary` of it."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if work.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with offload or _nothing():
        for _ in range(warmup):
            work.step()
        _sync(work.device)
        with torch.profiler.profile(activities=activities) as prof:
            work.step()
            _sync(work.device)
    prof.export_chrome_trace(trace_path)
    with open(trace_path, encoding="utf-8") as f:
        trace = json.load(f)
    return stream_summary(trace.get("traceEvents", []))


def first_k_for(block_bytes: dict[int, int], targets_gb: Sequence[float]) -> list[int]:
    """For each target, the number of first blocks whose bytes come nearest to it (each count once, at least 1)."""
    n = max(block_bytes) + 1
    totals = [sum(block_bytes.get(i, 0) for i in range(k)) for k in range(n + 1)]
    ks = [min(range(1, n), key=lambda k: abs(totals[k] - t * GB)) for t in targets_gb]
    return sorted(set(ks))


def gradients_check(name: str, smoke: bool, device: torch.device) -> dict[str, Any]:
    """One step's gradients: every block offloaded against plain, and plain against plain (the floor)."""

    def grads(offloaded: bool) -> list[torch.Tensor]:
        work = Workload(name, smoke, device)
        torch.manual_seed(1)
        with offloader(work, range(len(work.blocks)), smoke) if offloaded else _nothing():
            work.loss().backward()
        out = [p.grad.detach().float().clone() for p in work.model.parameters() if p.grad is not None]
        del work
        _free(device)
        return out

    plain = grads(False)
    again = grads(False)
    offloaded = grads(True)

    def diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
        return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))

    return {
        "bit_identical": all(torch.equal(x, y) for x, y in zip(plain, offloaded, strict=True)),
        "max_difference": diff(plain, offloaded),
        "plain_vs_plain_difference": diff(plain, again),
    }


def run_model(name: str, args: argparse.Namespace, device: torch.device, bandwidth: float) -> dict[str, Any]:
    smoke = args.smoke
    work = Workload(name, smoke, device)
    n = len(work.blocks)
    timing = block_times(work)
    probe = offloader(work, range(n), smoke)
    with probe:
        for _ in range(2):
            work.step()
    block_bytes = dict(probe.block_bytes)
    del work, probe
    _free(device)
    rows: dict[str, list[int] | None] = {"plain": None, "all": list(range(n))}
    for k in first_k_for(block_bytes, TARGETS_GB):
        rows[f"first_{k}"] = list(range(k))
    rows |= {"checkpointed": None, "checkpointed_inputs": list(range(n))}
    measured: dict[str, list[dict[str, Any]]] = {row: [] for row in rows}
    for r in range(args.rounds):
        for row in list(rows) if r % 2 == 0 else list(rows)[::-1]:
            work = Workload(name, smoke, device, checkpointed=row in CHECKPOINTED)
            offload = None if rows[row] is None else offloader(work, rows[row], smoke)  # type: ignore[arg-type]
            measured[row].append(timed_row(work, offload, args.warmup, args.steps))
            del work, offload
            _free(device)
            print(f"{name} round {r} {row}: {measured[row][-1]['step_ms']:.1f} ms", flush=True)
    plain_ms = statistics.median(m["step_ms"] for m in measured["plain"])
    checkpointed_ms = statistics.median(m["step_ms"] for m in measured["checkpointed"])
    results = []
    for row, offloaded in rows.items():
        runs = measured[row]
        step_ms = statistics.median(m["step_ms"] for m in runs)
        backward = timing["backward_ms"]
        if row in CHECKPOINTED:  # what its checkpoints keep, as this row's offload moved it; each block recomputed
            moved = [int(runs[-1].get("block_bytes", {}).get(i, 0)) for i in range(n)]
            backward = [b + f for b, f in zip(backward, timing["forward_ms"], strict=True)]
        else:
            moved = [block_bytes.get(i, 0) if offloaded and i in offloaded else 0 for i in range(n)]
        moved_gb = sum(moved) / GB
        cost_ms = step_ms - plain_ms
        estimate = {  # what the model of the copies predicts at the measured bandwidth and on PCIe 4
            "exposed_ms_measured_bandwidth": exposed_transfer_ms(
                timing["forward_ms"], backward, moved, bandwidth, timing["between_ms"]
            ),
            "exposed_ms_pcie4": exposed_transfer_ms(
                timing["forward_ms"], backward, moved, PCIE4_GB_S, timing["between_ms"]
            ),
        }
        results.append({
            "row": row,
            "offloaded_blocks": offloaded,
            "moved_gb": moved_gb,
            "host_gb": runs[-1].get("host_gb"),
            "step_ms": step_ms,
            "rounds_ms": [m["step_ms"] for m in runs],
            "peak_above_start_gb": statistics.median(m["peak_above_start_gb"] or 0 for m in runs),
            "cost_ms": cost_ms,
            "cost_pct": 100 * cost_ms / plain_ms,
            "ms_per_gb": cost_ms / moved_gb if moved_gb else None,
            **estimate,
            "pcie4_cost_pct": 100 * estimate["exposed_ms_pcie4"] / plain_ms,
            **({"cost_vs_checkpointed_pct": 100 * (step_ms / checkpointed_ms - 1)} if row in CHECKPOINTED else {}),
        })  # fmt: skip
    hidden = [r["moved_gb"] for r in results
              if r["moved_gb"] and r["cost_pct"] <= 100 * HIDDEN_COST and r["row"] not in CHECKPOINTED]  # fmt: skip
    pcie_hidden = 0.0
    for k in range(1, n + 1):  # the first k blocks, on PCIe 4, as the model of the copies predicts
        moved = [block_bytes.get(i, 0) if i < k else 0 for i in range(n)]
        exposed = exposed_transfer_ms(timing["forward_ms"], timing["backward_ms"], moved, PCIE4_GB_S,
                                      timing["between_ms"])  # fmt: skip
        if exposed <= HIDDEN_COST * plain_ms:
            pcie_hidden = max(pcie_hidden, sum(moved) / GB)
    profiles = {}
    for row in [r for r in args.profile.split(",") if r] if args.profile else []:
        if row not in rows:
            profiles[row] = {"error": f"no row {row!r} here; the rows: {', '.join(rows)}"}
            continue
        work = Workload(name, smoke, device, checkpointed=row in CHECKPOINTED)
        offload = None if rows[row] is None else offloader(work, rows[row], smoke)  # type: ignore[arg-type]
        trace = os.path.join(args.out, f"offload_trace_{name}_{row}.json")
        profiles[row] = {"trace": os.path.basename(trace), **profiled_step(work, offload, args.warmup, trace)}
        del work, offload
        _free(device)
    return {
        "blocks": n,
        "block_bytes": [block_bytes.get(i, 0) for i in range(n)],
        "profiles": profiles,
        "plain_step_ms": plain_ms,
        "block_times": timing,
        "rows": results,
        "hidden_gb_measured": max(hidden, default=0.0),
        "hidden_gb_pcie4_estimate": pcie_hidden,
        "gradients": gradients_check(name, smoke, device),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results", help="folder for offload.json")
    parser.add_argument("--smoke", action="store_true", help="tiny models on the CPU: the code path only")
    parser.add_argument("--models", default="gpt2,resnet50")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--profile", default="", help="rows to profile one step of (comma-separated: plain, all, first_K, ...)"
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.rounds, args.steps, args.warmup = 2, 1, 1
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    bandwidth = bandwidth_gb_s(device, 2**20 if args.smoke else 2**30)
    print(f"bandwidth GB/s: {bandwidth}", flush=True)
    result: dict[str, Any] = {
        "environment": environment(),
        "smoke": args.smoke,
        "bandwidth_gb_s": bandwidth,
        "pcie4_gb_s": PCIE4_GB_S,
        "hidden_cost": HIDDEN_COST,
        "models": {},
    }
    path = os.path.join(args.out, "offload.json")
    slower_way = min(bandwidth.values())
    for name in args.models.split(","):
        result["models"][name] = run_model(name, args, device, slower_way)
        write_json(path, result)  # after every model: a run cut short keeps what it measured
        for row in result["models"][name]["rows"]:
            print(
                f"{name:9s} {row['row']:9s} moved {row['moved_gb']:6.2f} GB  step {row['step_ms']:7.1f} ms"
                f"  cost {row['cost_pct']:5.1f} %  peak {row['peak_above_start_gb']:6.2f} GB"
                f"  model {row['exposed_ms_measured_bandwidth']:6.1f} ms  pcie4 {row['pcie4_cost_pct']:5.1f} %"
            )


if __name__ == "__main__":
    main()
