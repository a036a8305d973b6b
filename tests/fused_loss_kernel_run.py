"""The fused loss's Triton kernel in Triton's CPU interpreter (``TRITON_INTERPRET=1`` must be set before Triton is
first imported, so this runs in a process of its own): run by tests/levers/test_levers_fused_loss.py.

Prints one JSON object: per case, the largest difference of the loss and of each gradient between the kernel's chunks
and PyTorch's operations' chunks, and against the plain head's loss in float32; how many chunks the kernel computed,
and how many columns (the vocabulary of 300, padded to ``fused_loss.PAD_WORDS``) each chunk's logits had.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's package

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from lightning_memguard import fused_linear_cross_entropy  # noqa: E402
from lightning_memguard.levers import fused_loss  # noqa: E402

launches = []
columns = []
kernel = fused_loss._softmax_gradient


def counted(*args):
    terms = kernel(*args)
    launches.append(terms is not None)
    columns.append(args[0].shape[1])
    return terms


fused_loss._softmax_gradient = counted


def run(case, kernel_on):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 40, 16, generator=generator, requires_grad=True)
    weight = torch.randn(300, 16, generator=generator, requires_grad=True)
    bias = torch.randn(300, generator=generator, requires_grad=True) if case.get("bias") else None
    labels = torch.randint(0, 300, (3, 40), generator=generator)
    labels[0, :] = -100  # left out before chunking: 73 of 120 tokens count (3 chunks of 32); else the first chunk
    labels[1, :5] = -100  # holds ignored tokens only
    kwargs = {"label_smoothing": case.get("smoothing", 0.0), "reduction": case.get("reduction", "mean")}
    counted_only = not case.get("masked")  # else the ignored tokens kept in the chunks, masked there
    runs, pad = fused_loss._kernel_runs, fused_loss.PAD_WORDS
    fused_loss.PAD_WORDS = case.get("pad", pad)
    if not kernel_on:
        fused_loss._kernel_runs = lambda *args: False
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case.get("bf16", False)):
            loss = fused_linear_cross_entropy(
                hidden, weight, labels, bias=bias, shift=True, chunk_tokens=32, counted_only=counted_only, **kwargs
            )
    finally:
        fused_loss._kernel_runs, fused_loss.PAD_WORDS = runs, pad
    tensors = [t for t in (hidden, weight, bias) if t is not None]
    grads = torch.autograd.grad(loss * 1.7, tensors)
    logits = F.linear(hidden, weight, bias).float()[:, :-1].flatten(0, 1)
    plain = F.cross_entropy(logits, labels[:, 1:].flatten(), **kwargs)
    plain_grads = torch.autograd.grad(plain * 1.7, tensors)
    return [loss.detach(), *grads], [plain.detach(), *plain_grads]


def relative_differences(got, want):
    return [float((a.float() - b.float()).abs().max() / b.float().abs().max()) for a, b in zip(got, want, strict=True)]


cases = {
    "float32": {"bias": True},
    "smoothing_sum": {"smoothing": 0.1, "reduction": "sum"},
    "bf16": {"bf16": True, "bias": True},
    "bf16_smoothing": {"bf16": True, "smoothing": 0.2},
    "bf16_masked": {"bf16": True, "smoothing": 0.1, "masked": True},
    "bf16_unpadded": {"bf16": True, "bias": True, "pad": 1},
}
result = {}
for name, case in cases.items():
    launches.clear()
    columns.clear()
    ours, plain = run(case, True)
    ran, widths = list(launches), list(columns)
    torch_ops, _ = run(case, False)
    result[name] = {
        "kernel_chunks": ran,
        "kernel_columns": widths,
        "vs_torch_ops": relative_differences(ours, torch_ops),
        "vs_plain_float32": relative_differences(ours, plain),
        "torch_ops_vs_plain_float32": relative_differences(torch_ops, plain),
    }
print(json.dumps(result))
