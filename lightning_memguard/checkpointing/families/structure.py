"""Finding a model's blocks: by its family's adapter where one claims it, else by structure.

``units="auto"`` takes the blocks the adapters name (:func:`..families.blocks`); a model no adapter claims is found by
structure: the classes it declares as units that stay whole (``_no_split_modules``), else the outermost modules
that repeat in its ``nn.Sequential`` / ``nn.ModuleList`` chains and carry most of its parameters. Module classes or a
predicate select the outermost modules they match; module names (as ``named_modules()`` gives them) the modules they
name."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Collection
from typing import Any

from torch import nn

from lightning_memguard.checkpointing.families._base import FOREIGN_WRAPPERS, Named, original_class

Units = str | Collection[type[nn.Module] | str] | Callable[[str, nn.Module], bool]
"""What selects a model's blocks: ``"auto"``, module classes and module names, or a predicate ``(name, module) ->
bool``."""


def check_units(units: Any) -> Units:
    """``units`` as :func:`find_units` takes it: ``"auto"``; module classes or module names (as
    ``model.named_modules()`` gives them: ``"layer1.0"``), one class or a non-empty set, tuple, list or frozenset of
    them, taken as a tuple; or a predicate ``(name, module) -> bool``.

    Raises:
        TypeError: for anything else, quoting it.
        ValueError: for another string (a module's name goes in a list) or an empty collection.

    Example:
        >>> from torchvision.models.resnet import BasicBlock
        >>> check_units(BasicBlock), check_units("auto"), check_units(["layer1.0", "layer1.1"])
        ((<class 'torchvision.models.resnet.BasicBlock'>,), 'auto', ('layer1.0', 'layer1.1'))
        >>> check_units(set())
        Traceback (most recent call last):
        ...
        ValueError: `units` must name at least one module class or module name, got set()
        >>> check_units("layer1.0")
        Traceback (most recent call last):
        ...
        ValueError: `units` must be 'auto' as a string, got 'layer1.0'; module names go in a list: units=['layer1.0']
    """
    if isinstance(units, str):
        if units != "auto":
            raise ValueError(
                f"`units` must be 'auto' as a string, got {units!r}; module names go in a list: units={[units]!r}"
            )
        return units
    if isinstance(units, type):
        units = (units,)
    if isinstance(units, set | frozenset | tuple | list):
        if not units:
            raise ValueError(f"`units` must name at least one module class or module name, got {units!r}")
        if not all(isinstance(c, str) or (isinstance(c, type) and issubclass(c, nn.Module)) for c in units):
            raise TypeError(f"`units` must hold nn.Module subclasses or module names (strings), got {units!r}")
        return tuple(units)
    if callable(units):
        return units  # type: ignore[no-any-return]
    raise TypeError(
        f"`units` must be 'auto', module classes or names, or a callable (name, module) -> bool, got {units!r}"
    )


def names_only(units: Any) -> bool:
    """Whether ``units`` are module names only: they select exactly the modules named, no ResNet stem
    beside them.

    Example:
        >>> names_only(["layer1.0"]), names_only("auto"), names_only((nn.Linear, "fc"))
        (True, False, False)
    """
    return isinstance(units, set | frozenset | tuple | list) and bool(units) and all(isinstance(u, str) for u in units)


def _base_class(module: nn.Module) -> type:
    """The class a module had before this library swapped it, or the class that someone else's wrapper wraps."""
    if type(module).__name__ in FOREIGN_WRAPPERS:
        inner = getattr(module, "_checkpoint_wrapped_module", None) or getattr(module, "module", None)
        if isinstance(inner, nn.Module):
            return _base_class(inner)
    return original_class(module)


def _chain(container: nn.Module) -> list[tuple[str, nn.Module]]:
    """The elements of an ``nn.Sequential`` / ``nn.ModuleList`` with nested ones of those flattened, as (name,
    module). A container subclass with a forward of its own (torchvision's Conv2dNormActivation) is an element."""
    out: list[tuple[str, nn.Module]] = []
    for name, child in container.named_children():
        plain = type(child) in (nn.Sequential, nn.ModuleList)
        out.extend((f"{name}.{n}", m) for n, m in _chain(child)) if plain else out.append((name, child))
    return out


def _repeating(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost modules whose class repeats (twice or more in the model) as composite elements of chains."""
    chains = [m for m in model.modules() if isinstance(m, nn.Sequential | nn.ModuleList)]
    counts: dict[type, int] = {}
    for chain in chains:
        for _, element in _chain(chain):
            cls = _base_class(element)
            if any(True for _ in element.children()) and not issubclass(cls, nn.Sequential | nn.ModuleList):
                counts[cls] = counts.get(cls, 0) + 1
    found: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        if isinstance(module, nn.Sequential | nn.ModuleList):
            for name, child in _chain(module):
                if counts.get(_base_class(child), 0) > 1:
                    found.append((f"{prefix}{name}", child))
                else:
                    visit(f"{prefix}{name}.", child)
            return
        for name, child in module.named_children():
            visit(f"{prefix}{name}.", child)

    visit("", model)
    return _carrying_most(model, found)


def _carrying_most(model: nn.Module, found: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """Of the repeating modules, those of the classes that carry most of the model's parameters: largest first, the
    classes it takes for more than half of them (all, where they never do: an embedding larger than the layers), and
    beside them any class with at least a tenth of the largest's (a decoder's layers beside an encoder's). A small
    repeated part (heads of a few parameters each) is not a block to checkpoint."""
    params: dict[type, dict[int, int]] = {}
    for _, module in found:
        own = params.setdefault(_base_class(module), {})
        own.update((id(p), p.numel()) for p in module.parameters())
    sizes = {cls: sum(own.values()) for cls, own in params.items()}
    total = sum(p.numel() for p in model.parameters())
    largest = max(sizes.values(), default=0)
    kept: set[type] = set()
    carried = 0
    for cls in sorted(sizes, key=lambda c: -sizes[c]):  # stable: equal sizes in order of appearance
        if 2 * carried > total and 10 * sizes[cls] < largest:
            break
        kept.add(cls)
        carried += sizes[cls]
    return [(name, module) for name, module in found if _base_class(module) in kept]


def _declared(model: nn.Module) -> set[str] | None:
    """Class names a Hugging Face model declares as units that must stay whole (``_no_split_modules``)."""
    for module in model.modules():
        names = getattr(module, "_no_split_modules", None)
        if names:
            return set(names)
    return None


def _matches(units: Units, name: str, module: nn.Module) -> bool:
    if isinstance(units, tuple):
        return isinstance(module, tuple(u for u in units if isinstance(u, type)))
    if callable(units):
        return bool(units(name, module))
    raise TypeError(
        f"`units` must be 'auto', module classes or names, or a callable (name, module) -> bool, got {units!r}"
    )


def select_blocks(model: nn.Module, units: Any, known: Callable[[], list[Named] | None]) -> list[Named]:
    """The outermost submodules of ``model`` that ``units`` selects, in order of registration, ``known()`` being the
    adapters' blocks (or None); see :func:`..families.find_units`."""
    units = check_units(units)
    named = _named(model, units)
    if named:  # the modules named, with any classes beside them
        classes = tuple(u for u in units if isinstance(u, type))  # type: ignore[union-attr]
        units = lambda name, module: id(module) in named or isinstance(module, classes)  # noqa: E731
    found: list[tuple[str, nn.Module]] = []
    if units == "auto":
        found = known() or []
    if units == "auto" and not found:
        declared = _declared(model) or set()
        if any(n and _base_class(m).__name__ in declared for n, m in model.named_modules()):
            units = lambda name, module: _base_class(module).__name__ in declared  # noqa: E731
        else:  # nothing declared, or declared classes the model does not hold (a wrapper's, for another model)
            found = _repeating(model)
    if not found and units != "auto":
        skip_prefixes: list[str] = []
        for name, module in model.named_modules():
            if not name or any(name.startswith(p) for p in skip_prefixes):
                continue
            if type(module).__name__ in FOREIGN_WRAPPERS or _matches(units, name, module):
                found.append((name, module))
                skip_prefixes.append(name + ".")
    if not found:
        raise ValueError(
            f"no blocks to checkpoint found in {type(model).__name__} with units={units!r}; pass `units` as a set of"
            " module classes, a list of module names or a predicate on (name, module)"
        )
    _check_outermost(named, found)
    return found


def _named(model: nn.Module, units: Units) -> dict[int, str]:
    """The modules that the names among ``units`` name (by ``id``, with the name given), each name read as
    ``model.named_modules()`` gives it, or relative to a module inside ``model`` (``"body.1"`` for a LightningModule's
    ``net.body.1``) where that is one module.

    Raises:
        ValueError: a name that names no module (with the names closest to it), or several."""
    names = [u for u in units if isinstance(u, str)] if isinstance(units, tuple) else []
    if not names:
        return {}
    modules = dict(model.named_modules())
    del modules[""]  # the model itself is no block
    out: dict[int, str] = {}
    for name in names:
        if name in modules:
            out[id(modules[name])] = name
            continue
        within = [q for q in modules if q.endswith(f".{name}")]
        if len(within) > 1:
            raise ValueError(
                f"`units`: {name!r} names several modules of {type(model).__name__} ({', '.join(within[:5])}"
                f"{', ...' if len(within) > 5 else ''}); give the name as model.named_modules() gives it"
            )
        if not within:
            close = difflib.get_close_matches(name, list(modules), n=3)
            close += [q for q in modules if q.startswith(f"{name}.") and q not in close][: 3 - len(close)]
            hint = f"; the closest: {', '.join(close)}" if close else ""
            raise ValueError(
                f"`units`: {type(model).__name__} has no module named {name!r} (names as model.named_modules() gives"
                f" them){hint}"
            )
        out[id(modules[within[0]])] = name
    return out


def _check_outermost(named: dict[int, str], found: list[tuple[str, nn.Module]]) -> None:
    """Every module named is a block found, not inside another (a checkpoint inside a checkpoint recomputes twice).

    Raises:
        ValueError: a module named inside another block, naming both."""
    blocks = {id(m) for _, m in found}
    for key, given in named.items():
        if key not in blocks:
            inner = next(q for q, m in _descendants(found) if id(m) == key)
            outer = next(q for q, _ in found if inner.startswith(f"{q}."))
            raise ValueError(
                f"`units`: {given!r} lies inside the block {outer!r}, which is checkpointed whole; name one of them"
            )


def _descendants(found: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    return [(f"{name}.{q}", m) for name, block in found for q, m in block.named_modules() if q]
