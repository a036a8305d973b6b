"""The public entry points: :func:`checkpoint_blocks` (and :func:`checkpoint_resnet`, the same for a torchvision
ResNet) checks its arguments, reads the model's map once (:class:`~.model_map.ModelMap`: its links and what its
families say of it) and checkpoints every link, or hands the map to a planner, eager (:mod:`.plan_eager`) or compiled
(:mod:`.plan_compiled`), and makes each change the planner asks for; :func:`apply_plan` re-applies a plan's runs.
Every change to the model is made by :func:`.surgery.apply`."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lightning_memguard import _compiler
from lightning_memguard.checkpointing import families, surgery
from lightning_memguard.checkpointing.families import Units, check_units
from lightning_memguard.checkpointing.model_map import map_model
from lightning_memguard.checkpointing.plan_compiled import plan_compiled
from lightning_memguard.checkpointing.plan_eager import plan_eager
from lightning_memguard.checkpointing.rebuild_targets import can_rebuild
from lightning_memguard.checkpointing.recipes import RebuildConfig, check_config
from lightning_memguard.checkpointing.result import Change, CheckpointPlan, Planner
from lightning_memguard.checkpointing.wrap import Link, is_checkpointed
from lightning_memguard.core.checks import (
    check_bool,
    check_callable,
    check_fractions,
    check_instance,
    check_memory_budget,
)


def checkpoint_blocks(
    model: nn.Module,
    units: Units = "auto",
    memory_budget: float | int | str | None = None,
    example_input: Any = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    bn_correct: bool = True,
    rebuild_bn_relu: bool = False,
    rebuild_config: RebuildConfig | None = None,
    compile: bool | Mapping[str, Any] | None = None,
    compile_settings: Sequence[float] = (0.8, 0.5),
) -> CheckpointPlan:
    """Checkpoint a block-structured model in place (``use_reentrant=False``); ``state_dict`` keys do not change.

    The model is seen as a chain of links: its blocks, and in a torchvision or timm ResNet also its stem (conv1, bn1,
    relu, maxpool). Blocks are found (``units="auto"``) by the model's family where :mod:`.families` knows it (timm,
    Hugging Face transformers, torchvision's ResNets), else by structure. A Hugging Face model is called with
    ``use_cache=False`` while it trains with blocks checkpointed, as its own switch does. Without a budget, every
    link is checkpointed on its own. A checkpointed block that changes a tensor it is given in place (an in-place
    ReLU first, ``x += offset``) would be recomputed from the changed tensor: its first forward with gradients raises
    a ``RuntimeError`` naming the block and the fix, instead of autograd's bare error in backward (a budget leaves
    such a block unchecked).
    With ``memory_budget`` (a fraction in (0, 1] of the un-checkpointed peak, or bytes such as ``"6GB"``), each
    link's saved activations and forward time are measured on ``example_input``; the links that free the most
    memory per millisecond of recomputation are chosen until the predicted peak fits, and chosen neighbours of one
    ``nn.Sequential`` (a ResNet stage) are joined into runs, one checkpoint each, where that lowers the peak (a run
    also frees the tensors between its blocks, but brings all of its activations back at once when it is
    recomputed). The peak is then measured: links are added if it does not fit, and given back, least valuable
    first, while it still fits.

    With ``rebuild_bn_relu=True``, BasicBlocks, Bottlenecks and ResNet stems (torchvision's and timm's) that are not
    checkpointed keep their convolution outputs and rebuild the ReLU outputs after bn1 (and bn2), and their own
    outputs where the next block is rebuilt too, in backward, one element-wise pass each, instead of keeping them;
    in blocks that are not checkpointed, torchvision Conv2dNormActivation units (MobileNet, EfficientNet, RegNet)
    keep their convolution outputs and rebuild their BatchNorm and activation outputs (see
    :mod:`lightning_memguard.checkpointing.rebuild`): less memory for far less recomputation than a whole block.
    Units outside the blocks (a stem, a head) are left as they are here; ``rebuild_bn_relu(model)`` reaches them.
    Without a budget, that is all that happens (no block is checkpointed); with one, the rebuild comes first and
    whole blocks are checkpointed only for what it leaves over the budget.

    This is the checkpointing-only entrance, with its own search (runs of joined blocks, the rebuild, compile's own
    setting). The planner with every lever, the fused loss of a language model's head and pointwise recomputation
    beside the blocks and their parts, is :func:`~lightning_memguard.levers.plan_levers` (in a Trainer:
    ``ActivationCheckpointing(memory_budget=..., levers=True)``); its choice among blocks alone is not this search's.

    Under ``torch.compile`` the compiler decides what to keep for backward, so a plan measured in eager mode does
    not hold there. With a budget and a model that is compiled (``torch.compile(model)``, or a LightningModule that
    ``fit`` unwrapped) or will be (``compile=True``, or ``compile={...}``: ``torch.compile``'s keyword arguments),
    the peaks are measured compiled (each measurement compiles anew), and the budget is a fraction of the compiled
    model's own peak. Compile's ``activation_memory_budget`` is one more lever: compile's default and each of
    ``compile_settings`` is measured alone, then each that does not fit, fastest alone first, gets blocks added, most
    valuable first, as many as the gap needs, until it does, while it may still be the fastest (a heuristic:
    checkpointing more, or a lower setting, is taken not to make a step faster, so a setting no faster than a fit
    found is left, and so are a fit's blocks under a lower setting; see
    :class:`~lightning_memguard.checkpointing.budget.CompileBudgetSearch`). The
    fastest combination that fits is applied, and ``plan.activation_memory_budget`` must then be set while the
    model compiles (``with plan.compiling():``; the callback does it for the fit). The rebuild stands aside under
    compile, so ``rebuild_bn_relu`` is not planned on there.

    Under compile (the model compiled, or ``compile=`` given, with or without a budget) each container of
    checkpointed blocks (a ResNet's stages) is a compiled graph of its own (``plan.graph_splits``,
    :class:`~.wrap.GraphSplit`): one compiled backward of the whole model keeps several blocks' recomputation alive
    at once. A budget's search measures with the split, then its pick once more as one graph, kept instead where it
    fits and is faster. The split is a graph break, so ``fullgraph=True`` and ``torch.export`` do not take it.

    Args:
        model: the model, changed in place.
        units: ``"auto"`` (found by structure, see :func:`~.families.find_units`), module classes, module names (a
            list such as ``["layer1.0", "layer2.1"]``: exactly those modules, no stem beside them; each name as
            ``model.named_modules()`` gives it, or relative to a module inside ``model``, so a LightningModule's
            ``net.layer1.0`` is also ``"layer1.0"``), or a predicate ``(name, module) -> bool``.
        memory_budget: see above; needs ``example_input``.
        example_input: a real batch of model inputs, as Lightning's ``example_input_array``: a tensor
            (``model(x)``), a tuple or list of positional arguments (``model(*x)``) or a dict of keyword arguments
            (``model(**x)``, a Hugging Face-style ``forward(input_ids, attention_mask)``).
        loss_fn: turns the model's output into a scalar for the profiling backward; default: the sum.
        bn_correct: BatchNorm running statistics are updated only by the first forward, not by recomputation.
        rebuild_bn_relu: see above.
        rebuild_config: how the rebuild makes its tensors (:class:`~.recipes.RebuildConfig`); default: the one-pass
            kernel where it runs, two of a stage's earlier outputs kept.
        compile: None: measure the model as it runs (compiled if it is); True or ``torch.compile`` keyword
            arguments: it will be compiled so, measure it that way.
        compile_settings: the values of compile's ``activation_memory_budget`` tried beside its default: a
            sequence (or an array) of numbers in (0, 1].

    Raises:
        ValueError: no blocks found, a module name in ``units`` that names no module (the closest names said),
            several, or one inside another block named, a budget without an example input, a budget out of range,
            ``compile_settings`` outside (0, 1], ``rebuild_bn_relu`` on a model with no BasicBlock, Bottleneck or
            ResNet stem (torchvision's or timm's) or Conv2dNormActivation unit (with ``nn.BatchNorm2d``) among its
            blocks, or a Hugging Face model that declares ``supports_gradient_checkpointing = False`` with
            ``units="auto"``.
        TypeError: ``model`` not an ``nn.Module``, ``units`` of the wrong kind, ``loss_fn`` not callable,
            ``bn_correct`` or ``rebuild_bn_relu`` not a bool, ``rebuild_config`` not a ``RebuildConfig``.

    Example:
        >>> import torchvision
        >>> model = torchvision.models.resnet18(num_classes=10)
        >>> plan = checkpoint_blocks(model)
        >>> plan.blocks[:3], plan.candidates
        (['stem', 'layer1.0', 'layer1.1'], 9)
    """
    _check_model(model)
    memory_budget = check_memory_budget(memory_budget)  # the callback's rule: a float is a fraction, else bytes
    check_callable("loss_fn", loss_fn, "a callable (output) -> scalar loss", optional=True)
    check_bool("bn_correct", bn_correct)  # not None (falsy: BatchNorm statistics updated twice per step)
    check_bool("rebuild_bn_relu", rebuild_bn_relu)  # not "False" (truthy: the rebuild applied)
    config = check_config(rebuild_config)
    options = _check_compile(compile)
    compile_settings = check_fractions("compile_settings", compile_settings)  # any sequence or array; 1 is 1.0
    measured, model = model, _compiler.unwrapped(model)  # the modules of a torch.compile result are its original's
    if compile is None:
        compile = _compiler.is_compiled(measured)
    model_map = map_model(model, check_units(units))  # its links and what its families say, read once for the plan
    links = model_map.links
    rebuildable = any(can_rebuild(link, model_map) for link in links)  # the rebuild takes something in the links
    if rebuild_bn_relu and not rebuildable:
        raise ValueError(
            f"`rebuild_bn_relu` needs {families.rebuild_description()} (with nn.BatchNorm2d)"
            f" among its blocks, and {type(model).__name__} has none"
        )
    if memory_budget is None:  # every link on its own (under compile, a graph per container of blocks), or the rebuild
        planner = _every_link(links, rebuild_bn_relu, bool(compile))
    else:
        if example_input is None:
            raise ValueError("`memory_budget` needs `example_input`, a real batch to measure the blocks on")
        if any(is_checkpointed(m) for link in links for _, m in link.modules):
            warnings.warn(
                "the model is already checkpointed; applying twice changes nothing", UserWarning, stacklevel=2
            )
            return CheckpointPlan(blocks=[], candidates=len(links))
        if compile:
            if rebuild_bn_relu:
                warnings.warn("the rebuild stands aside under torch.compile: planning without it", UserWarning, 2)
            planner = plan_compiled(
                measured, model_map, memory_budget, example_input, loss_fn, options, tuple(compile_settings)
            )
        else:
            planner = plan_eager(model_map, memory_budget, example_input, loss_fn, rebuild_bn_relu, rebuildable)
    # a planning pass that fails leaves the model as it was, and a planner stopped part-way is closed
    with surgery.restored_on_failure(model), contextlib.closing(planner):
        applied = surgery.Applied()
        try:
            change = next(planner)
            while True:  # each change the planner asks for, in place of the one before; it measures the model then
                applied = surgery.apply(
                    model_map,
                    change.runs,
                    change.rebuilt,
                    bn_correct=bn_correct,
                    config=config,
                    replacing=applied,
                    split_graphs=change.split_graphs,
                )
                change = planner.send(applied)
        except StopIteration as done:
            plan: CheckpointPlan = done.value
        return plan


def _every_link(links: Sequence[Link], rebuild_bn_relu: bool, split_graphs: bool) -> Planner:
    """Without a budget: every link checkpointed on its own, or with ``rebuild_bn_relu`` every link rebuilt
    instead; with ``split_graphs`` (compiled) a graph per container of blocks."""
    every = [] if rebuild_bn_relu else [[link] for link in links]
    applied = yield Change(every, links if rebuild_bn_relu else (), split_graphs)
    return CheckpointPlan(
        blocks=applied.checkpointed,
        candidates=len(links),
        runs=applied.runs,
        rebuilt=applied.rebuilt,
        graph_splits=applied.splits,
    )


def _check_model(model: Any) -> None:
    """``model`` must be a module (or a ``torch.compile`` of one), not its name."""
    check_instance("model", model, nn.Module, "be a torch.nn.Module (the model itself, built)")


def _check_compile(compile: Any) -> dict[str, Any] | None:
    if compile is not None and not isinstance(compile, bool | Mapping):
        raise TypeError(f"`compile` must be None, a bool or torch.compile's keyword arguments, got {compile!r}")
    return dict(compile) if isinstance(compile, Mapping) else None


def apply_plan(
    model: nn.Module,
    runs: list[list[str]],
    units: Units = "auto",
    bn_correct: bool = True,
    rebuild_bn_relu: bool = False,
    rebuild_config: RebuildConfig | None = None,
    split_graphs: bool = False,
) -> list[str]:
    """Checkpoint the runs of a plan made before (``CheckpointPlan.runs``) on a fresh copy of its model, and with
    ``rebuild_bn_relu`` rebuild BatchNorm + ReLU outputs in the blocks left unchecked (made as ``rebuild_config``
    says); with ``split_graphs`` (the plan has ``graph_splits``) the blocks' containers each begin a compiled graph of
    their own; return the links checkpointed.

    Raises:
        ValueError: a block the model does not have, or a run of blocks that may not share one checkpoint.
        TypeError: ``model`` not an ``nn.Module``, a flag not a bool, ``rebuild_config`` not a ``RebuildConfig``.
    """
    _check_model(model)
    check_bool("bn_correct", bn_correct)
    check_bool("rebuild_bn_relu", rebuild_bn_relu)
    check_bool("split_graphs", split_graphs)
    config = check_config(rebuild_config)
    model_map = map_model(model, check_units(units))
    named = model_map.runs_named(runs)
    rebuilt = model_map.links if rebuild_bn_relu else ()
    applied = surgery.apply(model_map, named, rebuilt, bn_correct=bn_correct, config=config, split_graphs=split_graphs)
    return applied.checkpointed


def checkpoint_resnet(
    model: nn.Module,
    memory_budget: float | int | str | None = None,
    example_input: Any = None,
    bn_correct: bool = True,
    rebuild_bn_relu: bool = False,
    rebuild_config: RebuildConfig | None = None,
    compile: bool | Mapping[str, Any] | None = None,
    compile_settings: Sequence[float] = (0.8, 0.5),
) -> CheckpointPlan:
    """Checkpoint a torchvision ResNet (resnet18..152, ResNeXt, Wide ResNet) in place: its stem and blocks.

    See :func:`checkpoint_blocks` for the budget, the runs, the BatchNorm handling, the cheaper
    ``rebuild_bn_relu=True`` (which with a budget usually buys the same memory for less throughput) and a budget
    under ``torch.compile`` (``model`` compiled, or ``compile=``).

    Raises:
        TypeError: if ``model`` is not a torchvision ResNet (or ``torch.compile`` of one); other arguments as for
            :func:`checkpoint_blocks`.

    Example:
        >>> import torchvision
        >>> plan = checkpoint_resnet(torchvision.models.resnet50(num_classes=10))
        >>> len(plan.blocks), plan.blocks[0]
        (17, 'stem')
    """
    import torchvision

    _check_model(model)
    if not isinstance(_compiler.unwrapped(model), torchvision.models.ResNet):
        raise TypeError(
            f"`model`: checkpoint_resnet needs a torchvision ResNet, got {type(model).__name__}; use"
            " checkpoint_blocks(model, units=...) for other block-structured models"
        )
    from torchvision.models.resnet import BasicBlock, Bottleneck

    return checkpoint_blocks(
        model,
        units={BasicBlock, Bottleneck},
        memory_budget=memory_budget,
        example_input=example_input,
        bn_correct=bn_correct,
        rebuild_bn_relu=rebuild_bn_relu,
        rebuild_config=rebuild_config,
        compile=compile,
        compile_settings=compile_settings,
    )
