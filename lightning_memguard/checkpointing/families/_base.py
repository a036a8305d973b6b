"""What the checkpointing wing may know about one model family: the base every adapter overrides, and small helpers.

An adapter only describes (modules, names, keyword arguments); it imports nothing of this library's that changes a
model, and no library of its family that the user has not imported (:func:`loaded`)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any, ClassVar, NamedTuple

from torch import nn

Named = tuple[str, nn.Module]
"""A submodule and its name (relative to the module it was asked about)."""

FOREIGN_WRAPPERS = ("CheckpointWrapper", "ActivationWrapper", "OffloadWrapper")
"""Class names of other libraries' checkpointing wrappers (PyTorch's distributed ``checkpoint_wrapper`` family)."""


@dataclass(frozen=True)
class Stem:
    """Modules a model calls one after another on its input, nothing else between them, right before the block
    named ``before``: one link of the chain, checkpointed on its own. Where they are a convolution, a BatchNorm, an
    in-place ReLU and a max-pooling (a ResNet's), the rebuild may rebuild the ReLU's output."""

    modules: tuple[Named, ...]
    before: str


class Tail(NamedTuple):
    """How a residual block ends: ``activation(norm(.) + shortcut)``, added to in place and activated in place, where
    ``shortcut`` is the block's input (None) or the output of the shortcut's last module (``shortcut``, a norm layer
    that runs after ``norm``)."""

    norm: nn.Module
    activation: nn.Module
    shortcut: nn.Module | None


class Unit(NamedTuple):
    """A convolution, a norm layer and an activation (None without one): a module's children, run one after another
    by its forward (``nn.Sequential``'s)."""

    conv: nn.Module
    norm: nn.Module
    activation: nn.Module | None


class Family:
    """One model family's layout, as checkpointing and the rebuild need it. Every method has a default meaning
    "nothing known": an adapter overrides what its family has.

    Model-level answers (:meth:`claims`, then :meth:`blocks`, :meth:`stem`, :meth:`following`,
    :meth:`while_checkpointed`, :meth:`refusal`, :meth:`switched_on`) are asked of the outermost modules the adapter
    claims. Block-level answers (:meth:`norm_activations`, :meth:`tail`, :meth:`unit`, :meth:`checkpointed_by_family`)
    are asked of any module, in a claimed model or not, and are None (or False) for modules that are not the family's.

    Names returned are relative to the module asked about.
    """

    name: ClassVar[str] = ""
    """Who the family is, for messages: ``"timm ResNet"``."""
    rebuilds: ClassVar[str] = ""
    """What of the family the rebuild takes, for the error where a model has nothing it takes ("" for nothing)."""

    def claims(self, module: nn.Module) -> bool:
        """Whether ``module`` is a model of this family whose layout the model-level answers describe. An adapter
        that describes the model's forward (a stem, what follows a block) claims only models that run the family's
        own forward; one that names blocks only may claim subclasses too."""
        return False

    def blocks(self, module: nn.Module) -> list[Named]:
        """The blocks to checkpoint in a claimed model, in the order they run (empty: structure decides)."""
        return []

    def refusal(self, module: nn.Module) -> str | None:
        """Why a claimed model must not be checkpointed by block (its own declaration), or None."""
        return None

    def stem(self, module: nn.Module) -> Stem | None:
        """A claimed model's stem, where it is a link of its own."""
        return None

    def following(self, module: nn.Module) -> dict[int, nn.Module]:
        """What runs next on a block's output in a claimed model, by ``id`` of the block, where ``nn.Sequential``
        order does not say it (the next stage's first block, the pooling after the last)."""
        return {}

    def while_checkpointed(self, module: nn.Module) -> list[tuple[nn.Module, dict[str, Any]]]:
        """Modules of a claimed model whose forward must get these keyword arguments while it trains with blocks
        inside it checkpointed (a Hugging Face model's ``use_cache=False``)."""
        return []

    def switched_on(self, module: nn.Module) -> bool:
        """Whether the family's own switch is on in a claimed model (timm's ``set_grad_checkpointing()``): it
        checkpoints the model's blocks already, and they are left alone."""
        return False

    def checkpointed_by_family(self, module: nn.Module) -> bool:
        """Whether the family's own switch checkpoints this block already (a Hugging Face layer after
        ``gradient_checkpointing_enable()``): it is then left alone."""
        return False

    def norm_activations(self, module: nn.Module) -> tuple[tuple[nn.Module, nn.Module], ...] | None:
        """For one of the family's residual blocks: each norm layer whose output goes straight to an activation (the
        rebuild's candidates), with that activation; None for any other module."""
        return None

    def tail(self, module: nn.Module) -> Tail | None:
        """For one of the family's residual blocks with the family's own forward: how its output is made."""
        return None

    def unit(self, module: nn.Module) -> Unit | None:
        """For one of the family's convolution-norm-activation units: its parts."""
        return None


def loaded(name: str) -> ModuleType | None:
    """A module of a library the user's process has imported, else None: a model cannot be of a library that was
    never imported, and this library does not import timm or transformers itself (seconds each)."""
    return sys.modules.get(name)


def original_class(module: nn.Module) -> type[nn.Module]:
    """The class ``module`` had before this library put its mixins in front (``wrap.swapped_class``)."""
    cls = type(module)
    while "_memguard_original" in cls.__dict__:
        cls = cls.__dict__["_memguard_original"]
    return cls


def foreign_wrapper(module: nn.Module) -> bool:
    """Whether ``module`` is another library's checkpointing wrapper."""
    return type(module).__name__ in FOREIGN_WRAPPERS


def composite(module: nn.Module) -> bool:
    """Whether ``module`` has submodules of its own (a block, or a wrapper around one; not an ``nn.Identity``)."""
    return next(iter(module.children()), None) is not None


def elements(prefix: str, container: nn.Module) -> list[Named]:
    """The composite children of ``container`` (an ``nn.Sequential`` or ``nn.ModuleList`` of blocks), named
    ``<prefix>.<index>``."""
    return [(f"{prefix}.{name}", child) for name, child in container.named_children() if composite(child)]


def flagged(*modules: nn.Module) -> bool:
    """Whether timm's own switch (``set_grad_checkpointing``) is on in any of ``modules`` (``grad_checkpointing``)."""
    return any(getattr(module, "grad_checkpointing", False) is True for module in modules)


def stock(module: nn.Module, cls: type, *methods: str) -> bool:
    """Whether ``module`` is a ``cls`` whose ``methods`` are ``cls``'s own (not overridden by a subclass)."""
    own = type(module)
    return isinstance(module, cls) and all(getattr(own, m, None) is getattr(cls, m, None) for m in methods)


def stage_successors(stages: list[Any]) -> dict[int, nn.Module]:
    """What follows each stage's last block (stages are ``nn.Sequential``): the next stage's first."""
    after: dict[int, nn.Module] = {}
    for a, b in zip(stages, stages[1:], strict=False):
        if len(a) and len(b):
            after[id(a[-1])] = b[0]
    return after


def staged_blocks(module: nn.Module, stages: str) -> list[Named]:
    """The blocks of every stage of ``module.<stages>``, each stage holding them in ``.blocks`` (timm's layout)."""
    container: Any = module.get_submodule(stages)
    return [
        block
        for name, stage in container.named_children()
        for block in elements(f"{stages}.{name}.blocks", stage.blocks)
    ]


def switched_parts(model: nn.Module, blocks: list[Named]) -> list[Named]:
    """``blocks`` with the parts of ``model`` that timm's own switch checkpoints and they do not hold: a module inside
    the model with a switch of its own (a ``grad_checkpointing`` attribute) that checkpoints its ``stages`` or
    ``blocks`` (a hybrid ViT's convolutional stem, as VitaMin's ``MbConvStages``): their elements, in the order the
    model registers them."""
    names = {name for name, _ in blocks}
    inside = tuple(f"{name}." for name in names)
    extra: set[str] = set()
    for name, module in model.named_modules():
        if not name or name in names or name.startswith(inside) or "grad_checkpointing" not in vars(module):
            continue
        for part in ("stages", "blocks"):
            container = getattr(module, part, None)
            if isinstance(container, nn.Sequential | nn.ModuleList):
                extra.update(n for n, _ in elements(f"{name}.{part}", container))
                break
    if not extra:
        return blocks
    chosen = names | extra
    return [(name, module) for name, module in model.named_modules() if name in chosen]
