"""The one entrance that changes a model: every class swap, and every attribute this library puts on a module.

:func:`apply` undoes what an earlier call applied (``replacing``), checkpoints runs of links, rebuilds the links
left unchecked, and re-links outputs (which block outputs can be rebuilt depends on what is checkpointed), in that
order; if anything raises part-way, every module gets back its class and attributes as they were before the call.
:func:`remove_checkpointing` and :func:`remove_rebuild` take this library's mixins off a model; what a mixin's
module carries goes with its last mixin (:data:`ATTRIBUTES` says which). The other modules describe: ``wrap`` the
checkpointing mixins and a model's links, ``rebuild`` the rebuild's mixins and ``rebuild_targets`` which modules get
them (:class:`.wrap.Swap`); this module makes the changes. Which modules are what it reads from the model's map
(:class:`~.model_map.ModelMap`), made once by a plan's entrance.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from lightning_memguard.checkpointing.model_map import ModelMap, map_model
from lightning_memguard.checkpointing.rebuild import (
    RebuildMixin,
    RebuiltBatchNormReLU,
    RebuiltConvNormActivation,
    RebuiltStemReLU,
    TakesRecipes,
)
from lightning_memguard.checkpointing.rebuild_targets import (
    Tails,
    linked_outputs,
    rebuild_swaps,
    stem_swaps,
)
from lightning_memguard.checkpointing.recipes import DEFAULT_CONFIG, RebuildConfig
from lightning_memguard.checkpointing.wrap import (
    CheckpointedMember,
    CheckpointedUnit,
    GraphSplit,
    Link,
    RunOutput,
    Swap,
    SwappedModule,
    TrainingKeywords,
    is_checkpointed,
    keyword_positions,
    swap_chain,
    swapped_class,
)

ATTRIBUTES: dict[str, tuple[type[SwappedModule], ...]] = {
    # on a checkpointed run's head: whether recomputation leaves BatchNorm running statistics alone (a bool)
    "memguard_bn_correct": (CheckpointedUnit,),
    # on a checkpointed run's head: the run's first link's name (a str), for its errors
    "memguard_name": (CheckpointedUnit,),
    # on the head of a run of more than one module: the run's other modules, in order (plain references)
    "memguard_run": (CheckpointedUnit,),
    # on the head and members of such a run: the RunOutput they share (the head's last output, weakly held)
    "memguard_output": (CheckpointedUnit, CheckpointedMember),
    # on a rebuilt block: the BatchNorms (each followed by an in-place ReLU) whose outputs are saved as recipes
    "memguard_bns": (RebuiltBatchNormReLU,),
    # on a rebuilt block whose own output is rebuilt too: its last BatchNorm and its shortcut's (or None); set and
    # cleared by link_outputs after every change
    "memguard_tail": (RebuiltBatchNormReLU,),
    # on a rebuilt ResNet stem's ReLU: the stem's BatchNorm (a plain reference)
    "memguard_bn": (RebuiltStemReLU,),
    # on rebuilt blocks, stem ReLUs and Conv2dNormActivation units: the RebuildConfig their recipes follow
    "memguard_rebuild": (RebuiltBatchNormReLU, RebuiltStemReLU, RebuiltConvNormActivation),
    # on a container of checkpointed blocks that begins a compiled graph of its own: its module name (a str)
    "memguard_split": (GraphSplit,),
    # on a module whose forward gets keyword arguments while blocks inside it are checkpointed (a Hugging Face base
    # model: use_cache=False): (name, position, value) each; set and cleared by link_switches after every change
    "memguard_keywords": (TrainingKeywords,),
}
"""Every attribute this library puts in a module's ``__dict__``, and the mixins that carry it: it is set only with
one of them and goes when the module's last one does. Teaching the rebuild a new block type adds its lines here.
Mixins that carry none: :class:`.wrap.CheckpointedMember` outside a run, :class:`.rebuild.RebuiltStemPool` and
:class:`.rebuild.TakesRecipes` (given and taken by :func:`link_outputs`). Nothing else is put on a module: a rebuilt
unit's in-place activation runs out of place for one call (its own ``inplace`` flag, set back when the call ends),
and which tensors have recipes is kept beside the model (``recipes._RECIPES``, weakly, with each tensor's version)."""

CHECKPOINT: tuple[type[SwappedModule], ...] = (CheckpointedUnit, CheckpointedMember, GraphSplit, TrainingKeywords)
"""The checkpointing mixins (a graph split and a family's keyword arguments go with them)."""
REBUILD: tuple[type[SwappedModule], ...] = (RebuildMixin,)
"""The rebuild's mixins (each a subclass of this)."""


@dataclass(frozen=True)
class Applied:
    """What one :func:`apply` really changed.

    Attributes:
        runs: the runs of links checkpointed, by link name (runs left alone are not here).
        rebuilt: the links in which something was rebuilt.
        splits: the containers of checkpointed blocks that begin a compiled graph of their own (``split_graphs``).
        swaps: every (module, mixin) given, in order: what a later ``apply(replacing=...)`` undoes.
    """

    runs: list[list[str]] = field(default_factory=list)
    rebuilt: list[str] = field(default_factory=list)
    splits: list[str] = field(default_factory=list)
    swaps: list[tuple[nn.Module, type[SwappedModule]]] = field(default_factory=list, repr=False)

    @property
    def checkpointed(self) -> list[str]:
        """The links checkpointed, in the order of their runs."""
        return [name for run in self.runs for name in run]

    def units(self, kinds: tuple[type[SwappedModule], ...]) -> int:
        """How many units (checkpoints, rebuilt blocks and stems) of these kinds were made."""
        return sum(issubclass(mixin, kinds) and mixin.memguard_unit for _, mixin in self.swaps)


def apply(
    model_map: ModelMap,
    runs: Sequence[Sequence[Link]] = (),
    rebuilt: Sequence[Link] = (),
    *,
    bn_correct: bool = True,
    config: RebuildConfig = DEFAULT_CONFIG,
    replacing: Applied | None = None,
    split_graphs: bool = False,
) -> Applied:
    """Change the model of ``model_map`` in place: undo ``replacing`` (an earlier call's changes), checkpoint each run
    of links (one checkpoint per run), rebuild BatchNorm + ReLU outputs (and Conv2dNormActivation units' BatchNorm and
    activation outputs) in the links of ``rebuilt`` that are not checkpointed, and re-link outputs; return what was
    really changed. With ``split_graphs``, where the checkpointed links lie in more than one container below the
    model (a ResNet's stages), each such container begins a compiled graph of its own (:class:`.wrap.GraphSplit`).

    A run with a module already checkpointed, or wrapped by other code (or checkpointed by its family's own switch:
    timm's ``set_grad_checkpointing()``, Hugging Face's ``gradient_checkpointing_enable()``), is left alone, with one
    warning for each kind. If anything raises, the model is as it was before the call (classes and attributes) and the
    error passes. ``model_map`` is the model's map (:class:`~.model_map.ModelMap`: a plan reads it once and hands it
    to every call).
    """
    with restored_on_failure(model_map.model):
        if replacing is not None:
            for module, mixin in reversed(replacing.swaps):
                _take_off(module, (mixin,))
        swaps: list[tuple[nn.Module, type[SwappedModule]]] = []
        done = _checkpoint(runs, bn_correct, swaps, model_map)
        names = []
        for link in rebuilt:
            if link.stem and len(link.modules) == 4:
                _, (_, bn), (_, relu), (_, pool) = link.modules  # conv1, bn1, relu, maxpool
                found = stem_swaps(bn, relu, pool, config)
            elif link.stem:
                found = []
            else:
                found = [swap for _, module in link.modules for swap in rebuild_swaps(module, config, model_map)]
            for swap in found:
                _give(swap, swaps)
            if found:
                names.append(link.name)
        tails, takers = linked_outputs(model_map)  # as the checkpoints and the rebuild leave the model
        # a container of checkpointed links (no rebuild takes it) begins a graph of its own: changes no tail or taker
        splits = _split(model_map, runs, done, swaps) if split_graphs else []
        _link_outputs(model_map.model, tails, takers)
        link_switches(model_map)
        return Applied(runs=done, rebuilt=names, splits=splits, swaps=swaps)


def _checkpoint(
    runs: Sequence[Sequence[Link]],
    bn_correct: bool,
    swaps: list[tuple[nn.Module, type[SwappedModule]]],
    model_map: ModelMap,
) -> list[list[str]]:
    """Checkpoint each run (one checkpoint per run), except those already checkpointed, wrapped by other code, or
    holding a block whose family's own switch checkpoints it (``model_map.switched_on``); return the runs done."""
    done: list[list[str]] = []
    ours: list[str] = []
    theirs: list[str] = []
    for run in runs:
        modules = [module for link in run for _, module in link.modules]
        if any(is_checkpointed(m) for m in modules):
            ours.append(run[0].name)
            continue
        if any(id(m) in model_map.wrapped or id(m) in model_map.switched_on for m in modules):
            theirs.append(run[0].name)
            continue
        head, members = modules[0], modules[1:]
        attributes: dict[str, Any] = {"memguard_bn_correct": bn_correct, "memguard_name": run[0].name}
        if members:
            output = RunOutput()
            attributes.update(memguard_run=tuple(members), memguard_output=output)
        _give(Swap(head, CheckpointedUnit, attributes), swaps)
        for member in members:
            _give(Swap(member, CheckpointedMember, {"memguard_output": output}), swaps)
        done.append([link.name for link in run])
    if ours:
        warnings.warn(
            f"{len(ours)} block(s) are already checkpointed ({ours[0]}, ...); applying twice changes nothing",
            UserWarning,
            stacklevel=4,
        )
    if theirs:
        warnings.warn(
            f"{len(theirs)} block(s) are already wrapped by other code ({theirs[0]}, ...) and are left alone",
            UserWarning,
            stacklevel=4,
        )
    return done


def _split(
    model_map: ModelMap,
    runs: Sequence[Sequence[Link]],
    done: list[list[str]],
    swaps: list[tuple[nn.Module, type[SwappedModule]]],
) -> list[str]:
    """Make each container (below the model) of the checkpointed links begin a compiled graph of its own, where
    there are at least two; return their names."""
    checkpointed = {name for run in done for name in run}
    containers = dict.fromkeys(
        link.modules[0][0].rpartition(".")[0]
        for run in runs
        for link in run
        if link.name in checkpointed and not link.part
    )  # a part's block holds no blocks
    containers.pop("", None)  # the model itself: the graph begins there anyway
    # and one holding another (a wrapped ResNet, whose stem is its own): its graph begins with its first link's
    containers = {c: None for c in containers if not any(other.startswith(c + ".") for other in containers)}
    if len(containers) < 2:  # one container: one graph is enough
        return []
    split = []
    for name in containers:
        module = model_map.model.get_submodule(name)
        if isinstance(module, GraphSplit):  # split already (by an earlier change that was not replaced)
            split.append(name)
        elif isinstance(module, nn.ModuleList | nn.ModuleDict):  # never called: its parent calls the blocks
            continue
        elif not is_checkpointed(module) and id(module) not in model_map.wrapped:
            _give(Swap(module, GraphSplit, {"memguard_split": name}), swaps)
            split.append(name)
    return split


def _give(swap: Swap, swaps: list[tuple[nn.Module, type[SwappedModule]]]) -> None:
    """Put a mixin in front of a module's class and set the attributes it carries."""
    module, mixin, attributes = swap
    for key in attributes:
        if mixin not in ATTRIBUTES.get(key, ()):
            raise RuntimeError(f"{key!r} is not declared for {mixin.__name__} in surgery.ATTRIBUTES")
    module.__class__ = swapped_class(type(module), mixin)
    module.__dict__.update(attributes)  # plain entries: modules among them are references, not submodules
    swaps.append((module, mixin))


def _take_off(module: nn.Module, kinds: tuple[type[SwappedModule], ...]) -> bool:
    """Take the mixins of these kinds out of a module's class, and the attributes no mixin left on it carries;
    whether that took off a unit (a checkpoint's head, a rebuilt block or stem: ``memguard_unit``)."""
    mixins, original = swap_chain(type(module))
    kept = [mixin for mixin in mixins if not issubclass(mixin, kinds)]
    if len(kept) == len(mixins):
        return False
    cls = original
    for mixin in kept:
        cls = swapped_class(cls, mixin)
    module.__class__ = cls
    for key, owners in ATTRIBUTES.items():
        if not any(issubclass(mixin, owners) for mixin in kept):
            module.__dict__.pop(key, None)
    return any(getattr(mixin, "memguard_unit", False) for mixin in mixins if issubclass(mixin, kinds))


@contextlib.contextmanager
def restored_on_failure(model: nn.Module) -> Iterator[None]:
    """If the body raises, every module of ``model`` gets back the class and the :data:`ATTRIBUTES` it had."""
    before = [(m, type(m), {k: m.__dict__[k] for k in ATTRIBUTES if k in m.__dict__}) for m in model.modules()]
    try:
        yield
    except BaseException:
        for module, cls, attributes in before:
            if type(module) is not cls:
                module.__class__ = cls
            for key in ATTRIBUTES:
                module.__dict__.pop(key, None)
            module.__dict__.update(attributes)
        raise


def link_outputs(model: nn.Module) -> int:
    """Set which rebuilt blocks of ``model`` rebuild their own output too (see :func:`.rebuild_targets.output_tails`),
    and which modules save a rebuilt unit's output as its recipe (:class:`.rebuild.TakesRecipes`, see
    :func:`.rebuild_targets.recipe_takers`), giving and taking that mixin, as the model is now (its map read afresh);
    return how many outputs are linked (tails and takers). :func:`apply` and the removals do the same after every
    change, with the map they have."""
    return _link_outputs(model, *linked_outputs(map_model(model)))


def _link_outputs(model: nn.Module, tails: Tails, takers: list[nn.Module]) -> int:
    """Make the links :func:`.rebuild_targets.linked_outputs` described: set or clear each rebuilt block's
    ``memguard_tail``, give the modules that save a unit's recipe their mixin and take it from the others."""
    count = 0
    for module, tail in tails:
        if tail is not None:
            module.__dict__["memguard_tail"] = tail
            count += 1
        else:
            module.__dict__.pop("memguard_tail", None)
    taking = {id(taker) for taker in takers}
    for module in model.modules():
        if id(module) in taking and not isinstance(module, TakesRecipes):
            _give(Swap(module, TakesRecipes, {}), [])
        elif id(module) not in taking and isinstance(module, TakesRecipes):
            _take_off(module, (TakesRecipes,))
    return count + len(taking)


def link_switches(model_map: ModelMap) -> int:
    """Give each module whose forward must get keyword arguments while blocks inside it are checkpointed (as the
    adapters of :mod:`.families` say: a Hugging Face base model's ``use_cache=False``) those arguments
    (:class:`.wrap.TrainingKeywords`) where a block inside it is checkpointed, and take them where none is any more;
    return how many modules have them. :func:`apply` and the removals call it after every change."""
    wanted: dict[int, tuple[nn.Module, dict[str, Any]]] = {}
    for module, keywords in model_map.switches:
        if any(is_checkpointed(m) for m in module.modules()):
            wanted[id(module)] = (module, keywords)
    for module in model_map.model.modules():
        if id(module) not in wanted and isinstance(module, TrainingKeywords):
            _take_off(module, (TrainingKeywords,))
    for module, keywords in wanted.values():
        if not isinstance(module, TrainingKeywords):
            _give(Swap(module, TrainingKeywords, {"memguard_keywords": keyword_positions(module, keywords)}), [])
    return len(wanted)


def _remove(model: nn.Module, kinds: tuple[type[SwappedModule], ...]) -> int:
    with restored_on_failure(model):
        count = sum(_take_off(module, kinds) for module in model.modules())
        model_map = map_model(model)  # what the registry says of the model as the removal left it
        _link_outputs(model, *linked_outputs(model_map))
        link_switches(model_map)
        return count


def remove_checkpointing(model: nn.Module) -> int:
    """Undo checkpointing everywhere in ``model``; return how many checkpoints (blocks or runs) were removed."""
    return _remove(model, CHECKPOINT)


def remove_rebuild(model: nn.Module) -> int:
    """Undo :func:`rebuild_bn_relu` everywhere in ``model``; return how many blocks, stems and units changed back."""
    return _remove(model, REBUILD)


def rebuild_bn_relu(model: nn.Module, *, fused: bool = True, chain_kept: int = 2) -> int:
    """Rebuild BatchNorm + ReLU outputs in backward in every Bottleneck (after bn1 and bn2), BasicBlock (after bn1) and
    ResNet stem (after bn1) of torchvision's or timm's ResNet family in ``model`` that is not checkpointed, and the
    BatchNorm and activation outputs of every torchvision Conv2dNormActivation (:func:`.rebuild_targets.unit_parts`
    says which) not inside a checkpointed module, in place; return how many blocks, stems and units changed. The output
    of a block that feeds another rebuilt block is rebuilt too (see :func:`link_outputs`): in a ResNet, every block's;
    a unit's output is saved as its recipe also by the module that runs next on it.

    ``state_dict`` keys do not change; :func:`remove_rebuild` undoes it.

    Args:
        model: the model, changed in place.
        fused: rebuild each BatchNorm (+ ReLU) output with one Triton kernel pass where it can run (CUDA); False:
            PyTorch's own kernels.
        chain_kept: how many of a stage's earlier outputs are kept while its later ones are rebuilt (see
            :class:`~lightning_memguard.checkpointing.RebuildConfig`).

    Example:
        >>> import torchvision
        >>> rebuild_bn_relu(torchvision.models.resnet50(num_classes=10))  # 16 blocks and the stem
        17
        >>> rebuild_bn_relu(torchvision.models.mobilenet_v2(num_classes=10))  # 35 Conv2dNormActivation units
        35
    """
    config = RebuildConfig(fused=fused, chain_kept=chain_kept)
    return apply(map_model(model), rebuilt=[Link("", (("", model),))], config=config).units(REBUILD)
