"""What checkpointing knows of model families, one adapter each, in one registry (:data:`FAMILIES`).

An adapter (:class:`Family`) says what a family's blocks are, its stem, the parts the rebuild needs (the norm layers
and activations of a block, its tail, a unit's convolution, norm and activation, what runs after a block) and what
must change while it is checkpointed (keyword arguments of a forward). The rest of the wing asks a
:class:`Layout`, made once per plan from the functions below; none of it names a family. A model that no adapter
claims is found by structure (:mod:`.structure`).

Adding a family is one module here (a :class:`Family` subclass overriding what the family has) and one entry in
:data:`FAMILIES`. Adapters never import a library the user has not imported (:func:`._base.loaded`).
"""

from __future__ import annotations

from functools import cached_property
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
from lightning_memguard.checkpointing.families.structure import Units, check_units, names_only, select_blocks
from lightning_memguard.checkpointing.families.timm_convnext import TimmConvNeXt
from lightning_memguard.checkpointing.families.timm_declared import TimmDeclared
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
    "Layout",
    "Named",
    "Stem",
    "Tail",
    "Unit",
    "Units",
    "blocks",
    "check_units",
    "checkpointed_by_family",
    "claimed",
    "family_of",
    "find_units",
    "following",
    "foreign_wrapper",
    "names_only",
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
    TimmDeclared(),  # after the timm families above: any other timm model, by its own declaration
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
    return f"{prefix}.{name}" if prefix and name else prefix or name


def blocks(model: nn.Module, found: list[tuple[str, nn.Module, Family]] | None = None) -> list[Named] | None:
    """The blocks of the models of known families in ``model`` (named from ``model``), in order; None where no
    adapter claims a part of it or the ones that do name no blocks: structure decides then.

    Raises:
        ValueError: a claimed model refuses checkpointing by block (:meth:`Family.refusal`), quoting why, unless
            it names no blocks and wraps models of other families, whose adapters answer for them.
    """
    named: list[Named] = []
    for prefix, module, family in claimed(model) if found is None else found:
        reason = family.refusal(module)
        own = family.blocks(module)
        children = [] if own else list(module.named_children())
        inside = [(_join(name, n), m, f) for name, child in children for n, m, f in claimed(child)]
        if reason is not None and not inside:
            raise ValueError(reason)
        if inside:  # a wrapper of another family's model (Hugging Face's TimmWrapperModel): the models inside it,
            # whose own adapters answer (the wrapper's refusal speaks of the switch it lends: TimmWrapperModel
            # declares none where timm's own switch is missing, as HRNet's and DLA's are)
            own = blocks(module, inside) or []
        named += [(_join(prefix, name), block) for name, block in own]
    return named or None


def stems(model: nn.Module, found: list[tuple[str, nn.Module, Family]] | None = None) -> list[tuple[str, Stem]]:
    """The stems of the claimed models in ``model`` that have one, each with its link's name (``"stem"``, or
    ``"<model>.stem"``) and names from ``model``."""
    out = []
    for prefix, module, family in claimed(model) if found is None else found:
        stem = family.stem(module)
        if stem is not None:
            named = tuple((_join(prefix, name), part) for name, part in stem.modules)
            out.append((_join(prefix, "stem"), Stem(named, _join(prefix, stem.before))))
    return out


def following(model: nn.Module, known: dict[int, Family] | None = None) -> dict[int, nn.Module]:
    """What runs next on a block's output (by ``id``) in every model of a known family in ``model``, claimed or
    nested, where ``nn.Sequential`` order does not say it."""
    after: dict[int, nn.Module] = {}
    for module in model.modules():
        family = family_of(module) if known is None else known.get(id(module))
        if family is not None:
            after.update(family.following(module))
    return after


def switches(found: list[tuple[str, nn.Module, Family]]) -> list[tuple[nn.Module, dict[str, Any]]]:
    """Of the claimed models (:func:`claimed`), the modules whose forward must get keyword arguments while blocks
    inside them are checkpointed (:meth:`Family.while_checkpointed`), with those arguments."""
    return [switch for _, module, family in found for switch in family.while_checkpointed(module)]


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


def switched_on(found: list[tuple[str, nn.Module, Family]]) -> set[int]:
    """The blocks (by ``id``) of the claimed models (:func:`claimed`) whose family's own switch is on
    (:meth:`Family.switched_on`): their family checkpoints them already."""
    switched = [(module, family) for _, module, family in found if family.switched_on(module)]
    return {id(block) for module, family in switched for _, block in family.blocks(module)}


def rebuild_description() -> str:
    """What the rebuild takes, family by family, for an error message."""
    return " or ".join(family.rebuilds for family in FAMILIES if family.rebuilds)


class Layout:
    """What the registry says of one model, asked once and handed on: a plan makes one and every module that plans,
    changes or rebuilds the model asks it (:mod:`..entrances`, :mod:`..measure`, :mod:`..surgery`,
    :mod:`..rebuild`), never the adapters themselves.

    Model-level answers are read when it is made (the modules the adapters claim, their stems, what runs after each
    block, the switches set while checkpointed, the blocks a family's own switch checkpoints already); the blocks
    when first asked (:meth:`blocks`: a family's refusal only matters to ``units="auto"``). A module's own parts (a
    residual block's norm layers and tail, a unit's layers, whether other code wraps it) are its adapter's answer.

    Example:
        >>> import torchvision
        >>> layout = Layout(torchvision.models.resnet18())
        >>> [name for name, _ in layout.stems], len(layout.blocks()), len(layout.following)
        (['stem'], 8, 4)
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.claimed = claimed(model)
        self._families = {id(m): f for m in model.modules() if (f := family_of(m)) is not None}  # claimed or nested
        self.stems = stems(model, self.claimed)
        """Each stem, with its link's name (``"stem"``, or ``"<model>.stem"``) and names from the model."""
        self.following = following(model, self._families)
        """What runs next on a block's output (by ``id``) where ``nn.Sequential`` order does not say it."""
        self.switches = switches(self.claimed)
        """Modules whose forward gets keyword arguments while blocks inside them are checkpointed, with those."""
        self.switched_on = switched_on(self.claimed)
        """The blocks (by ``id``) whose family's own switch checkpoints them already."""

    @cached_property
    def _known(self) -> list[Named] | None:
        return blocks(self.model, self.claimed)

    def blocks(self, units: Any = "auto") -> list[Named]:
        """The blocks ``units`` selects (see :func:`find_units`)."""
        return select_blocks(self.model, units, lambda: self._known)

    def stem_of(self, module: nn.Module) -> Stem | None:
        """The stem of ``module`` if an adapter claims it and it has one (names relative to ``module``)."""
        family = self._families.get(id(module))
        return family.stem(module) if family is not None else None

    def norm_activations(self, module: nn.Module) -> tuple[tuple[nn.Module, nn.Module], ...] | None:
        """See :func:`norm_activations`."""
        return norm_activations(module)

    def tail(self, module: nn.Module) -> Tail | None:
        """See :func:`tail`."""
        return tail(module)

    def unit(self, module: nn.Module) -> Unit | None:
        """See :func:`unit`."""
        return unit(module)

    def wrapped_by_someone_else(self, module: nn.Module) -> bool:
        """Whether another library wraps ``module`` (a known wrapper class, or a forward set on the instance), or its
        family's own switch checkpoints it (a Hugging Face layer after ``gradient_checkpointing_enable()``)."""
        return "forward" in module.__dict__ or foreign_wrapper(module) or checkpointed_by_family(module)


def find_units(model: nn.Module, units: Any = "auto") -> list[Named]:
    """The outermost submodules that ``units`` selects, in order of registration.

    ``"auto"`` asks the adapters of this registry first: where ``model`` is or holds models of known families
    (torchvision's and timm's ResNets, timm's ConvNeXt, ViT / DeiT / EVA, Swin, EfficientNet / MobileNet, Hugging
    Face transformers), their blocks, in order. Else it finds blocks by structure: the classes a model names in
    ``_no_split_modules``, where it declares them; else the outermost modules that repeat (the same class twice or
    more, with submodules of their own) as elements of an ``nn.Sequential`` or ``nn.ModuleList`` chain, nested
    chains flattened, of the classes that carry most of the model's parameters (largest first until more than half,
    and any with at least a tenth of the largest's): a ResNet's Bottlenecks, MobileNet's InvertedResiduals,
    EfficientNet's MBConvs, a transformer's layers, but not a few small heads repeated beside them. Module classes
    or a predicate select the outermost modules they match; module names (``["layer1.0"]``, each as
    ``named_modules()`` gives it, or relative to a module inside ``model`` where that names one module) the modules
    they name.

    Raises:
        TypeError: if ``units`` is of the wrong kind.
        ValueError: if a name in ``units`` names no module (the closest names said), several, or one inside another
            block selected; if nothing in the model matches, or a model of a known family refuses checkpointing (a
            Hugging Face model declaring ``supports_gradient_checkpointing = False``) and ``units`` is ``"auto"``.
    """
    return Layout(model).blocks(units)
