"""The levers' planner on a real model: :func:`plan_levers` measures each lever with the existing measurements, lets
:class:`~.choose.LeverSearch` choose, and applies each choice with the levers' own public calls, measured once made.

What it measures: the step's peak and each link's saved activations and forward time (checkpointing's
:class:`~lightning_memguard.checkpointing.measure.StepMeter`, the links and their parts of
:func:`~lightning_memguard.checkpointing.model_map.map_model`); the fused loss as one step with and one without
:func:`~.huggingface_loss.apply_fused_loss`; each link's pointwise chains by :func:`~.pointwise.measure_pointwise`
(the ledger's bytes, the recomputation's milliseconds); offload's copies as :func:`~.offload.exposed_transfer_ms` says
from the links' forward times (CUDA only: on the CPU offload does nothing). A lever built elsewhere comes in as an
:class:`InjectedLever` with its own measurement and application.

What it applies, in this order: :func:`~.huggingface_loss.apply_fused_loss` (on the model, or on the Hugging Face
model it holds: :func:`find_loss_target`);
:func:`~lightning_memguard.checkpointing.entrances.apply_plan` with the blocks and parts chosen, each a run of its own;
:func:`~.pointwise.recompute_pointwise` on the links chosen for it (after the checkpoints, so a link checkpointed
whole would be refused by it, never stacked: a link gets one option); an injected lever's ``apply``. Offload is not a
change to the model but a context around the steps: the plan holds the :class:`~.offload.ActivationOffload` to
enter. :meth:`~.choose.LeverPlan.record` is the choice as plain data, and :func:`apply_record` applies it again (a
resumed run, a fresh copy of the model), measuring nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_memguard.checkpointing.budget import BlockProfile
from lightning_memguard.checkpointing.entrances import apply_plan
from lightning_memguard.checkpointing.families import Units, check_units
from lightning_memguard.checkpointing.measure import StepMeter, default_loss
from lightning_memguard.checkpointing.model_map import ModelMap, map_model
from lightning_memguard.checkpointing.surgery import remove_checkpointing
from lightning_memguard.checkpointing.wrap import is_checkpointed
from lightning_memguard.core.checks import check_instance, check_memory_budget, check_size
from lightning_memguard.levers.choose import (
    CHECKPOINTED,
    OFFLOADED,
    RECORD_VERSION,
    LeverPlan,
    LeverSearch,
    LinkOption,
    LossOption,
    Measurement,
    Proposal,
)
from lightning_memguard.levers.huggingface_loss import (
    FusedLossRefused,
    apply_fused_loss,
    is_fused,
    refusal,
    remove_fused_loss,
)
from lightning_memguard.levers.offload import (
    MIN_BYTES,
    ActivationOffload,
    CopyStreams,
    bucket_size,
    exposed_transfer_ms,
)
from lightning_memguard.levers.pointwise import (
    KEPT_CHANGED,
    PointwiseCost,
    PointwiseRecomputed,
    default_clock,
    measure_pointwise,
    recompute_pointwise,
    remove_pointwise,
)

OUTSIDE_OWNER = "the head and the loss (outside the blocks)"
"""What holds the peak where the activations saved outside every link are more than any link's."""

IN_PLACE = "changes its input in place"
"""What :class:`~.pointwise.PointwiseRecomputed` says of a block it cannot recompute: that block gets no pointwise
option, the others do."""

MUTATED = "cached during selective activation checkpoint has been mutated"
"""What torch's selective checkpoint says in backward where a product a block keeps is changed in place after the
block's forward (by what follows it); changed inside the block (timm's squeeze-excite: a convolution's output through
``ReLU(inplace=True)``), :data:`~.pointwise.KEPT_CHANGED` says it in the forward. Either way that block gets no
pointwise option."""

REFUSALS = (IN_PLACE, KEPT_CHANGED, MUTATED)
"""What a block that cannot recompute its pointwise work says: it gets no pointwise option, the others do."""


BACKWARD_PER_FORWARD = 2.0
"""A link's backward time, in forward times, where offload's exposed copies are predicted (a matmul's backward is two
matmuls)."""


@dataclass(frozen=True)
class InjectedLever:
    """A lever measured and applied by code outside this planner, one option per link, in place of a built-in one.

    Attributes:
        kind: its kind among :data:`~.choose.KINDS`, one the planner does not offer itself: ``"pointwise"`` with
            ``plan_levers(..., pointwise=False)``, ``"offload"`` where offload is not offered.
        measure: ``measure(model, links)`` on the model as it is then (the fused loss applied or not): for each link
            name it helps, ``(bytes freed, milliseconds added per step)``.
        apply: ``apply(model, links)`` applies it to the links named and returns a function that undoes it.
    """

    kind: str
    measure: Callable[[nn.Module, Sequence[str]], Mapping[str, tuple[int, float]]]
    apply: Callable[[nn.Module, Sequence[str]], Callable[[], None]]


def hugging_face_loss(output: Any) -> torch.Tensor:
    """The model's own loss where its output has one (a Hugging Face model given labels), else the sum of its
    output (checkpointing's default)."""
    loss = getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) else default_loss(output)


def plan_levers(
    model: nn.Module,
    example: Any,
    memory_budget: float | int | str,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    units: Units = "auto",
    fused_loss: bool = True,
    pointwise: bool = True,
    offload: bool = False,
    bandwidth_gb_s: float = 25.0,
    max_host_bytes: int | str | None = None,
    injected: Sequence[InjectedLever] = (),
    clock: Callable[[], float] = default_clock,
    offload_streams: CopyStreams | None = None,
) -> LeverPlan:
    """Choose, apply and measure the levers that bring a training step's peak within ``memory_budget``.

    The fused loss first, where the model has a vocabulary head (a Hugging Face model
    :func:`~.huggingface_loss.apply_fused_loss` takes, or a module holding one, such as a LightningModule whose
    ``self.model`` it is: :func:`find_loss_target`): it frees the logits for about nothing, and what then holds
    the peak is measured again. Then, per link (a block of the model's chain), at most one of: checkpointing the
    whole block, its parts (a layer's attention and MLP), recomputing its pointwise chains
    (:func:`~.pointwise.recompute_pointwise`: its matrix products kept), an injected lever, or on CUDA offloading
    it, or checkpointing it whole with the input its checkpoint keeps offloaded (below the floor recomputation
    reaches: every block's input); the cheapest set in milliseconds per byte freed whose predicted peak fits,
    measured once applied (see :class:`~.choose.LeverSearch`). The model is left as the plan says; a failure
    part-way leaves it as it was.

    Args:
        model: the model, changed in place.
        example: a real batch, as ``checkpoint_blocks``' ``example_input`` (a Hugging Face model's dict with its
            ``labels``, for the fused loss to be measured).
        memory_budget: a fraction in (0, 1] of the step's peak before any lever, or bytes (``"6GB"``).
        loss_fn: the output's scalar loss; default: its ``loss`` where it has one, else the sum of the output.
        units: the links, as ``checkpoint_blocks`` finds them (``"auto"``, classes, names or a predicate).
        fused_loss: offer the fused loss (where the model takes it).
        pointwise: offer the pointwise chains' recomputation, per link (:func:`~.pointwise.measure_pointwise`).
        offload: offer offload, of a link's saved activations or of the input a link checkpointed whole keeps
            (CUDA only: on the CPU it would do nothing, so it is not offered there unless ``offload_streams`` are
            given). Off by default: on an H100 its copies of whole blocks did not hide behind the step (GPT-2
            small, 1.1 GB moved: 6.5 % slower, where the prediction said 0 ms; docs/measured.md), so a plan that
            takes it may cost more than it predicts.
        bandwidth_gb_s: the host link's bandwidth each way, for offload's exposed copies.
        max_host_bytes: the most pinned host memory offload may hold: the choice's bound, and the plan's
            ``ActivationOffload``'s (default: no bound beyond what ``ActivationOffload`` allows when it is entered).
        injected: levers measured and applied elsewhere (:class:`InjectedLever`), of kinds not offered here.
        clock: seconds, read as a pointwise recomputation starts and ends (:func:`~.pointwise.measure_pointwise`'s;
            a test injects one).
        offload_streams: the offload's copies (:class:`~.offload.CopyStreams`); default: CUDA's side streams on the
            model's device. A test injects copies made at once, to run offload's choice on the CPU.

    Returns:
        The :class:`~.choose.LeverPlan`: ``summary()`` says it; ``plan.offload`` is the ``ActivationOffload`` to
        enter around the training steps where offload was chosen.

    Raises:
        ValueError: a budget out of range, no links found, a bad bandwidth or host bound, an injected lever of a
            kind offered here (or two of one kind); a model that carries levers already (:func:`applied_levers`:
            planning would take them off; ``remove_levers(model)`` first, to plan afresh).
        TypeError: ``model`` not an ``nn.Module``.

    Example:
        >>> import torch
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <...>
        >>> model = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU())
        ...                               for _ in range(4)))
        >>> plan = plan_levers(model, torch.randn(256, 64, requires_grad=True), memory_budget=0.6, units=[
        ...     torch.nn.Sequential])
        >>> plan.held, sorted(plan.kinds())
        (True, ['block'])
    """
    check_instance("model", model, nn.Module, "be a torch.nn.Module (the model itself, built)")
    _refuse_applied(model, "plan_levers plans")
    budget = check_memory_budget(memory_budget)
    if budget is None:
        raise ValueError("`memory_budget` must be given: a fraction in (0, 1] or bytes")
    if not bandwidth_gb_s > 0:
        raise ValueError(f"`bandwidth_gb_s` must be positive, got {bandwidth_gb_s!r}")
    host_limit = None if max_host_bytes is None else check_size("max_host_bytes", max_host_bytes, 0)
    model_map = map_model(model, check_units(units))
    kinds = [lever.kind for lever in injected]
    own = {"block": True, "parts": True, "pointwise": pointwise, "offload": offload}  # the kinds offered here
    for kind in kinds:
        if own.get(kind):
            fix = f"; pass {kind}=False to use your own" if kind in ("pointwise", "offload") else ""
            raise ValueError(f"an injected lever of kind {kind!r} is one the planner offers itself{fix}")
        if kinds.count(kind) > 1:
            raise ValueError(f"two injected levers of kind {kind!r}: a link takes one option of a kind")
    levers = _Levers(model, model_map, example, loss_fn or hugging_face_loss, list(injected))
    levers.units = units
    levers.offload = offload
    levers.pointwise, levers.clock = pointwise, clock
    levers.bandwidth_gb_s = bandwidth_gb_s
    levers.streams, levers.host_limit = offload_streams, host_limit
    levers.loss_name, levers.loss_model, reason = find_loss_target(model)
    if not fused_loss:
        reason = "not offered (fused_loss=False)"
    search = LeverSearch(budget, host_limit)
    try:
        while (proposal := search.propose()) is not None:
            levers.apply(proposal)
            search.observe(levers.measure(with_options=not proposal.links, loss=reason is None and not levers.tried))
    except BaseException:
        levers.undo()
        raise
    plan = search.result
    assert plan is not None
    plan.loss_refused = reason
    plan.offload, plan.checkpointed = levers.offloader, levers.checkpointed  # the last proposal's: the plan's own
    plan.pointwise, plan.offloaded = levers.pointwised, levers.offloaded
    plan.loss_module = levers.loss_name if plan.loss else ""
    return plan


def find_loss_target(model: nn.Module) -> tuple[str, nn.Module, str | None]:
    """The module whose loss :func:`~.huggingface_loss.apply_fused_loss` fuses, its name in ``model`` and why there
    is none (None: there is one): ``model`` itself where it is a Hugging Face model, else the outermost of its
    submodules that is one and takes the fused loss (a LightningModule's ``self.model``: whoever calls it with
    ``labels`` gets the fused loss). A Hugging Face model that refuses it is not looked into.

    Example:
        >>> from transformers import GPT2Config, GPT2LMHeadModel
        >>> holder = torch.nn.Module()
        >>> holder.model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100))
        >>> find_loss_target(holder)[0], find_loss_target(torch.nn.Linear(2, 2))[2]
        ('model', 'Linear is not a Hugging Face model (no config.model_type)')
    """
    reason = refusal(model)
    if reason is None or getattr(getattr(model, "config", None), "model_type", None) is not None:
        return "", model, reason
    inner, refused = None, list[str]()
    for name, module in model.named_modules():
        if any(name.startswith(f"{r}.") for r in refused):  # inside one that refused: its own parts, never fused
            continue
        if name and getattr(getattr(module, "config", None), "model_type", None) is not None:
            why = refusal(module)
            if why is None:
                return name, module, None
            inner, refused = inner or f"{name}: {why}", [*refused, name]
    return "", model, inner or reason


def apply_record(model: nn.Module, record: Mapping[str, Any], units: Units = "auto") -> nn.Module:
    """Apply the levers of :meth:`~.choose.LeverPlan.record` to ``model`` (a fresh copy of the model the plan was
    made on), measuring nothing: the fused loss, the checkpointed blocks and parts (each a run of its own), then the
    pointwise chains, as :func:`plan_levers` applied them. A failure part-way takes every lever off again.

    Args:
        model: the model, changed in place.
        record: what ``plan.record()`` returned (plain data, as a checkpoint keeps it).
        units: the links, as the plan was made with them.

    Returns:
        The same model.

    Raises:
        ValueError: a record of another layout or version, or naming a block, part or module the model lacks; a
            model that carries levers already (:func:`applied_levers`).
        FusedLossRefused: the record fuses the loss and the module it names does not take it.

    Example:
        >>> block = lambda: torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
        >>> model = torch.nn.Sequential(block(), block())
        >>> record = {"version": 1, "fused_loss": False, "loss_module": "", "checkpointed": ["0"], "pointwise": []}
        >>> from lightning_memguard.checkpointing import is_checkpointed
        >>> is_checkpointed(apply_record(model, record, units=[torch.nn.Sequential])[0])
        True
    """
    check_instance("model", model, nn.Module, "be a torch.nn.Module (the model itself, built)")
    _refuse_applied(model, "apply_record applies a record")
    keys = ("version", "fused_loss", "loss_module", "checkpointed", "pointwise")
    if not isinstance(record, Mapping) or any(key not in record for key in keys):
        raise ValueError(f"a lever record must be a dict with the keys {list(keys)}, got {record!r}")
    if record["version"] != RECORD_VERSION:
        raise ValueError(
            f"a lever record of version {record['version']!r} is not one this library reads (it reads version"
            f" {RECORD_VERSION}); plan again with plan_levers"
        )
    try:
        if record["fused_loss"]:
            name = record["loss_module"]
            try:
                target = model.get_submodule(name) if name else model
            except AttributeError:
                raise FusedLossRefused(f"the record fuses the loss of {name!r}, which the model lacks") from None
            apply_fused_loss(target)
        if record["checkpointed"]:
            apply_plan(model, [[name] for name in record["checkpointed"]], units=units)
        if record["pointwise"]:
            recompute_pointwise(model, units=list(record["pointwise"]))
    except BaseException:
        remove_levers(model)
        raise
    return model


def applied_levers(model: nn.Module) -> list[str]:
    """The levers ``model`` carries already, said (empty: none): blocks or parts checkpointed by this library
    (``checkpoint_blocks``, ``ActivationCheckpointing``, a plan), pointwise chains recomputed, the fused loss.
    :func:`plan_levers` and :func:`apply_record` refuse such a model (they would take those levers off), and
    ``MemGuard(on_spill="adapt")`` keeps them, splitting the batch instead of planning savers over them.

    Example:
        >>> from lightning_memguard.checkpointing import checkpoint_blocks
        >>> block = lambda: torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
        >>> model = torch.nn.Sequential(block(), block())
        >>> _ = checkpoint_blocks(model, units=[torch.nn.Sequential])
        >>> applied_levers(model)
        ['checkpointed: 0, 1']
    """
    kinds = {"checkpointed": is_checkpointed, "pointwise chains recomputed": _pointwise, "fused loss": is_fused}
    found: dict[str, list[str]] = {what: [] for what in kinds}
    for name, module in model.named_modules():
        for what, carries in kinds.items():
            if carries(module):
                found[what].append(name or "(the model)")
    return [
        f"{what}: {', '.join(names[:6])}{' ...' if len(names) > 6 else ''}" for what, names in found.items() if names
    ]


def _pointwise(module: nn.Module) -> bool:
    return isinstance(module, PointwiseRecomputed)


def _refuse_applied(model: nn.Module, what: str) -> None:
    applied = applied_levers(model)
    if applied:
        raise ValueError(
            f"{what} on a model as built, and this one carries levers already ({'; '.join(applied)}): doing so"
            " would take them off. Call remove_levers(model) first to plan afresh, or keep them and leave the"
            " planner out"
        )


def remove_levers(model: nn.Module) -> bool:
    """Undo what :func:`plan_levers` or :func:`apply_record` applied to ``model``: the pointwise recomputation, the
    checkpoints and the fused loss (an offload is left by leaving its context). True: something was removed."""
    removed = remove_pointwise(model) > 0
    removed = remove_checkpointing(model) > 0 or removed
    for module in model.modules():  # the fused loss is on the Hugging Face model the record names, maybe inside
        removed = remove_fused_loss(module) or removed
    return removed


class _Levers:
    """The model's levers: applies a proposal in place of the last, and measures the model as it is then."""

    def __init__(
        self,
        model: nn.Module,
        model_map: ModelMap,
        example: Any,
        loss_fn: Callable[[Any], torch.Tensor],
        injected: list[InjectedLever],
    ) -> None:
        self.model, self.map, self.example, self.loss_fn, self.injected = model, model_map, example, loss_fn, injected
        self.links = list(model_map.links)
        self.offload = False
        self.pointwise = False
        self.clock: Callable[[], float] = default_clock
        self.pointwised: list[str] = []
        self.units: Units = "auto"
        self.bandwidth_gb_s = 25.0
        self.streams: CopyStreams | None = None  # offload's copies (None: CUDA's side streams)
        self.host_limit: int | None = None  # the most host memory offload may hold (None: ActivationOffload's own)
        self.offloader: ActivationOffload | None = None
        self.offloaded: list[str] = []  # the offloaded links' modules, by name in the model
        self.tried = False  # the fused loss was measured
        self.checkpointed: list[str] = []
        self.parts: dict[str, list[str]] = {}  # each link's parts that free memory, as last measured
        self.loss_name, self.loss_model = "", model  # the module whose loss is fused (find_loss_target)
        self._undo: list[Callable[[], None]] = []

    def meter(self) -> StepMeter:
        return StepMeter(self.model, self.example, self.loss_fn)

    def undo(self) -> None:
        """Put the model back as it was given."""
        while self._undo:
            self._undo.pop()()
        remove_pointwise(self.model)
        self.pointwised = []
        remove_checkpointing(self.model)
        remove_fused_loss(self.loss_model)
        self.offloader, self.offloaded = None, []

    def apply(self, proposal: Proposal) -> None:
        """The proposal's levers, in place of the last proposal's."""
        self.undo()
        if proposal.loss:
            apply_fused_loss(self.loss_model)
        names = [name for name, o in proposal.links.items() if o.kind in CHECKPOINTED]
        names += [part for name, o in proposal.links.items() if o.kind == "parts" for part in self.parts[name]]
        if names:  # each a run of its own: a block by its link's name ("stem" too), a part by its module's
            apply_plan(self.model, [[name] for name in names], units=self.units)
        self.checkpointed = names
        # after the checkpoints: recompute_pointwise refuses a block checkpointed whole (one option per link)
        chosen = [name for name, o in proposal.links.items() if o.kind == "pointwise"]
        if chosen and self.pointwise:
            recompute_pointwise(self.model, units=chosen)
            self.pointwised = chosen
        for lever in self.injected:
            chosen = [name for name, o in proposal.links.items() if o.kind == lever.kind]
            if chosen:
                self._undo.append(lever.apply(self.model, chosen))
        chain = [link for link in self.links if len(link.modules) == 1]  # a stem of several modules is not offloaded
        offloaded = [i for i, link in enumerate(chain) if proposal.links.get(link.name, _NONE).kind in OFFLOADED]
        if offloaded:  # a checkpointed block's forward saves only its input, which is what goes to the host
            blocks = [link.modules[0][1] for link in chain]
            self.offloaded = [chain[i].modules[0][0] for i in offloaded]
            self.offloader = ActivationOffload(
                blocks, offloaded=offloaded, streams=self.streams, max_host_bytes=self.host_limit
            )

    def peak(self) -> int:
        meter = self.meter()
        if self.offloader is None:
            return meter.peak()
        with self.offloader:
            return meter.peak()

    def measure(self, with_options: bool, loss: bool) -> Measurement:
        """The model's peak and, where asked, what holds it, every link's options and (``loss``) the fused loss's."""
        peak = self.peak()
        if not with_options:
            return Measurement(peak)
        meter = self.meter()
        profiles = meter.profile(self.links, self.map.parts)
        n = len(self.links)
        blocks, parts = profiles[:n], profiles[n:]
        options: dict[str, list[LinkOption]] = {link.name: [] for link in self.links}
        for link, p in zip(self.links, blocks, strict=True):
            if p.recomputable and p.saving > 0:
                options[link.name].append(LinkOption("block", p.saving, p.forward_ms))
        self.parts = {link.name: [] for link in self.links}
        for (i, _), p in zip(self.map.parts, parts, strict=True):
            if p.recomputable and p.saving > 0:
                options[self.links[i].name].append(LinkOption("parts", p.saving, p.forward_ms))
                self.parts[self.links[i].name].append(p.name)
        for name, held in options.items():  # a link's parts, all together: one option
            found = [o for o in held if o.kind == "parts"]
            if found:
                whole = LinkOption("parts", sum(o.freed_bytes for o in found), sum(o.extra_ms for o in found))
                options[name] = [*(o for o in held if o.kind != "parts"), whole]
        if self.offload and (meter.cuda or self.streams is not None):  # on the CPU it would move nothing
            self._offload_options(blocks, options)
        if self.pointwise:
            for cost in self._pointwise_costs():
                if cost.freed_bytes > 0:
                    options[cost.name].append(LinkOption("pointwise", cost.freed_bytes, cost.extra_ms))
        for lever in self.injected:
            for name, (freed, ms) in lever.measure(self.model, [link.name for link in self.links]).items():
                options[name].append(LinkOption(lever.kind, int(freed), float(ms)))
        option = None
        if loss:
            self.tried = True
            option = self._loss_option(meter, peak)
        return Measurement(peak, owner(peak, blocks), options, option)

    def _pointwise_costs(self) -> list[PointwiseCost]:
        """Each link's pointwise chains measured (:func:`~.pointwise.measure_pointwise`); where a block refuses it
        (it changes its input in place) or fails in backward (it changes a kept product in place), the links one at a
        time, that block left without the option."""
        try:
            return measure_pointwise(self.model, self.example, self.links, self.loss_fn, self.clock)
        except RuntimeError as err:
            if not any(said in str(err) for said in REFUSALS):
                raise
        costs = []
        for link in self.links:
            try:
                costs += measure_pointwise(self.model, self.example, [link], self.loss_fn, self.clock)
            except RuntimeError as err:
                if not any(said in str(err) for said in REFUSALS):
                    raise
        return costs

    def _offload_options(self, profiles: list[BlockProfile], options: dict[str, list[LinkOption]]) -> None:
        """Each link offloaded alone: it frees what checkpointing it would, holds its saved bytes in host buffers,
        and costs the copies :func:`~.offload.exposed_transfer_ms` says would not hide. And each link checkpointed
        whole with its input offloaded (:func:`block_input_bytes`): it frees what checkpointing it would and that
        input too, for its recomputation and that input's copies (its backward then recomputes it first); not where
        that input is under ``MIN_BYTES`` (the offload would keep it)."""
        forward = [p.forward_ms for p in profiles]
        backward = [ms * BACKWARD_PER_FORWARD for ms in forward]
        for i, (link, p) in enumerate(zip(self.links, profiles, strict=True)):
            if p.saving <= 0 or len(link.modules) != 1:
                continue
            moved = [p.saved_bytes if j == i else 0 for j in range(len(profiles))]
            ms = exposed_transfer_ms(forward, backward, moved, self.bandwidth_gb_s)
            options[p.name].append(LinkOption("offload", p.saving, ms, host_bytes=bucket_size(p.saved_bytes)))
            into = block_input_bytes(profiles, i)
            if not p.recomputable or into < MIN_BYTES:  # an input the offload would keep on the device
                continue
            moved = [into if j == i else 0 for j in range(len(profiles))]
            recomputed = [ms + p.forward_ms if j == i else ms for j, ms in enumerate(backward)]
            ms = p.forward_ms + exposed_transfer_ms(forward, recomputed, moved, self.bandwidth_gb_s)
            options[p.name].append(LinkOption("block_offload", p.saving + into, ms, host_bytes=bucket_size(into)))

    def _loss_option(self, meter: StepMeter, peak: int) -> LossOption | None:
        """One step with the fused loss and one without: the bytes it frees and the milliseconds it adds."""
        if refusal(self.loss_model) is not None:
            return None
        plain_s = meter.seconds()
        apply_fused_loss(self.loss_model)
        try:
            fused = self.meter()
            fused_peak, fused_s = fused.peak(), fused.seconds()
        finally:
            remove_fused_loss(self.loss_model)
        return LossOption(peak - fused_peak, (fused_s - plain_s) * 1e3)


def block_input_bytes(profiles: Sequence[BlockProfile], i: int, min_bytes: int = MIN_BYTES) -> int:
    """The bytes of link ``i``'s input that offloading what its checkpoint keeps frees, as far as the links' profiles
    tell it whatever the other links' levers: of its ``input_bytes`` (its input, where no earlier link counts it: a
    transformer layer's, saved by its first norm and by nothing before it), the storages of at least ``min_bytes``
    (the offload keeps smaller ones) that no other link takes as an input. An input the link before saved as its own
    output (a ResNet block's last ReLU's) is not among them: it leaves the device only where that link is
    checkpointed or offloaded too, and options are weighed one by one; nor is one other links are given too (an
    encoder's output, which every decoder layer takes), which stays on the device while any of them holds it. Where
    the profile has no storages (one made by hand), its ``input_bytes``.

    Example:
        >>> a = BlockProfile("a", saved_bytes=100, input_bytes=10, output_bytes=20, forward_ms=1.0)
        >>> b = BlockProfile("b", saved_bytes=100, input_bytes=0, output_bytes=20, forward_ms=1.0)
        >>> block_input_bytes([a, b], 0), block_input_bytes([a, b], 1)
        (10, 0)
        >>> decoder = BlockProfile("dec.0", 300, 68, 0, 1.0, input_storages=((40, False), (20, True), (8, False)))
        >>> block_input_bytes([decoder], 0, min_bytes=16)  # the encoder's output and a small mask left out
        40
    """
    profile = profiles[i]
    if not profile.input_storages:
        return profile.input_bytes
    return sum(size for size, shared in profile.input_storages if size >= min_bytes and not shared)


class _NoOption:
    kind = ""


_NONE = _NoOption()


def owner(peak: int, profiles: Sequence[BlockProfile]) -> str:
    """What holds the largest share of ``peak``: the link that saves the most, or what is saved outside every link
    (a language model's logits and loss) where that is more.

    Example:
        >>> owner(100, [BlockProfile("h.0", 30, 0, 0, 1.0), BlockProfile("h.1", 20, 0, 0, 1.0)])
        'the head and the loss (outside the blocks)'
        >>> owner(100, [BlockProfile("h.0", 60, 0, 0, 1.0), BlockProfile("h.1", 20, 0, 0, 1.0)])
        'h.0'
    """
    most = max(profiles, key=lambda p: p.saved_bytes, default=None)
    outside = peak - sum(p.saved_bytes for p in profiles)
    return OUTSIDE_OWNER if most is None or outside > most.saved_bytes else most.name
