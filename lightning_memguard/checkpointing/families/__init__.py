"""What checkpointing knows of model families, one adapter each, in one registry (:data:`FAMILIES`).

An adapter (:class:`Family`) says what a family's blocks are, its stem, the parts the rebuild needs (the norm layers
and activations of a block, its tail, a unit's convolution, norm and activation, what runs after a block) and what
must change while it is checkpointed (keyword arguments of a forward). The rest of the wing asks the functions
below; none of it names a family. A model that no adapter claims is found by structure (``wrap.find_units``).

Adding a family is one module here (a :class:`Family` subclass overriding what the family has) and one entry in
:data:`FAMILIES`. Adapters never import a library the user has not imported (:func:`._base.loaded`).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_memguard.checkpointing.families._base import (
    FOREIGN_WRAPPERS,
    Family,
    Named,
    Stem,
    Tail,
    Unit,
    foreign_wrapper,
    original_class,
)
from lightning_memguard.checkpointing.families.huggingface import HuggingFace
from lightning_memguard.checkpointing.families.timm_convnext import TimmConvNeXt
from lightning_memguard.checkpointing.families.timm_efficientnet import TimmEfficientNet
from lightning_memguard.checkpointing.families.timm_resnet import TimmResNet
from lightning_memguard.checkpointing.families.timm_swin import TimmSwin
from lightning_memguard.checkpointing.families.timm_vit import TimmViT
from lightning_memguard.checkpointing.families.torchvision_conv_norm_act import TorchvisionConvNormActivation
from lightning_memguard.checkpointing.families.torchvision_resnet import TorchvisionResNet, stock_resnet

__all__ = [
    "FAMILIES",
    "FOREIGN_WRAPPERS",
    "Family",
    "Named",
    "Stem",
    "Tail",
    "Unit",
    "blocks",
    "checkpointed_by_family",
    "claimed",
    "family_of",
    "following",
    "foreign_wrapper",
    "norm_activations",
    "original_class",
    "rebuild_description",
    "stems",
    "stock_resnet",
    "switched_on",
    "switches",
    "tail",
    "unit",
]

FAMILIES: tuple[Family, ...] = (
    TorchvisionResNet(),
    TorchvisionConvNormActivation(),
    TimmResNet(),
    TimmConvNeXt(),
    TimmViT(),
    TimmSwin(),
    TimmEfficientNet(),
    HuggingFace(),
)
"""Every adapter, asked in this order (the first that claims a model, or answers for a block, is the one)."""


def family_of(module: nn.Module) -> Family | None:
    """The adapter that claims ``module`` as a model of its family, or None."""
    return next((family for family in FAMILIES if family.claims(module)), None)


def claimed(model: nn.Module) -> list[tuple[str, nn.Module, Family]]:
    """The outermost modules of ``model`` (itself included) that an adapter claims: name, module and adapter, in
    order of registration."""
    found: list[tuple[str, nn.Module, Family]] = []

    def visit(name: str, module: nn.Module) -> None:
        family = family_of(module)
        if family is not None:
            found.append((name, module, family))
            return
        for child_name, child in module.named_children():
            visit(_join(name, child_name), child)

    visit("", model)
    return found


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def blocks(model: nn.Module) -> list[Named] | None:
    """The blocks of the models of known families in ``model`` (named from ``model``), in order; None where no
    adapter claims a part of it or the ones that do name no blocks: structure decides then.

    Raises:
        ValueError: a claimed model refuses checkpointing by block (:meth:`Family.refusal`), quoting why.
    """
    found: list[Named] = []
    for prefix, module, family in claimed(model):
        reason = family.refusal(module)
        if reason is not None:
            raise ValueError(reason)
        found += [(_join(prefix, name), block) for name, block in family.blocks(module)]
    return found or None


def stems(model: nn.Module) -> list[tuple[str, Stem]]:
    """The stems of the claimed models in ``model`` that have one, each with its link's name (``"stem"``, or
    ``"<model>.stem"``) and names from ``model``."""
    out = []
    for prefix, module, family in claimed(model):
        stem = family.stem(module)
        if stem is not None:
            named = tuple((_join(prefix, name), part) for name, part in stem.modules)
            out.append((_join(prefix, "stem"), Stem(named, _join(prefix, stem.before))))
    return out


def stem_of(module: nn.Module) -> Stem | None:
    """The stem of ``module`` if an adapter claims it and it has one (names relative to ``module``)."""
    family = family_of(module)
    return family.stem(module) if family is not None else None


def following(model: nn.Module) -> dict[int, nn.Module]:
    """What runs next on a block's output (by ``id``) in every model of a known family in ``model``, claimed or
    nested, where ``nn.Sequential`` order does not say it."""
    after: dict[int, nn.Module] = {}
    for module in model.modules():
        family = family_of(module)
        if family is not None:
            after.update(family.following(module))
    return after


def switches(model: nn.Module) -> list[tuple[nn.Module, dict[str, Any]]]:
    """The modules of ``model`` whose forward must get keyword arguments while blocks inside them are checkpointed
    (:meth:`Family.while_checkpointed`), with those arguments."""
    return [switch for _, module, family in claimed(model) for switch in family.while_checkpointed(module)]


def _first(method: str, module: nn.Module) -> Any:
    for family in FAMILIES:
        answer = getattr(family, method)(module)
        if answer is not None:
            return answer
    return None


def norm_activations(module: nn.Module) -> tuple[tuple[nn.Module, nn.Module], ...] | None:
    """For a residual block of a known family: its norm layers whose outputs go straight to an activation, each
    with that activation (None for any other module)."""
    return _first("norm_activations", module)  # type: ignore[no-any-return]


def tail(module: nn.Module) -> Tail | None:
    """For a residual block of a known family with its family's forward: how its output is made."""
    return _first("tail", module)  # type: ignore[no-any-return]


def unit(module: nn.Module) -> Unit | None:
    """For a convolution-norm-activation unit of a known family: its parts."""
    return _first("unit", module)  # type: ignore[no-any-return]


def checkpointed_by_family(module: nn.Module) -> bool:
    """Whether a family's own switch checkpoints ``module`` already (a Hugging Face layer)."""
    return any(family.checkpointed_by_family(module) for family in FAMILIES)


def switched_on(model: nn.Module) -> set[int]:
    """The blocks (by ``id``) of the claimed models in ``model`` whose family's own switch is on
    (:meth:`Family.switched_on`): their family checkpoints them already."""
    switched = [(module, family) for _, module, family in claimed(model) if family.switched_on(module)]
    return {id(block) for module, family in switched for _, block in family.blocks(module)}


def rebuild_description() -> str:
    """What the rebuild takes, family by family, for an error message."""
    return " or ".join(family.rebuilds for family in FAMILIES if family.rebuilds)
