"""Which modules of a model the rebuild takes, as :class:`~.wrap.Swap` records for :mod:`.surgery` to make: ResNet
stems, residual blocks and convolution-norm-activation units of the stock layers it knows (:func:`rebuild_swaps`);
and, after every change, which rebuilt blocks rebuild their own output too (:func:`output_tails`) and which modules
save a rebuilt unit's output as its recipe (:func:`recipe_takers`), read together (:func:`linked_outputs`).

What the model's blocks, stems, tails and units are, and what runs after a module, the model's map says
(:class:`~.model_map.ModelMap`, its adapters' answers read once); this module decides which layer types the rebuild
knows (``nn.BatchNorm2d``, an in-place ``nn.ReLU``; for units also ReLU6, SiLU and Hardswish:
:data:`.rebuild.ACTIVATIONS`). The mixins are :mod:`.rebuild`'s.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

from lightning_memguard.checkpointing.model_map import ModelMap
from lightning_memguard.checkpointing.rebuild import (
    ACTIVATIONS,
    RebuiltBatchNormReLU,
    RebuiltConvNormActivation,
    RebuiltStemPool,
    RebuiltStemReLU,
)
from lightning_memguard.checkpointing.recipes import RebuildConfig
from lightning_memguard.checkpointing.wrap import Link, Swap, is_checkpointed


def unit_parts(module: nn.Module, model_map: ModelMap) -> tuple[nn.Module, nn.BatchNorm2d, nn.Module | None] | None:
    """The convolution, BatchNorm and activation (None without one) of a convolution-norm-activation unit that an
    adapter of :mod:`.families` describes (torchvision's Conv2dNormActivation), when they are layers the rebuild
    knows: an ``nn.Conv2d``, an ``nn.BatchNorm2d``, then an in-place ``nn.ReLU``, an ``nn.ReLU6``, ``nn.SiLU`` or
    ``nn.Hardswish``, or nothing (None otherwise)."""
    parts = model_map.conv_units.get(id(module))
    if parts is None or not isinstance(parts.conv, nn.Conv2d) or type(parts.norm) is not nn.BatchNorm2d:
        return None
    act = parts.activation
    if act is not None and (type(act) not in ACTIVATIONS or (type(act) is nn.ReLU and not act.inplace)):
        return None
    return parts.conv, parts.norm, act  # type: ignore[return-value]


def _outside_checkpoints(model: nn.Module) -> Iterator[nn.Module]:
    """The modules of ``model`` that are neither checkpointed nor inside a checkpointed one (a checkpoint recomputes
    those whole), each once, parents before children."""
    seen: set[int] = set()
    stack = [model]
    while stack:
        module = stack.pop()
        if id(module) in seen or is_checkpointed(module):
            continue
        seen.add(id(module))
        yield module
        stack.extend(reversed(list(module.children())))


def stem_modules(model: nn.Module, model_map: ModelMap) -> tuple[nn.Module, nn.Module, nn.Module] | None:
    """The stem's BatchNorm, ReLU and max-pooling of a model whose adapter names a stem (torchvision's and timm's
    ResNets), when they are the stock layers the stem rebuild knows (None otherwise)."""
    stem = model_map.stems.get(id(model))
    if stem is None or len(stem.modules) != 4:
        return None
    parts: tuple[nn.Module, nn.Module, nn.Module] = tuple(m for _, m in stem.modules[1:])  # type: ignore[assignment]
    return parts if stem_rebuildable(*parts) else None


def stem_rebuildable(bn: nn.Module, relu: nn.Module, pool: nn.Module) -> bool:
    """Whether a stem's norm layer, activation and pooling are the layers the stem rebuild knows."""
    return type(bn) is nn.BatchNorm2d and isinstance(relu, nn.ReLU) and isinstance(pool, nn.MaxPool2d)


def stem_swaps(bn: nn.Module, relu: nn.Module, pool: nn.Module, config: RebuildConfig) -> list[Swap]:
    """What rebuilding a ResNet stem's ReLU output takes (empty if the stem is not the stock layers, is rebuilt
    already or is checkpointed)."""
    if not stem_rebuildable(bn, relu, pool) or isinstance(relu, RebuiltStemReLU):
        return []
    if any(is_checkpointed(m) for m in (bn, relu, pool)):
        return []
    return [
        Swap(relu, RebuiltStemReLU, {"memguard_bn": bn, "memguard_rebuild": config}),  # a plain reference to bn
        Swap(pool, RebuiltStemPool, {}),
    ]


def block_swaps(module: nn.Module, config: RebuildConfig, model_map: ModelMap) -> list[Swap]:
    """What rebuilding a block's BatchNorm + ReLU outputs takes (empty if it is not a block the rebuild knows, is
    rebuilt already or is checkpointed: a checkpointed block is recomputed whole in backward already)."""
    bns = _eligible(module, model_map)
    if bns is None or isinstance(module, RebuiltBatchNormReLU) or is_checkpointed(module):
        return []
    return [Swap(module, RebuiltBatchNormReLU, {"memguard_bns": bns, "memguard_rebuild": config})]  # plain references


def unit_swaps(module: nn.Module, config: RebuildConfig, model_map: ModelMap) -> list[Swap]:
    """What rebuilding a Conv2dNormActivation's BatchNorm and activation outputs takes (empty if it is not a unit
    the rebuild knows, see :func:`unit_parts`, is rebuilt already or is checkpointed)."""
    if (
        isinstance(module, RebuiltConvNormActivation)
        or is_checkpointed(module)
        or unit_parts(module, model_map) is None
    ):
        return []
    return [Swap(module, RebuiltConvNormActivation, {"memguard_rebuild": config})]


def rebuild_swaps(module: nn.Module, config: RebuildConfig, model_map: ModelMap) -> list[Swap]:
    """What rebuilding ``module`` and everything in it that is not checkpointed (a checkpoint recomputes what is
    inside it whole) takes: the swaps of each torchvision ResNet stem, each BasicBlock or Bottleneck and each
    Conv2dNormActivation (and the same of other families, as the model's map says), made by
    :func:`.surgery.apply`. A new kind of block is taught here: a mixin in :mod:`.rebuild`, a function like
    :func:`block_swaps`, and one line below; a new family whose blocks have the same shape needs only its adapter."""
    swaps: list[Swap] = []
    for sub in _outside_checkpoints(module):
        stem = stem_modules(sub, model_map)
        if stem is not None:
            swaps += stem_swaps(*stem, config)
        swaps += block_swaps(sub, config, model_map)
        swaps += unit_swaps(sub, config, model_map)
    return swaps


def rebuildable(module: nn.Module, model_map: ModelMap) -> bool:
    """Whether :func:`.surgery.rebuild_bn_relu` applies to this block: a residual block (torchvision's or timm's
    BasicBlock or Bottleneck) with ``nn.BatchNorm2d`` layers each followed by an in-place ``nn.ReLU``, or a module
    that is or holds a convolution-norm-activation unit it knows (see :func:`unit_parts`)."""
    return _eligible(module, model_map) is not None or any(
        unit_parts(m, model_map) is not None for m in module.modules()
    )


def can_rebuild(link: Link, model_map: ModelMap) -> bool:
    """Whether the rebuild takes anything in ``link``: a ResNet stem of the stock layers, a block it knows, or a
    convolution-norm-activation unit inside it."""
    if link.stem:
        return len(link.modules) == 4 and stem_rebuildable(*(m for _, m in link.modules[1:]))
    return any(rebuildable(m, model_map) for _, m in link.modules)


def _in_place_relu(module: nn.Module) -> bool:
    return type(module) is nn.ReLU and module.inplace  # type: ignore[return-value]


def _eligible(module: nn.Module, model_map: ModelMap) -> tuple[nn.Module, ...] | None:
    """The BatchNorms whose ReLU outputs can be rebuilt in a residual block an adapter of :mod:`.families` describes
    (torchvision's or timm's BasicBlock or Bottleneck): every one of its norm layers that feeds an activation is an
    ``nn.BatchNorm2d`` (not a frozen or other norm layer), each followed by an in-place ``nn.ReLU``."""
    pairs = model_map.norm_activations.get(id(module))
    if not pairs or not all(type(bn) is nn.BatchNorm2d and _in_place_relu(act) for bn, act in pairs):
        return None
    return tuple(bn for bn, _ in pairs)


def _tail(block: nn.Module, model_map: ModelMap) -> tuple[nn.Module, nn.Module | None] | None:
    """For a residual block with its family's forward (see :meth:`.families.Family.tail`), whose output is its last
    BatchNorm's, added to in place and made non-negative in place by an in-place ReLU: that BatchNorm and its
    shortcut's (None without one)."""
    tail = model_map.tails.get(id(block))
    if tail is None or type(tail.norm) is not nn.BatchNorm2d or not _in_place_relu(tail.activation):
        return None
    if tail.shortcut is not None and type(tail.shortcut) is not nn.BatchNorm2d:
        return None
    return tail.norm, tail.shortcut


def _keeps_nothing(module: nn.Module) -> bool:
    """Whether ``module`` keeps nothing of its input for backward: average pooling to one value per channel."""
    return type(module) is nn.AdaptiveAvgPool2d and module.output_size in (1, (1, 1))


def _takes_recipes(module: nn.Module | None, model_map: ModelMap) -> bool:
    """Whether a block's output may be saved as a recipe, given what runs next on it: a rebuilt block (not
    checkpointed, with its family's forward, which does not change its input in place), or a module that keeps
    nothing of it."""
    if isinstance(module, RebuiltBatchNormReLU):
        return not is_checkpointed(module) and _tail(module, model_map) is not None
    return module is not None and _keeps_nothing(module)


Tails = list[tuple[nn.Module, tuple[nn.Module, nn.Module | None] | None]]
"""Each rebuilt block and what its output is rebuilt from (None: it keeps its output), as :func:`output_tails` says."""


def linked_outputs(model_map: ModelMap) -> tuple[Tails, list[nn.Module]]:
    """How the rebuilt outputs are linked as the model is now, read together after every change for
    :mod:`.surgery` to make: each rebuilt block's tail (:func:`output_tails`) and the modules that save a unit's
    output as its recipe (:func:`recipe_takers`)."""
    return output_tails(model_map), recipe_takers(model_map)


def output_tails(model_map: ModelMap) -> Tails:
    """For each rebuilt block of the model, what its output is rebuilt from (``memguard_tail``: its last BatchNorm
    and its shortcut's or None), or None where it keeps its output.

    A block's output, ``relu(last_bn(.) + shortcut)``, is rebuilt where the block after it is rebuilt and not
    checkpointed (it then saves that output as a recipe too), and in a ResNet the last block's, which the average
    pooling does not keep. Rebuilding a stage's outputs in backward needs the one before, back to the
    stage's first block, whose shortcut has its own BatchNorm: they are built in turn and each is let go after its
    last use. A block whose output goes anywhere else keeps it. Depends on which blocks are rebuilt or checkpointed:
    :func:`.surgery.link_outputs` sets it after every change.
    """
    after = model_map.following
    out: Tails = []
    for module in model_map.model.modules():
        if isinstance(module, RebuiltBatchNormReLU):
            tail = _tail(module, model_map) if not is_checkpointed(module) else None  # a checkpoint recomputes it whole
            takes = tail is not None and _takes_recipes(after.get(id(module)), model_map)
            out.append((module, tail if takes else None))
    return out


def _taker(module: nn.Module | None, model_map: ModelMap) -> nn.Module | None:
    """The module to mark :class:`.rebuild.TakesRecipes` when ``module`` runs next on a rebuilt unit's output: the first
    element of a plain ``nn.Sequential``; none if it is a rebuilt unit or holds one (those take recipes already), is
    checkpointed or wrapped by other code (it keeps its input anyway), or keeps nothing of its input."""
    if module is not None:
        module = model_map.first_called.get(id(module), module)
    if module is None or isinstance(module, RebuiltBatchNormReLU | nn.ModuleList):
        return None
    if is_checkpointed(module) or id(module) in model_map.wrapped or _keeps_nothing(module):
        return None
    return None if any(isinstance(m, RebuiltConvNormActivation) for m in module.modules()) else module


def recipe_takers(model_map: ModelMap) -> list[nn.Module]:
    """The modules of the model that are to be :class:`.rebuild.TakesRecipes`: for each rebuilt unit outside
    checkpoints, the module that runs next on its output, where the model's structure says so and :func:`_taker`
    finds one. Depends on which units are rebuilt and what is checkpointed: :func:`.surgery.link_outputs` follows it
    after every change."""
    after = model_map.following
    takers: dict[int, nn.Module] = {}
    for module in _outside_checkpoints(model_map.model):
        if isinstance(module, RebuiltConvNormActivation):
            taker = _taker(after.get(id(module)), model_map)
            if taker is not None:
                takers[id(taker)] = taker
    return list(takers.values())
