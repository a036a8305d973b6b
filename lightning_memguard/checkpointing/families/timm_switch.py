"""What timm's own switch checkpoints in a model, read from the forward of each module that carries it.

A timm module that checkpoints under ``set_grad_checkpointing`` holds a ``grad_checkpointing`` attribute from its
constructor on, and its forward (with the methods of its own that the forward calls) hands ``checkpoint`` or
``checkpoint_seq`` the modules it checkpoints: ``checkpoint_seq(self.stages, x)`` one checkpoint per stage, each
``blk`` of ``for blk in self.blocks: x = checkpoint(blk, x)``, ``checkpoint_seq(self.blocks, x, flatten=True)`` the
blocks of every stage. :func:`switch_units` reads those calls (Python's ``ast``, no model is run) and names the modules
they take; an argument it cannot follow (a closure, a method of the model itself) names nothing, and the declared
blocks stand there.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Iterator
from typing import Any

from torch import nn

from lightning_memguard.checkpointing.families._base import Named, original_class

_Value = tuple[str, list[str]]
"""What an expression of a forward stands for: ``("module", paths)`` (any one of the modules at ``paths``, relative
to the module whose forward it is) or ``("items", paths)`` (a sequence of exactly those modules)."""


def _method_tree(cls: type, name: str) -> ast.FunctionDef | None:
    function = getattr(cls, name, None)
    if not inspect.isfunction(function):
        return None
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):  # no source to read (a compiled or generated method)
        return None
    node = tree.body[0] if tree.body else None
    return node if isinstance(node, ast.FunctionDef) else None


def _forward_methods(cls: type) -> Iterator[ast.FunctionDef]:
    """``cls.forward`` and every method of ``cls`` it calls on ``self``, transitively, each once."""
    seen: set[str] = set()
    todo = ["forward"]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        tree = _method_tree(cls, name)
        if tree is None:
            continue
        yield tree
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "self"
            ):
                todo.append(node.func.attr)


def _called(node: ast.Call) -> str:
    func = node.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


class _Reader:
    """Follows the expressions of one method of a module (``modules``: its submodules by path) to the submodules they
    stand for."""

    def __init__(self, modules: dict[str, nn.Module]) -> None:
        self.modules = modules
        self.names: dict[str, _Value] = {}

    def children(self, path: str) -> list[str]:
        return [f"{path}.{n}" if path else n for n, _ in self.modules[path].named_children()]

    def items(self, value: _Value | None) -> list[str] | None:
        """The modules a value yields when iterated: a sequence's own, a module container's children."""
        if value is None:
            return None
        kind, paths = value
        return paths if kind == "items" else [c for p in paths for c in self.children(p)]

    def value(self, node: ast.expr) -> _Value | None:
        if isinstance(node, ast.Name):
            return ("module", [""]) if node.id == "self" else self.names.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self.value(node.value)
            if base is None or base[0] != "module":
                return None
            inner = [f"{p}.{node.attr}" if p else node.attr for p in base[1]]
            if all(p in self.modules for p in inner):
                return ("module", inner)
            # a method of a block (``blk.forward_with_tap``) stands for the block; one of the module itself, for none
            return base if "" not in base[1] else None
        if isinstance(node, ast.Subscript):
            return self._subscript(node)
        if isinstance(node, ast.List | ast.Tuple):
            parts = [self.value(element) for element in node.elts]
            if any(p is None or p[0] != "module" or len(p[1]) != 1 for p in parts):
                return None
            return ("items", [p[1][0] for p in parts if p is not None])
        if isinstance(node, ast.Call):
            if _called(node) == "children" and isinstance(node.func, ast.Attribute) and not node.args:
                base = self.value(node.func.value)
                return None if base is None or base[0] != "module" else ("items", self.items(base) or [])
            if _called(node) in ("list", "tuple", "reversed") and len(node.args) == 1:
                found = self.items(self.value(node.args[0]))
                return None if found is None else ("items", found)
        return None

    def _subscript(self, node: ast.Subscript) -> _Value | None:
        found = self.items(self.value(node.value))
        if found is None:
            return None
        index = node.slice
        if isinstance(index, ast.Slice):
            bounds = [self._constant(b) for b in (index.lower, index.upper, index.step)]
            if all(b is not False for b in bounds):
                return ("items", found[slice(*bounds)])
            return ("items", found)  # bounds known at run time: any of them
        position = self._constant(index)
        if isinstance(position, int) and -len(found) <= position < len(found):
            return ("module", [found[position]])
        return ("module", found)

    @staticmethod
    def _constant(node: ast.expr | None) -> Any:
        """An integer constant (None where absent), else False."""
        if node is None:
            return None
        try:
            value = ast.literal_eval(node)
        except ValueError:
            return False
        return value if isinstance(value, int) else False

    def bind(self, tree: ast.FunctionDef) -> None:
        """Names the forward binds to modules: ``name = self.stages[:n]``, ``for i, blk in enumerate(self.blocks)``,
        ``for blk, size in zip(self.blocks, sizes)``."""
        nodes = [n for n in ast.walk(tree) if isinstance(n, ast.Assign | ast.For | ast.comprehension)]
        nodes.sort(key=lambda n: (n.target if isinstance(n, ast.comprehension) else n).lineno)  # in source order
        for node in nodes:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                self._name(node.targets[0].id, self.value(node.value))
            elif isinstance(node, ast.For | ast.comprehension):
                self._bind_loop(node.target, node.iter)

    def _bind_loop(self, target: ast.expr, source: ast.expr) -> None:
        paired = _called(source) if isinstance(source, ast.Call) and isinstance(source.func, ast.Name) else ""
        if isinstance(source, ast.Call) and paired in ("enumerate", "zip"):
            # zip's targets take its arguments' items; enumerate's second its argument's (the first: an index)
            sources = source.args if paired == "zip" else [ast.Constant(None), *source.args[:1]]
            if isinstance(target, ast.Tuple) and len(target.elts) == len(sources):
                for element, each in zip(target.elts, sources, strict=True):
                    self._bind_loop(element, each)
            return
        found = None if isinstance(source, ast.Constant) else self.items(self.value(source))
        if isinstance(target, ast.Name) and found:
            self._name(target.id, ("module", found))

    def _name(self, name: str, value: _Value | None) -> None:
        """Binds ``name``; a name bound to modules twice (``blk`` of two loops) stands for any of them."""
        if value is None:
            return
        known = self.names.get(name)
        if known is not None and known[0] == value[0] == "module":
            value = ("module", known[1] + [p for p in value[1] if p not in known[1]])
        self.names[name] = value

    def checkpointed(self, tree: ast.FunctionDef) -> list[str]:
        """The modules the ``checkpoint`` / ``checkpoint_seq`` calls of one method take, each as one checkpoint."""
        found: list[str] = []
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            called = _called(node)
            value = self.value(node.args[0])
            if called == "checkpoint" and value is not None and value[0] == "module":
                found += value[1]
            elif called == "checkpoint_seq":
                units = self.items(value) or []
                flatten = any(k.arg == "flatten" and self._truthy(k.value) for k in node.keywords)
                found += [c for u in units for c in self.children(u)] if flatten else units
        return [p for p in found if p and type(self.modules[p]) is not nn.Identity]

    @staticmethod
    def _truthy(node: ast.expr) -> bool:
        return isinstance(node, ast.Constant) and bool(node.value)


def _checkpointed_by(module: nn.Module) -> list[str]:
    """The submodules (paths relative to ``module``) that ``module``'s forward checkpoints under its switch."""
    modules = dict(module.named_modules())
    found: list[str] = []
    for tree in _forward_methods(original_class(module)):
        reader = _Reader(modules)  # each method's own names
        reader.bind(tree)
        found += [p for p in reader.checkpointed(tree) if p not in found]
    return found


def switch_units(model: nn.Module) -> list[Named]:
    """The modules timm's own switch checkpoints in ``model``, one checkpoint each, in the order the model registers
    them: what the forward of every module with a ``grad_checkpointing`` attribute hands ``checkpoint`` or
    ``checkpoint_seq``, outermost first (a checkpointed stage whose blocks its own switch checkpoints is one unit, as
    the outer checkpoint keeps only the stage's input)."""
    chosen: set[str] = set()
    for name, module in model.named_modules():
        if "grad_checkpointing" not in vars(module) or any(name.startswith(f"{c}.") or name == c for c in chosen):
            continue
        chosen.update(f"{name}.{p}" if name else p for p in _checkpointed_by(module))
    outermost = {c for c in chosen if not any(c.startswith(f"{o}.") for o in chosen)}
    return [(name, module) for name, module in model.named_modules() if name in outermost]
