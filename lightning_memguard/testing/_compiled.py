"""The torch.compile internals the emulator relies on, named in one place.

PyTorch offers no public way to ask whether a saved tensor comes from a compiled graph, whether a training step ran
compiled code, or whether dynamo compiled during a step. Each function below names what it reads; a PyTorch release
that moves one breaks here and nowhere else (``tests/test_emulator_compile.py`` fails then: a compiled model's spill
would no longer be seen).

Under ``torch.compile`` AOTAutograd runs a compiled graph as one ``torch.autograd.Function`` (``CompiledFunction``
in ``torch/_functorch/_aot_autograd/runtime_wrappers.py``): the forward graph returns the tensors the backward graph
needs, and ``ctx.save_for_backward`` saves them, through the saved-tensor hooks as any other saved tensor. Unlike the
tensors eager ops save, they have no autograd history: the graph's activations are leaves that do not require grad,
exactly like the inputs and buffers that eager ops save.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

_AOT_AUTOGRAD_DIR = os.path.join(os.path.dirname(torch.__file__), "_functorch", "_aot_autograd") + os.sep
_COMPILED_BACKWARD = "CompiledFunctionBackward"  # the autograd node of AOTAutograd's CompiledFunction


def saved_by_compiled_graph() -> bool:
    """Whether the saved-tensor pack hook now running was called for a compiled graph's ``save_for_backward``.

    Autograd packs a Function's saved tensors as ``Function.apply`` returns; for a compiled graph the nearest Python
    frame is then AOTAutograd's boxed call (``make_boxed_func``'s ``g`` in ``torch/_functorch/_aot_autograd/
    utils.py``). Eager ops pack from the user's code. Call this from the hook itself.
    """
    frame = sys._getframe(2)  # 0: this function, 1: the hook, 2: whoever made autograd pack
    return frame.f_code.co_filename.startswith(_AOT_AUTOGRAD_DIR)


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


def graphs_compiled() -> int:
    """How many graphs dynamo has compiled in this process (``torch._dynamo.utils.counters["stats"]
    ["unique_graphs"]``, recompiles included); 0 while dynamo was never imported. A change across a step means the
    step compiled (its memory then holds the compiler's work, not only training's)."""
    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
