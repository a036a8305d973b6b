"""A model compiled anew for a measurement, so it sees compile's settings of the moment.

Dynamo's guards do not look at compile's settings (``activation_memory_budget``), so a graph cached under another
setting would be reused: the measurement empties Dynamo's caches first (:mod:`.caches` says why for the whole
process, not only the model measured).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_memguard._compiler.dynamo_state import lightning_dynamo_context
from lightning_memguard._compiler.graphs import forget_graphs_apart


def _step(model: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> Any:
    return model(*args, **(kwargs or {}))


def fresh_compiled(model: nn.Module, options: dict[str, Any] | None) -> Callable[..., Any]:
    """``model(*args, **kwargs)`` compiled anew, called as ``step(model, args)`` or ``step(model, args, kwargs)``: a
    function of its own code object, with Dynamo's caches emptied first
    (:func:`~lightning_memguard._compiler.graphs.forget_graphs_apart`), so no graph of the model is cached and the
    current settings (``activation_memory_budget``) apply to its first call. Other compiled functions in the process
    compile again on their next call.

    ``options``: ``torch.compile`` keyword arguments; None: compiled the way ``model`` already is (a
    ``torch.compile`` result, or a LightningModule that ``fit`` unwrapped), or with the defaults.
    """

    forget_graphs_apart()
    step = types.FunctionType(_step.__code__.replace(), _step.__globals__, "memguard_step", _step.__defaults__)
    if options is None:
        context = getattr(model, "dynamo_ctx", None)  # torch.compile(model)
        if context is None:
            context = lightning_dynamo_context(model)  # fit(torch.compile(lightning_module))
        if context is not None:
            return context(step)  # type: ignore[no-any-return]
        options = {}
    return torch.compile(step, **options)  # type: ignore[no-any-return]
