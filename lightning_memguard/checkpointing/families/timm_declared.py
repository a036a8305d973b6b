"""Any other timm model: its blocks as timm's own switch checkpoints them, and as the model declares them
(``group_matcher``) where the switch does not reach.

What ``set_grad_checkpointing`` checkpoints is read from the model's forward (:mod:`.timm_switch`): whole stages where
the forward checkpoints its stages (RepViT, LeViT, DaViT, the ByobNets), every element of a DPN's ``features`` (its
stem too), the blocks of each stage where the stages checkpoint them. Every block checkpointed then keeps no more
for backward than the switch (checkpointing the blocks inside a stage that the switch checkpoints whole keeps every
block's input, not only the stage's).

Every model timm ships also says how its parameters group into a stem, blocks and a head: ``group_matcher(coarse=
False)`` maps parameter names to ordered groups, one per block, which timm uses for layer-wise learning-rate decay.
A declared block is the module that holds one group's parameters (their longest common module path): RegNet's
``s1.b1``, DenseNet's dense layers, DLA's levels, HRNet's stages. Groups of the stem (the matcher's ``stem`` keys) are
left out, as timm's own switch leaves the stem; so is a single leaf module (a final norm layer), and a head that
pools first (:func:`pools_first`). A group whose module path holds other groups' blocks (a stage whose downsampling
shares its first block's group, parameters left over in the model itself) gives the parts of it that hold its
parameters instead; a container that is never called (an ``nn.ModuleList`` of branches) gives its composite
elements. The blocks are the outermost of both: a declared block inside one of the switch's units gives way to it,
one that holds units stays (it keeps less). The families with an adapter of their own (ResNet, ConvNeXt, ViT, Swin,
EfficientNet) are claimed before this one, and a model where neither names a block is found by structure."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from torch import nn

from lightning_memguard.checkpointing.families._base import (
    Family,
    Named,
    composite,
    elements,
    flagged,
    loaded,
    switched_parts,
)
from lightning_memguard.checkpointing.families.timm_switch import switch_units


def _stem_patterns(matcher: Any) -> list[re.Pattern[str]]:
    """The regular expressions of a dict matcher's stem keys (``stem``, ``stem1``, ...)."""
    if not isinstance(matcher, dict):
        return []
    patterns: list[re.Pattern[str]] = []
    for key, value in matcher.items():
        if not str(key).startswith("stem"):
            continue
        for entry in value if isinstance(value, list | tuple) else [value]:
            text = entry[0] if isinstance(entry, tuple) else entry
            if isinstance(text, str):
                patterns.append(re.compile(text))
    return patterns


def pools_first(module: nn.Module) -> bool:
    """Whether ``module`` is a head that pools its input first (its first submodule a global pooling: timm's
    ``SelectAdaptivePool2d``, ``nn.AdaptiveAvgPool2d(1)``): checkpointed, it keeps the feature map it pools, where
    left alone its pooling keeps nothing of it and what follows keeps the pooled features only."""
    first = next(iter(module.children()), None)
    if first is None:
        return False
    layers = loaded("timm.layers")
    if layers is not None and isinstance(first, layers.SelectAdaptivePool2d):
        return not first.is_identity()
    adaptive = (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d)
    return isinstance(first, adaptive) and first.output_size in (1, (1, 1))


def _common_path(names: list[str]) -> str:
    """The longest module path that every name lies in (``""`` for the model itself)."""
    parts = [name.split(".") for name in names]
    common: list[str] = []
    for level in zip(*parts, strict=False):
        if any(p != level[0] for p in level):
            break
        common.append(level[0])
    return ".".join(common)


def declared_blocks(model: nn.Module, group_modules: Callable[..., dict[Any, list[str]]]) -> list[Named]:
    """The blocks of a timm model from its ``group_matcher``, in the order the model registers them (see the module's
    docstring); ``group_modules`` is timm's grouping of module names by a matcher."""
    matcher = model.group_matcher(coarse=False)  # type: ignore[operator]
    stem = _stem_patterns(matcher)
    groups = [
        members
        for members in group_modules(model, matcher).values()
        if members and not (stem and all(any(p.match(m) for p in stem) for m in members))
    ]
    owner = {member: i for i, members in enumerate(groups) for member in members}
    modules = dict(model.named_modules())

    def holder(i: int) -> str:
        """The module path that holds group ``i``: its members' common path, climbing from a leaf (a block whose
        only parameters are one convolution's) while no other group's parameters lie in the parent."""
        path = _common_path(groups[i])
        while path and not composite(modules[path]):
            parent = path.rpartition(".")[0]
            if any(owner[m] != i for m in owner if m.startswith(f"{parent}.")) or not parent:
                break
            path = parent
        return path

    paths_held = [holder(i) for i in range(len(groups))]
    held = set(paths_held)
    paths: set[str] = set()

    def place(path: str, members: list[str]) -> None:
        """``members`` lie in ``path``: it is their block, unless other groups' blocks lie in it too (a stage whose
        downsampling is grouped with its first block): then each part of it that holds members is placed."""
        if path and not any(other.startswith(f"{path}.") for other in held):
            block = modules.get(path)
            if block is None or not composite(block):
                return
            if isinstance(block, nn.ModuleList | nn.ModuleDict):  # never called itself: its elements are
                paths.update(name for name, _ in elements(path, block))
            else:
                paths.add(path)
            return
        depth = len(path.split(".")) if path else 0
        parts: dict[str, list[str]] = {}
        for member in members:
            names = member.split(".")
            if len(names) > depth:
                parts.setdefault(".".join(names[: depth + 1]), []).append(member)
        for part, inside in parts.items():
            place(part, inside)

    for path, members in zip(paths_held, groups, strict=True):
        place(path, members)
    outermost = {p for p in paths if not any(p.startswith(f"{q}.") for q in paths)}
    return [(name, module) for name, module in model.named_modules() if name in outermost]


def merged(units: list[Named], declared: list[Named], model: nn.Module) -> list[Named]:
    """The outermost of what timm's own switch checkpoints (``units``) and the declared blocks, in the order ``model``
    registers them: a declared block inside a unit gives way to it, one holding units (coarser) stays."""
    chosen = {name for name, _ in units} | {name for name, _ in declared}
    outermost = {n for n in chosen if not any(n.startswith(f"{o}.") for o in chosen)}
    return [(name, module) for name, module in model.named_modules() if name in outermost]


class TimmDeclared(Family):
    name = "timm (declared blocks)"

    def claims(self, module: nn.Module) -> bool:
        timm_models = loaded("timm.models")
        return (
            timm_models is not None
            and type(module).__module__.startswith("timm.models.")
            and (callable(getattr(module, "group_matcher", None)) or "grad_checkpointing" in vars(module))
            and hasattr(timm_models, "group_modules")
        )

    def blocks(self, module: nn.Module) -> list[Named]:
        timm_models = loaded("timm.models")
        try:
            declared = (
                declared_blocks(module, timm_models.group_modules)  # type: ignore[union-attr]
                if callable(getattr(module, "group_matcher", None))
                else []
            )
            declared = [(name, block) for name, block in declared if not pools_first(block)]
            return switched_parts(module, merged(switch_units(module), declared, module))
        except (TypeError, ValueError, AttributeError, KeyError, re.error):  # a declaration not understood: structure
            return []

    def switched_on(self, module: nn.Module) -> bool:
        return flagged(module, *module.modules())
