"""What Dynamo has done and is doing: graphs compiled so far, whether a module runs compiled, whether Dynamo is
tracing now, and the module a ``torch.compile`` result wraps.

Reads only: :func:`compiles` reads Dynamo's counters where Dynamo is loaded, :func:`is_compiled` looks for its
``OptimizedModule`` where it is loaded; nothing here imports ``torch._dynamo``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

_COUNTERS = "torch._dynamo.utils"
_EVAL_FRAME = "torch._dynamo.eval_frame"


def compiles() -> int:
    """Graphs TorchDynamo has compiled in this process so far (0 while nothing was compiled). A dict read."""
    utils = sys.modules.get(_COUNTERS)
    if utils is None:  # nothing imported Dynamo: nothing compiled
        return 0
    return int(utils.counters["stats"]["unique_graphs"])


class CompileWatch:
    """Whether Dynamo compiled since the last look: :meth:`moved` reads :func:`compiles` and remembers it."""

    def __init__(self) -> None:
        self._count = compiles()

    def moved(self) -> bool:
        count = compiles()
        moved, self._count = count != self._count, count
        return moved


def lightning_dynamo_context(module: nn.Module) -> Callable[..., Any] | None:
    """The ``torch.compile`` context (``OptimizedModule.dynamo_ctx``) a LightningModule was compiled with, where
    ``fit`` unwrapped a ``torch.compile`` result: Lightning keeps it in ``LightningModule._compiler_ctx``, the one
    attribute of Lightning's read here, by name, without importing Lightning; None otherwise (and where Lightning
    is not loaded: then nothing was compiled by it)."""
    if sys.modules.get("lightning.pytorch") is None:
        return None
    context = getattr(module, "_compiler_ctx", None)
    return context.get("dynamo_ctx") if context is not None else None


def is_compiled(module: nn.Module) -> bool:
    """``module`` or one of its submodules runs compiled: ``torch.compile(model)`` (a LightningModule unwrapped by
    Lightning's ``fit`` keeps its compile context), a compiled submodule, or ``nn.Module.compile()``."""
    if lightning_dynamo_context(module) is not None:
        return True
    eval_frame = sys.modules.get(_EVAL_FRAME)
    optimized = getattr(eval_frame, "OptimizedModule", ()) if eval_frame is not None else ()
    return any(
        (optimized and isinstance(m, optimized)) or getattr(m, "_compiled_call_impl", None) is not None
        for m in module.modules()
    )


def compiling() -> bool:
    """Whether Dynamo is tracing the code now running (``torch.compiler.is_compiling``; False where it is missing)."""
    is_compiling = getattr(torch.compiler, "is_compiling", None)
    return bool(is_compiling()) if is_compiling is not None else False


def unwrapped(module: nn.Module) -> nn.Module:
    """The module a ``torch.compile`` result wraps (its modules are the ones to change), else ``module``."""
    original = getattr(module, "_orig_mod", None)
    return original if isinstance(original, nn.Module) else module
