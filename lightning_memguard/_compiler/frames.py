"""What the spill emulator needs to see a compiled graph's saved tensors.

AOTAutograd runs a compiled graph as one ``torch.autograd.Function`` (``CompiledFunction``); its forward returns the
tensors the backward needs and ``ctx.save_for_backward`` saves them through the saved-tensor hooks like any other
saved tensor, but they have no autograd history (leaves that do not require grad, like the inputs and buffers eager
ops save). :func:`saved_by_compiled_graph` tells them apart by who made autograd pack them; :func:`ran_compiled`
whether a loss came through a compiled graph at all.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

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
