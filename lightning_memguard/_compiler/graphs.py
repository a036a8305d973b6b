"""A model's graphs: split into several compiled graphs, and a block's input gradient held in one buffer.

- :func:`graph_apart` and :func:`not_traced`: a model split into several compiled graphs, each with its own
  backward: a frame Dynamo does not trace calls a function of its own per part, which it compiles;
  :func:`forget_graphs_apart`: those functions made anew, and Dynamo's caches emptied.
- :func:`gradient_realized`: where a compiled graph chains residual blocks, the gradient flowing into a block is
  one buffer, as in eager mode, not the sum of its two paths fused into every consumer.

Importing this module defines one custom op, ``torch.ops.lightning_memguard.realize_`` (:func:`gradient_realized`);
:func:`not_traced` (``torch.compiler.disable``) is used as a decorator when the package is imported.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_memguard._compiler.caches import forget_compiled
from lightning_memguard._compiler.dynamo_state import compiling


def _define_realize() -> Any:
    """The custom op behind :func:`gradient_realized`, defined once per process (None before torch 2.4)."""
    custom_op = getattr(torch.library, "custom_op", None)
    if custom_op is None:
        return None
    name = "lightning_memguard::realize_"
    try:

        @custom_op(name, mutates_args=("tensor",))
        def realize_(tensor: torch.Tensor) -> None:
            """Nothing. Declared to write ``tensor``, so Inductor must hold it in a buffer of its own."""

    except RuntimeError:  # a torch that refuses a second definition (this module imported again)
        return torch.ops.lightning_memguard.realize_
    return realize_


_REALIZE = _define_realize()  # at import: an op cannot be defined while Dynamo traces


class _RealizedGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        _REALIZE(grad)
        return grad


def gradient_realized(x: Any) -> Any:
    """``x`` itself, but under ``torch.compile`` the gradient flowing back into it is held in one buffer.

    A residual block's input gets its gradient along two paths, the block's layers and the identity. In eager mode
    autograd adds them into one tensor. In a compiled graph Inductor fuses that sum into each of its consumers in the
    next block's backward, so both paths' buffers (one of them in float32 under bf16 autocast) stay alive through
    that block's backward. With several checkpointed blocks in one graph, this is where its backward peaked above
    eager mode's. Here the sum goes through an opaque custom op that declares it writes its input and does nothing,
    so Inductor computes the sum into a buffer of its own, in place and without a copy, and frees the two paths.

    Outside Dynamo's tracing, for a tensor that needs no gradient, for a tensor subclass (a DTensor, a nested
    tensor: the op has no rule for them), or where torch has no ``torch.library.custom_op`` (before 2.4), ``x`` is
    returned as it is.
    """
    plain = type(x) in (torch.Tensor, nn.Parameter)
    if not plain or not x.requires_grad or _REALIZE is None or not compiling():
        return x
    return _RealizedGradient.apply(x)


def _call(forward: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    return forward(*args, **kwargs)


_APART: dict[str, Callable[..., Any]] = {}  # this generation's functions, by name
_generation = 0


def forget_graphs_apart() -> None:
    """Dynamo's caches emptied (:func:`~lightning_memguard._compiler.caches.forget_compiled`) and new functions from
    now on for :func:`graph_apart`: every graph compiles again, under the settings of the moment (Dynamo's guards do
    not look at compile's settings). A model split into graphs compiles its stem and head in its own ``forward``'s
    frames, which a fresh top-level function would not renew."""
    global _generation
    _APART.clear()
    _generation += 1
    forget_compiled()


def graph_apart(name: str) -> Callable[..., Any]:
    """``f(forward, *args, **kwargs)``, which calls ``forward(*args, **kwargs)``: called from a frame Dynamo does
    not trace (:func:`not_traced`), ``f``'s frame compiles into a graph of its own, with its own backward.

    Each ``name`` gets a function of its own, named after it: Dynamo keeps what it learned about a function's input
    shapes by its file, line and name, so one function shared by modules of different shapes (a ResNet's stages)
    would make their graphs dynamic-shaped after the second; one function per name keeps each graph specialised to
    its own shapes, as one graph of the whole model is."""
    function = _APART.get(name)
    if function is None:
        label = f"memguard_graph{_generation}_" + "".join(c if c.isalnum() else "_" for c in name)
        code = _call.__code__.replace(co_name=label)
        if hasattr(code, "co_qualname"):  # Python 3.11+
            code = code.replace(co_qualname=label)
        function = types.FunctionType(code, _call.__globals__, label)
        _APART[name] = function
    return function


def not_traced(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` run as Python by ``torch.compile`` (a graph break where compiled code calls it), while the
    functions it calls are compiled (``torch.compiler.disable(recursive=False)``)."""
    return torch.compiler.disable(function, recursive=False)  # type: ignore[no-any-return]
