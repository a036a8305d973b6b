"""What this library reads from and sets in ``torch.compile`` (TorchDynamo, AOTAutograd, Inductor): these are its
internals, and this package is the only place that touches them, one module per concern.

- :mod:`.dynamo_state`: what Dynamo has done and is doing. :func:`compiles`: how many graphs Dynamo has compiled in this
  process, read from its counters, so a step that compiled (the first at a new size, the last short batch, the first
  after a switch to eval) is told apart from a step that only ran; :class:`CompileWatch` says whether that count
  moved since its last look. :func:`is_compiled`: whether a module (a LightningModule, or a model inside one) runs
  compiled. :func:`compiling`: whether Dynamo is tracing the code now running. :func:`unwrapped`: the module a
  ``torch.compile`` result wraps.
- :mod:`.compile_settings`: compile's settings and what this machine offers it. :func:`static_graph_per_size`: one
  static graph per trial size; :func:`activation_memory_budget` (for a block) and :func:`activation_memory_budget_now`:
  compile's own memory lever (``torch._functorch.config``); :func:`eager`: compiled code run eagerly;
  :func:`backends`, :func:`inductor_missing` and :func:`triton_installed`: the backends ``torch.compile`` knows, what
  Inductor lacks here, and whether Triton is there (for Inductor on CUDA and the library's kernels);
  :func:`triton_runs_on` and :func:`triton_module`: where the library's Triton kernels can run, and their module.
- :mod:`.graphs`: a model's graphs. :func:`graph_apart` and :func:`not_traced`: a model split into several compiled
  graphs, each with its own backward; :func:`forget_graphs_apart`: their functions made anew;
  :func:`gradient_realized`: a block's input gradient held in one buffer (the package's one custom op,
  ``torch.ops.lightning_memguard.realize_``).
- :mod:`.caches`: :func:`forget_compiled`, Dynamo's caches emptied for the whole process, and why it cannot be one
  model's.
- :mod:`.fresh`: :func:`fresh_compiled`, a model compiled anew for a measurement, under the settings of the moment.
- :mod:`.frames`: what the spill emulator needs: :func:`saved_by_compiled_graph` (the frames above a saved-tensor
  hook) and :func:`ran_compiled` (a compiled graph's backward node in a loss's graph).

Nothing here imports ``torch._dynamo`` unless something has compiled already, or a model is compiled, except
:func:`not_traced` (``torch.compiler.disable``), used as a decorator when the package is imported (lightning_memguard
imports Lightning, which imports Dynamo anyway). The one Lightning private read here (the compile context a
LightningModule keeps after ``fit`` unwrapped it) is read through :mod:`lightning_memguard._lightning.privates`.
"""

from lightning_memguard._compiler.caches import forget_compiled
from lightning_memguard._compiler.compile_settings import (
    activation_memory_budget,
    activation_memory_budget_now,
    backends,
    eager,
    inductor_missing,
    static_graph_per_size,
    triton_installed,
    triton_module,
    triton_runs_on,
)
from lightning_memguard._compiler.dynamo_state import CompileWatch, compiles, compiling, is_compiled, unwrapped
from lightning_memguard._compiler.frames import ran_compiled, saved_by_compiled_graph
from lightning_memguard._compiler.fresh import fresh_compiled
from lightning_memguard._compiler.graphs import forget_graphs_apart, gradient_realized, graph_apart, not_traced

__all__ = [
    "CompileWatch",
    "activation_memory_budget",
    "activation_memory_budget_now",
    "backends",
    "compiles",
    "compiling",
    "eager",
    "forget_compiled",
    "forget_graphs_apart",
    "fresh_compiled",
    "gradient_realized",
    "graph_apart",
    "inductor_missing",
    "is_compiled",
    "not_traced",
    "ran_compiled",
    "saved_by_compiled_graph",
    "static_graph_per_size",
    "triton_installed",
    "triton_module",
    "triton_runs_on",
    "unwrapped",
]
