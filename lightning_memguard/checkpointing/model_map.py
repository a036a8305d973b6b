"""The model as one plan sees it, read once (:class:`ModelMap`): its links, their parts, and what the registry says
of its modules.

A plan's entrance (:mod:`.entrances`) makes one map and hands it down: the planners (:mod:`.plan_eager`,
:mod:`.plan_compiled`) plan over its links, :mod:`.surgery` and the rebuild's choices (:mod:`.rebuild_targets`)
read its answers instead of asking :class:`~.families.Layout` again. :func:`model_chain` sees the model as the
planner does: its blocks in order (and a ResNet's stem before its first block), with which neighbours may share a
run; :func:`link_parts` finds the finer links inside each block. Nothing here changes the model.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_memguard.checkpointing.families import Layout, Stem, Tail, Unit, Units, names_only
from lightning_memguard.checkpointing.wrap import Link, plain_sequential


@dataclass(frozen=True, eq=False)
class ModelMap:
    """One model's links and what the registry's :class:`~.families.Layout` says of its modules, read once
    (:func:`map_model`) and handed down; modules are keyed by ``id``, and a module missing from a mapping has no answer.

    Attributes:
        model: the model (its original modules, not a ``torch.compile`` wrapper).
        links: the links to plan over, in order (:func:`model_chain`); empty for a map made without ``units``.
        joinable: for each link but the last, whether it may share a run with the next.
        parts: the finer links inside the links (:func:`link_parts`), each with the index of its link.
        stems: of each model of a known family inside (itself included) that has a stem, the stem (names
            relative to that model).
        following: what runs next on a module's output, where the model's structure says so: the next child of a
            plain ``nn.Sequential``, and what a family's adapter says (the next stage's first block, the pooling).
        first_called: of each plain ``nn.Sequential`` with children, what runs first on its input: its first child,
            or where that is a plain ``nn.Sequential`` too, what runs first in it (None: an empty slot).
        switches: modules whose forward gets keyword arguments while blocks inside them are checkpointed, with
            those arguments.
        switched_on: the blocks whose family's own switch checkpoints them already.
        wrapped: the modules other code wraps (a known wrapper class, a forward set on the instance) or whose
            family's own switch checkpoints them.
        norm_activations: of each residual block of a known family, its norm layers that feed an activation,
            each with it.
        tails: of each residual block of a known family with its family's forward, how its output is made.
        conv_units: of each convolution-norm-activation unit of a known family, its parts.

    Example:
        >>> import torchvision
        >>> model_map = map_model(torchvision.models.resnet18(), "auto")
        >>> [link.name for link in model_map.links[:3]], len(model_map.tails), len(model_map.stems)
        (['stem', 'layer1.0', 'layer1.1'], 8, 1)
    """

    model: nn.Module
    links: tuple[Link, ...]
    joinable: tuple[bool, ...]
    parts: tuple[tuple[int, Link], ...]
    stems: Mapping[int, Stem]
    following: Mapping[int, nn.Module]
    first_called: Mapping[int, nn.Module | None]
    switches: tuple[tuple[nn.Module, dict[str, Any]], ...]
    switched_on: frozenset[int]
    wrapped: frozenset[int]
    norm_activations: Mapping[int, tuple[tuple[nn.Module, nn.Module], ...]]
    tails: Mapping[int, Tail]
    conv_units: Mapping[int, Unit]

    def runs_named(self, runs: Sequence[Sequence[str]]) -> list[list[Link]]:
        """The links for each run of names (to re-apply a plan on a fresh copy of the model); a part of a block
        (:attr:`parts`) is a run of its own.

        Raises:
            ValueError: a name the model does not have, or a run whose links may not share one checkpoint.
        """
        index = {link.name: i for i, link in enumerate(self.links)}
        named_parts = {part.name: part for _, part in self.parts}
        for run in runs:
            if len(run) == 1 and run[0] in named_parts and run[0] not in index:
                continue
            missing = [n for n in run if n not in index]
            if missing:
                raise ValueError(f"the model has no block named {missing[0]!r} to checkpoint")
            for a, b in zip(run, run[1:], strict=False):
                if index[b] != index[a] + 1 or not self.joinable[index[a]]:
                    raise ValueError(
                        f"{a!r} and {b!r} cannot share a run: a run is made of consecutive blocks of one nn.Sequential,"
                        " none of them sharded by FSDP2's fully_shard"
                    )
        return [
            [named_parts[n] for n in run] if run[0] not in index else [self.links[index[n]] for n in run]
            for run in runs
        ]


def map_model(model: nn.Module, units: Units | None = None) -> ModelMap:
    """Read ``model``'s map: the registry's answers for every module, and with ``units`` (see
    :func:`~.families.find_units`) its links and their parts; None: no links (a change that plans nothing: a removal,
    the rebuild of a whole model).

    Raises:
        TypeError, ValueError: as :func:`~.families.find_units` for ``units``.
    """
    layout = Layout(model)  # the registry's one answer, asked here and nowhere else in a plan
    modules = list(model.modules())
    stems = {id(m): stem for m in modules if (stem := layout.stem_of(m)) is not None}
    norm_activations = {id(m): pairs for m in modules if (pairs := layout.norm_activations(m)) is not None}
    tails = {id(m): tail for m in modules if (tail := layout.tail(m)) is not None}
    conv_units = {id(m): unit for m in modules if (unit := layout.unit(m)) is not None}
    wrapped = frozenset(id(m) for m in modules if layout.wrapped_by_someone_else(m))
    found = layout.blocks(units) if units is not None else []
    links, joinable = _chain(model, found, layout.stems if not names_only(units) else [])
    return ModelMap(
        model=model,
        links=tuple(links),
        joinable=tuple(joinable),
        parts=tuple(link_parts(links)),
        stems=stems,
        following={**_sequential_order(modules), **layout.following},
        first_called={id(m): _first_called(m) for m in modules if plain_sequential(m) and len(m._modules)},
        switches=tuple(layout.switches),
        switched_on=frozenset(layout.switched_on),
        wrapped=wrapped,
        norm_activations=norm_activations,
        tails=tails,
        conv_units=conv_units,
    )


def _sequential_order(modules: Sequence[nn.Module]) -> dict[int, nn.Module]:
    """What runs next on each child of a plain ``nn.Sequential``: the next child."""
    after: dict[int, nn.Module] = {}
    for module in modules:
        if plain_sequential(module):
            children = list(module.children())
            after.update((id(a), b) for a, b in zip(children, children[1:], strict=False))
    return after


def _first_called(module: nn.Module | None) -> nn.Module | None:
    while module is not None and plain_sequential(module) and len(module._modules):
        module = next(iter(module._modules.values()))
    return module


def model_chain(
    model: nn.Module, found: list[tuple[str, nn.Module]], layout: Layout | None = None, with_stems: bool = True
) -> tuple[list[Link], list[bool]]:
    """The links to plan over and which neighbours may share a run.

    Blocks that are consecutive children of one ``nn.Sequential`` (with ``nn.Sequential``'s own forward) may share
    a run, so a stage's output (what feature extractors read) is always its own. In a model whose adapter names a
    stem (torchvision's and timm's ResNets with their own forward: conv1, bn1, relu / act1, maxpool) the stem is a
    link too, on its own, before the block it runs before (unless ``with_stems`` is False: blocks chosen by name). A
    block sharded by FSDP2 (``fully_shard``) is a run of its own. ``layout``: the model's, where the caller has it.
    """
    return _chain(model, found, (layout or Layout(model)).stems if with_stems else [])


def _chain(
    model: nn.Module, found: list[tuple[str, nn.Module]], stems: Sequence[tuple[str, Stem]]
) -> tuple[list[Link], list[bool]]:
    """:func:`model_chain`, with the stems to put before their blocks (none: blocks chosen by name)."""
    names = {name for name, _ in found}
    before = {
        stem.before: Link(name, stem.modules, stem=True) for name, stem in stems if stem.before in names
    }  # first block's name -> the stem link before it
    links: list[Link] = []
    joinable: list[bool] = []
    modules = dict(model.named_modules())
    for name, module in found:
        if name in before:
            if links:
                joinable.append(False)
            links.append(before[name])
            joinable.append(False)
        elif links:
            joinable.append(_consecutive_in_sequential(modules, links[-1].name, name))
        links.append(Link(name, ((name, module),)))
    return links, joinable


def _consecutive_in_sequential(modules: dict[str, nn.Module], a: str, b: str) -> bool:
    parent_a, _, index_a = a.rpartition(".")
    parent_b, _, index_b = b.rpartition(".")
    parent = modules.get(parent_a)
    # a Sequential subclass with a forward of its own may not call its children one after another
    if parent_a != parent_b or parent is None or not plain_sequential(parent):
        return False
    # a block sharded by FSDP2 gathers its weights in hooks around its own call; a run calls its members' forward
    if isinstance(modules[a], FSDPModule) or isinstance(modules[b], FSDPModule):
        return False
    order = list(modules[parent_a]._modules)
    return order.index(index_b) == order.index(index_a) + 1


def link_parts(links: Sequence[Link]) -> list[tuple[int, Link]]:
    """Finer links: in each block, the modules it calls that are made of modules and hold parameters (a
    transformer layer's attention and MLP, a ConvNeXt block's MLP, T5's sub-layers inside its ``layer`` list, the
    blocks of a plain ``nn.Sequential`` of them where a block is a whole stage), each with the index of its block.
    A part is checkpointed on its own (the rest of its block kept as it is), or inside its checkpointed block, where
    its recomputation then holds less at once. A ResNet's stem has none.

    Example:
        >>> layer = nn.Sequential(nn.LayerNorm(4), nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4)))
        >>> model = nn.Sequential(layer)
        >>> [(i, part.name) for i, part in link_parts([Link("0", (("0", layer),))])]
        [(0, '0.1')]
    """
    blocks = {id(module) for link in links for _, module in link.modules}
    parts: list[tuple[int, Link]] = []
    for i, link in enumerate(links):
        if link.stem or len(link.modules) != 1:
            continue
        name, block = link.modules[0]
        for path, child in _composite_children(block):
            if id(child) not in blocks:
                parts.append((i, Link(f"{name}.{path}", ((f"{name}.{path}", child),), part=True)))
    return parts


def _composite_children(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    for name, child in module._modules.items():
        if child is None:
            continue
        if isinstance(child, nn.ModuleList | nn.ModuleDict):  # never called: the block calls its elements
            yield from _composite_children(child, f"{prefix}{name}.")
        elif plain_sequential(child) and any(_composite(c) for c in child._modules.values() if c is not None):
            # a stage's blocks (a block that is a whole stage, as timm's switch checkpoints RepViT's): each is a part
            yield from _composite_children(child, f"{prefix}{name}.")
        elif _composite(child):
            yield f"{prefix}{name}", child


def _composite(module: nn.Module) -> bool:
    return bool(module._modules) and next(module.parameters(), None) is not None
