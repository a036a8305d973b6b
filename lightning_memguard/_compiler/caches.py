"""Dynamo's caches emptied: every compiled function in the process compiles again on its next call.

This is the whole process's reset (``torch._dynamo.reset()``), not one model's: Dynamo keeps what it compiled on
code objects (``torch._dynamo.eval_frame``'s cache entries, one list per code object), and a model's code objects
(its classes' ``forward``, their helpers, and the resume functions Dynamo makes where a graph breaks) are shared by
every instance of those classes, the user's own compiled copy of the very model included. Clearing one code object
(``torch._C._dynamo.eval_frame.reset_code``) leaves the resume functions and the nested frames of a model that
graph-breaks holding their graphs, which the next compile reuses whatever the settings of the moment (Dynamo's
guards do not look at compile's settings); see docs/architecture.md.
"""

from __future__ import annotations

import sys


def forget_compiled() -> None:
    """Dynamo's caches emptied (``torch._dynamo.reset()``), where Dynamo is loaded (else nothing was compiled): every
    function and module compiles again on its next call, under the settings of the moment."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        dynamo.reset()
