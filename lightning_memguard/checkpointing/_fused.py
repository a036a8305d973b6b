"""One-pass rebuild of ``relu(batch_norm(x) [+ identity])`` on CUDA, as a Triton kernel.

Eagerly the rebuild is two or three passes over the tensor (BatchNorm, the residual add, the ReLU); this kernel
reads each input once and writes the result once. It computes what training-mode BatchNorm's CUDA kernel computes,
``weight * (x - mean) * invstd + bias`` in float32, rounded to the tensor's dtype, then the add, rounded again, then
the ReLU. Triton comes with PyTorch's CUDA builds; where it is missing, where a tensor's layout is not one of the
two dense ones (contiguous, channels_last), or once the kernel has failed to build or run (with one warning),
:func:`fused` returns None and the caller rebuilds eagerly.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch

from lightning_memguard import _compiler

_BLOCK = 2048

_failed: list[str] = []  # why the kernel could not run here, once it has failed: from then on, PyTorch's kernels


def available(t: torch.Tensor) -> bool:
    """Whether the kernel can run on ``t``'s device: CUDA with Triton, or Triton's CPU interpreter."""
    return not _failed and _compiler.triton_runs_on(t)


@functools.cache
def _kernel() -> Any:
    """The Triton kernel, defined when first needed (under Triton's interpreter if ``TRITON_INTERPRET=1`` then)."""
    return _compiler.triton_module("lightning_memguard.checkpointing._kernels").bn_relu


BatchNormArgs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
"""A BatchNorm's input and what its training-mode forward normalised it with: mean, inverse deviation, weight,
bias (per channel)."""


def _inner(x: torch.Tensor) -> int | None:
    """Elements between one channel and the next in memory, for the dense layouts the kernel handles."""
    if x.dim() < 2 or x.numel() >= 2**31:
        return None
    if x.is_contiguous():
        return int(x[0, 0].numel())
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
        return 1
    return None


def fused(
    bn: BatchNormArgs, identity: torch.Tensor | BatchNormArgs | None = None, relu: bool = True
) -> torch.Tensor | None:
    """``relu(bn + identity)`` in one pass, each BatchNorm as its training-mode forward computed it; None where
    the kernel cannot run (the caller then rebuilds eagerly)."""
    x = bn[0]
    inner = _inner(x)
    if inner is None or not available(x):
        return None
    if identity is None:
        kind, second = 0, (x,) * 5  # not read
    elif isinstance(identity, torch.Tensor):
        kind, second = 1, (identity,) + (x,) * 4  # only the first is read
    else:
        kind, second = 2, identity
    r = second[0]
    if kind and (r.shape != x.shape or r.stride() != x.stride() or r.dtype != x.dtype):
        return None
    out = torch.empty_like(x)
    n = x.numel()
    try:
        _kernel()[(-(-n // _BLOCK),)](
            *bn, *second, out, n, C=x.shape[1], INNER=inner, IDENTITY=kind, RELU=relu, BLOCK=_BLOCK
        )
    except Exception as err:  # Triton cannot build or run it for this GPU: rebuild eagerly, and say so once
        _failed.append(f"{type(err).__name__}: {err}")
        warnings.warn(
            f"lightning-memguard: the one-pass rebuild kernel cannot run here ({_failed[0][:200]}); rebuilding"
            " with PyTorch's own kernels instead (same result, slower)",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    return out
