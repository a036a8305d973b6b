"""The fused loss's head alone, forward and backward, against the plain head, on a real GPU. Run on a CUDA machine:

    python benchmarks/fused_loss.py --out benchmarks/results/fused_loss.json

A language model's head and loss at GPT-2 small's shape (16 x 1024 tokens, 768 features, a vocabulary of 50,257,
the causal shift) and a Llama-style one (a vocabulary of 32,000), bf16 autocast, the head's weight in float32 as a
model keeps it. Rows, in turns of a few steps each for ``--rounds`` rounds, median step time by CUDA events, and the
peak memory above what was allocated before the step: ``plain`` (``F.linear``, the logits in float32 as Hugging
Face's loss makes them, ``F.cross_entropy``); ``fused_torch_ops`` (``fused_linear_cross_entropy`` with its chunks
computed by PyTorch's operations, as where Triton is missing); ``fused`` (with the Triton kernel, as on CUDA by
default, the head's rows padded to ``fused_loss.PAD_WORDS``); ``fused_unpadded`` (the kernel on the vocabulary as it
is); ``fused_no_sync`` (the same with ``counted_only=False``: every row through the head, the shift's last
tokens masked, no device sync); ``torch`` (``implementation="torch"``, ``F.linear_cross_entropy``, where the
installed torch has it).
``--smoke`` runs a tiny version on the CPU: every row's code path, not a measurement.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's package
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import environment, write_json  # noqa: E402

from lightning_memguard import fused_linear_cross_entropy  # noqa: E402
from lightning_memguard.levers import fused_loss  # noqa: E402

SHAPES = {"gpt2": (16, 1024, 768, 50257), "llama": (16, 1024, 768, 32000)}  # batch, sequence, features, vocabulary
SMOKE_SHAPES = {"gpt2": (2, 32, 16, 300), "llama": (2, 32, 16, 200)}


def _plain(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = F.linear(hidden, weight).float()
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def _fused(implementation: str, counted_only: bool = True) -> Callable[..., torch.Tensor]:
    def loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return fused_linear_cross_entropy(
            hidden,
            weight,
            labels,
            shift=True,
            implementation=implementation,
            counted_only=counted_only,  # type: ignore[arg-type]
        )

    return loss


def _torch_ops(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    kernel_runs = fused_loss._kernel_runs
    fused_loss._kernel_runs = lambda *args: False  # type: ignore[assignment]  # PyTorch's operations only
    try:
        return _fused("chunked")(hidden, weight, labels)
    finally:
        fused_loss._kernel_runs = kernel_runs


def _unpadded(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    pad = fused_loss.PAD_WORDS
    fused_loss.PAD_WORDS = 1  # the kernel on the vocabulary as it is
    try:
        return _fused("chunked")(hidden, weight, labels)
    finally:
        fused_loss.PAD_WORDS = pad


ROWS: dict[str, Callable[..., torch.Tensor]] = {
    "plain": _plain,
    "fused_torch_ops": _torch_ops,
    "fused": _fused("chunked"),
    "fused_unpadded": _unpadded,
    "fused_no_sync": _fused("chunked", counted_only=False),
}
if fused_loss.has_torch_linear_cross_entropy():
    ROWS["torch"] = _fused("torch")


def measure(shape: tuple[int, int, int, int], rounds: int, steps: int, device: str) -> dict[str, Any]:
    batch, sequence, features, vocabulary = shape
    generator = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(batch, sequence, features, device=device, generator=generator, requires_grad=True)
    weight = (torch.randn(vocabulary, features, device=device, generator=generator) * 0.02).requires_grad_()
    labels = torch.randint(0, vocabulary, hidden.shape[:-1], device=device, generator=generator)
    cuda = device == "cuda"
    times: dict[str, list[float]] = {name: [] for name in ROWS}
    peaks: dict[str, int] = {}
    losses: dict[str, float] = {}
    grads: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def step(name: str) -> torch.Tensor:
        hidden.grad = weight.grad = None
        with torch.autocast(device, dtype=torch.bfloat16, enabled=cuda):
            loss = ROWS[name](hidden, weight, labels)
        loss.backward()
        return loss

    for name in ROWS:  # warm-up (the kernel's build), the peak and the values
        step(name)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() if cuda else 0
        loss = step(name)
        peaks[name] = (torch.cuda.max_memory_allocated() - before) if cuda else 0
        losses[name] = float(loss)
        grads[name] = (hidden.grad.float().clone(), weight.grad.float().clone())  # type: ignore[union-attr]
    for _ in range(rounds):
        for name in ROWS:
            for _ in range(steps):
                if cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    step(name)
                    end.record()
                    end.synchronize()
                    times[name].append(start.elapsed_time(end))
                else:
                    step(name)
                    times[name].append(0.0)
    reference = grads["plain"]
    rows = {}
    for name in ROWS:
        ms = statistics.median(times[name])
        rows[name] = {
            "step_ms": round(ms, 3),
            "peak_gb": round(peaks[name] / 1e9, 3),
            "loss": losses[name],
            "grad_hidden_max_diff_from_plain": float((grads[name][0] - reference[0]).abs().max()),
            "grad_weight_max_diff_from_plain": float((grads[name][1] - reference[1]).abs().max()),
        }
    plain_ms = rows["plain"]["step_ms"] or 1.0
    for row in rows.values():
        row["time_vs_plain"] = round(row["step_ms"] / plain_ms, 3)
    return {
        "shape": {"batch": batch, "sequence": sequence, "features": features, "vocabulary": vocabulary},
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/fused_loss.json")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="a tiny CPU version: every row runs, nothing measured")
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    result: dict[str, Any] = {"environment": environment(), "models": {}}
    for name, shape in shapes.items():
        result["models"][name] = measure(shape, rounds=1 if args.smoke else args.rounds, steps=2 if args.smoke else 4,
                                         device=device)  # fmt: skip
        write_json(args.out, result)
        for row_name, row in result["models"][name]["rows"].items():
            print(name, row_name, row)


if __name__ == "__main__":
    main()
