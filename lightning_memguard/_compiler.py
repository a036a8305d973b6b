"""What this library reads from and sets in ``torch.compile`` (TorchDynamo), in one place: these are its internals.

- :func:`compiles`: how many graphs Dynamo has compiled in this process, read from its counters, so a step that
  compiled (the first at a new size, the last short batch, the first after a switch to eval) is told apart from a
  step that only ran; :class:`CompileWatch` says whether that count moved since its last look.
- :func:`static_graph_per_size`: Dynamo's configuration patched for a block of trials, so each new batch size gets
  a graph specialised to it, as training at that size alone would, instead of the dynamic-shape graph Dynamo makes
  after a second size (``automatic_dynamic_shapes``), and so no trial silently falls back to eager because the
  recompile limit was reached.
- :func:`is_compiled`: whether a module (a LightningModule, or a model inside one) runs compiled.
- :func:`saved_by_compiled_graph` and :func:`ran_compiled` (for the spill emulator): AOTAutograd runs a compiled
  graph as one ``torch.autograd.Function`` (``CompiledFunction``); its forward returns the tensors the backward
  needs and ``ctx.save_for_backward`` saves them through the saved-tensor hooks like any other saved tensor, but
  they have no autograd history (leaves that do not require grad, like the inputs and buffers eager ops save).
- :func:`activation_memory_budget`: compile's own memory lever (``torch._functorch.config``), set for a block;
  :func:`activation_memory_budget_now`: its value in force.
- :func:`graph_apart` and :func:`not_traced`: a model split into several compiled graphs, each with its own
  backward: a frame Dynamo does not trace calls a function of its own per part, which it compiles.
- :func:`backends`, :func:`inductor_missing` and :func:`triton_installed`: the backends ``torch.compile`` knows,
  what Inductor lacks here, and whether Triton is there (for Inductor on CUDA and the rebuild's kernel).
- :func:`compiling`: whether Dynamo is tracing the code now running.
- :func:`gradient_realized`: where a compiled graph chains residual blocks, the gradient flowing into a block is
  one buffer, as in eager mode, not the sum of its two paths fused into every consumer.
- :func:`fresh_compiled`: a model compiled anew, so a measurement sees the settings of the moment;
  :func:`eager`: compiled code run eagerly; :func:`unwrapped`: the module a ``torch.compile`` result wraps.

Nothing here imports ``torch._dynamo`` unless something has compiled already, or a model is compiled, except
:func:`not_traced` (``torch.compiler.disable``), used as a decorator when the package is imported (the package
imports Lightning, which imports Dynamo anyway). Importing this module defines one custom op,
``torch.ops.lightning_memguard.realize_`` (:func:`gradient_realized`).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

_COUNTERS = "torch._dynamo.utils"

_AOT_AUTOGRAD_DIR = os.path.join(os.path.dirname(torch.__file__), "_functorch", "_aot_autograd") + os.sep
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_FRAMES = 4  # frames of torch's own code looked through from the hook up to AOTAutograd's runtime
_COMPILED_BACKWARD = "CompiledFunctionBackward"  # the autograd node of AOTAutograd's CompiledFunction


def saved_by_compiled_graph() -> bool:
    """Whether the saved-tensor pack hook now running was called for a compiled graph's ``save_for_backward``.

    Autograd packs a Function's saved tensors as ``Function.apply`` returns. For a compiled graph, AOTAutograd's
    runtime (``torch/_functorch/_aot_autograd/``) called that ``apply``: directly (torch 2.14: the nearest Python
    frame is its boxed call), or through ``torch/autograd/function.py`` first (earlier releases). Eager ops pack from
    the user's code. Call this from the hook itself; the few frames above it are looked at.
    """
    frame = sys._getframe(2)  # 0: this function, 1: the hook, 2: whoever made autograd pack
    for _ in range(_FRAMES):
        if frame is None:
            return False
        if frame.f_code.co_filename.startswith(_AOT_AUTOGRAD_DIR):
            return True
        if not frame.f_code.co_filename.startswith(_TORCH_DIR):  # user code (an eager op's caller): not compiled
            return False
        frame = frame.f_back  # type: ignore[assignment]
    return False


def ran_compiled(loss: Any) -> bool:
    """Whether ``loss``'s autograd graph contains a compiled graph's backward node (``CompiledFunctionBackward``)."""
    grad_fn = getattr(loss, "grad_fn", None)
    todo, seen = [grad_fn] if grad_fn is not None else [], set()
    while todo:
        node = todo.pop()
        if type(node).__name__ == _COMPILED_BACKWARD:
            return True
        for nxt, _ in node.next_functions:
            if nxt is not None and id(nxt) not in seen:
                seen.add(id(nxt))
                todo.append(nxt)
    return False


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


def is_compiled(module: nn.Module) -> bool:
    """``module`` or one of its submodules runs compiled: ``torch.compile(model)`` (a LightningModule unwrapped by
    Lightning's ``fit`` keeps a ``_compiler_ctx``), a compiled submodule, or ``nn.Module.compile()``."""
    if getattr(module, "_compiler_ctx", None) is not None:
        return True
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    optimized = getattr(eval_frame, "OptimizedModule", ()) if eval_frame is not None else ()
    return any(
        (optimized and isinstance(m, optimized)) or getattr(m, "_compiled_call_impl", None) is not None
        for m in module.modules()
    )


@contextmanager
def static_graph_per_size(sizes: int = 64) -> Iterator[None]:
    """Inside, each new input shape compiles a graph of its own, static in its shapes, and ``sizes`` more
    recompiles than Dynamo's limit are allowed per function (a recompile costs only when it happens). A model
    compiled with ``dynamic=True`` stays dynamic (that asks for dynamic shapes); ``dynamic=False`` is static
    anyway. Dynamo's settings are restored on exit.

    The graphs stay in Dynamo's cache afterwards: training at a size tried runs that size's graph.
    """
    import torch._dynamo

    config = torch._dynamo.config
    limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    with config.patch({"automatic_dynamic_shapes": False, limit: getattr(config, limit) + sizes}):
        yield


@contextmanager
def activation_memory_budget(setting: float | None) -> Iterator[None]:
    """Compile's own memory lever, ``torch._functorch.config.activation_memory_budget``, set to ``setting`` inside
    (None: left as it is) and restored on exit. It acts when a graph is compiled, so it must be set while the model
    compiles: its first training step, and any recompile."""
    if setting is None:
        yield
        return
    import torch._functorch.config

    with torch._functorch.config.patch(activation_memory_budget=setting):
        yield


def activation_memory_budget_now() -> float:
    """Compile's ``activation_memory_budget`` in force (1.0, keep everything, unless the user set it)."""
    import torch._functorch.config

    return float(torch._functorch.config.activation_memory_budget)


def backends() -> list[str]:
    """The backend names ``torch.compile`` knows (Dynamo's registry, debugging backends included)."""
    import torch._dynamo

    return list(torch._dynamo.list_backends(exclude_tags=()))


def triton_installed() -> bool:
    """Whether Triton can be imported (without importing it): Inductor's CUDA code and the rebuild's kernel need it."""
    return importlib.util.find_spec("triton") is not None


def inductor_missing(cuda: bool) -> str | None:
    """What Inductor lacks here to compile for CUDA (``"triton"``) or for the CPU (``"c++"``: no C++ compiler,
    ``$CXX``, g++, clang++ or c++, or cl on Windows), else None."""
    if cuda:
        return None if triton_installed() else "triton"
    names = [os.environ.get("CXX", ""), *(["cl"] if sys.platform == "win32" else ["g++", "clang++", "c++"])]
    return None if any(name and shutil.which(name) for name in names) else "c++"


def compiling() -> bool:
    """Whether Dynamo is tracing the code now running (``torch.compiler.is_compiling``; False where it is missing)."""
    is_compiling = getattr(torch.compiler, "is_compiling", None)
    return bool(is_compiling()) if is_compiling is not None else False


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
    """Dynamo's caches emptied (``torch._dynamo.reset()``, where Dynamo is loaded) and new functions from now on
    for :func:`graph_apart`: every graph compiles again, under the settings of the moment (Dynamo's guards do not
    look at compile's settings). A model split into graphs compiles its stem and head in its own ``forward``'s
    frames, which a fresh top-level function would not renew."""
    global _generation
    _APART.clear()
    _generation += 1
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        dynamo.reset()


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


def unwrapped(module: nn.Module) -> nn.Module:
    """The module a ``torch.compile`` result wraps (its modules are the ones to change), else ``module``."""
    original = getattr(module, "_orig_mod", None)
    return original if isinstance(original, nn.Module) else module


@contextmanager
def eager() -> Iterator[None]:
    """Compiled functions run eagerly inside (``torch.compiler.set_stance("force_eager")``; older PyTorch: Dynamo
    disabled), so hooks see every module."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    if set_stance is not None:
        with set_stance("force_eager"):
            yield
        return
    from torch import _dynamo

    with _dynamo.config.patch(disable=True):
        yield


def _step(model: Any, args: tuple[Any, ...]) -> Any:
    return model(*args)


def fresh_compiled(model: nn.Module, options: dict[str, Any] | None) -> Callable[..., Any]:
    """``model(*args)`` compiled anew: a function of its own code object, with Dynamo's caches emptied first
    (:func:`forget_graphs_apart`), so no graph of the model is cached and the current settings
    (``activation_memory_budget``) apply to its first call. Other compiled functions in the process compile again
    on their next call.

    ``options``: ``torch.compile`` keyword arguments; None: compiled the way ``model`` already is (a
    ``torch.compile`` result, or a LightningModule that ``fit`` unwrapped), or with the defaults.
    """

    forget_graphs_apart()
    step = types.FunctionType(_step.__code__.replace(), _step.__globals__, "memguard_step")
    if options is None:
        context = getattr(model, "dynamo_ctx", None)  # torch.compile(model)
        compiler_ctx = getattr(model, "_compiler_ctx", None)  # fit(torch.compile(lightning_module))
        if context is None and compiler_ctx is not None:
            context = compiler_ctx.get("dynamo_ctx")
        if context is not None:
            return context(step)  # type: ignore[no-any-return]
        options = {}
    return torch.compile(step, **options)  # type: ignore[no-any-return]
