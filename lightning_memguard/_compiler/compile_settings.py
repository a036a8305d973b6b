"""Compile's settings: Dynamo's for a block of trials, compile's own memory lever, running compiled code eagerly, and
what this machine offers ``torch.compile`` (its backends, what Inductor lacks).

- :func:`static_graph_per_size`: Dynamo's configuration patched for a block of trials, so each new batch size gets
  a graph specialised to it, as training at that size alone would, instead of the dynamic-shape graph Dynamo makes
  after a second size (``automatic_dynamic_shapes``), and so no trial silently falls back to eager because the
  recompile limit was reached.
- :func:`activation_memory_budget`: compile's own memory lever (``torch._functorch.config``), set for a block;
  :func:`activation_memory_budget_now`: its value in force.
- :func:`eager`: compiled code run eagerly.
- :func:`backends`, :func:`inductor_missing` and :func:`triton_installed`: the backends ``torch.compile`` knows,
  what Inductor lacks here, and whether Triton is there (for Inductor on CUDA and the library's own kernels);
  :func:`triton_runs_on` and :func:`triton_module`: where the library's Triton kernels (the rebuild's, the fused
  loss's) can run, and their module, defined anew for Triton's CPU interpreter.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

import torch


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


def backends() -> list[str]:
    """The backend names ``torch.compile`` knows (Dynamo's registry, debugging backends included)."""
    import torch._dynamo

    return list(torch._dynamo.list_backends(exclude_tags=()))


def triton_installed() -> bool:
    """Whether Triton can be imported (without importing it): Inductor's CUDA code and the rebuild's kernel need it."""
    return importlib.util.find_spec("triton") is not None


_triton_found = functools.cache(triton_installed)  # asked at every kernel's call: once is enough


def triton_runs_on(tensor: torch.Tensor) -> bool:
    """Whether a Triton kernel of the library can run on ``tensor``'s device: CUDA with Triton installed, or the CPU
    under Triton's interpreter (``TRITON_INTERPRET=1``, the CPU twins of the kernels' GPU tests)."""
    interpreted = tensor.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
    return (tensor.is_cuda or interpreted) and _triton_found()


def triton_module(name: str) -> ModuleType:
    """The module of Triton kernels ``name``, imported, or imported again where it was: its kernels defined anew,
    under Triton's interpreter if ``TRITON_INTERPRET=1`` now. Imported only where Triton is installed."""
    module = sys.modules.get(name)
    return importlib.reload(module) if module is not None else importlib.import_module(name)


def inductor_missing(cuda: bool) -> str | None:
    """What Inductor lacks here to compile for CUDA (``"triton"``) or for the CPU (``"c++"``: no C++ compiler,
    ``$CXX``, g++, clang++ or c++, or cl on Windows), else None."""
    if cuda:
        return None if triton_installed() else "triton"
    names = [os.environ.get("CXX", ""), *(["cl"] if sys.platform == "win32" else ["g++", "clang++", "c++"])]
    return None if any(name and shutil.which(name) for name in names) else "c++"
