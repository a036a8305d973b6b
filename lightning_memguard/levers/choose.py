"""Which levers, for a memory budget: measured figures in, a choice per link and its predicted peak out, and the search
that checks it against measured peaks (a step object: ``propose()``, ``observe()``, ``result``).

Pure: numbers in, decisions out; no torch and no Lightning import. :mod:`.plan_levers` measures what this chooses.

The levers, as the chooser sees them:

- the fused loss (:func:`~.huggingface_loss.apply_fused_loss`), for a model with a vocabulary head: one option for the
  whole model, taken first, since it frees the logits (often the largest tensor of the step) for about nothing. It
  changes what holds the peak, so every link is measured again after it, and chosen among as the model is then;
- per link (a block of the model's chain), at most one of: ``"block"`` (checkpoint the whole block: its forward again
  in backward), ``"parts"`` (checkpoint the finer links inside it, its attention and MLP: less freed, less
  recomputed), ``"pointwise"`` (recompute its chains of element-wise ops only, its matrix products kept:
  :func:`~.pointwise.recompute_pointwise`, measured by :func:`~.pointwise.measure_pointwise`) and
  ``"offload"`` (its saved activations in pinned host memory: the milliseconds are the copies' exposed time,
  :func:`~.offload.exposed_transfer_ms`, and it needs host memory, bounded) and ``"block_offload"`` (the whole block
  checkpointed and the input its checkpoint keeps in pinned host memory: what ``"block"`` frees and that input too,
  for its recomputation and its copies' exposed time).

Among the links' options, :func:`choose_levers` takes the cheapest set whose predicted peak (the peak less what each
option frees) meets the budget: cheapest in milliseconds per byte freed, a move at a time (a link's option exchanged
for one that frees more), the cheapest move that closes the gap where no way at the best rate costs less, then each
choice given back or exchanged for a cheaper one, dearest first, while the budget still holds. Offload competes on
the same terms: an offload whose copies hide (about 0 ms) is taken before any recomputation, one whose copies show
only where it is cheaper than recomputing, and never beyond the host bound.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_memguard.core.units import size_formatter

KINDS = ("block", "parts", "pointwise", "offload", "block_offload")
"""The kinds of a link's option, in the order that breaks a tie (recomputation, finest last, before offload)."""

OFFLOADED = ("offload", "block_offload")
"""The kinds that hold a link's tensors in host memory: run by the plan's ``ActivationOffload``, around the steps."""

CHECKPOINTED = ("block", "block_offload")
"""The kinds that checkpoint a link whole (``apply_plan``)."""

ROUNDS = 4
"""Sets of the links' options a :class:`LeverSearch` measures at most; the last of them frees the most it can."""

RECORD_VERSION = 1
"""The layout of :meth:`LeverPlan.record`'s dict (:func:`~.plan_levers.apply_record` refuses a later one)."""


@dataclass(frozen=True)
class LinkOption:
    """One lever for one link, measured.

    Attributes:
        kind: one of :data:`KINDS`.
        freed_bytes: bytes of the peak it frees.
        extra_ms: milliseconds it adds to a step (recomputation, or offload's exposed copies).
        host_bytes: pinned host memory it holds (offload).
    """

    kind: str
    freed_bytes: int
    extra_ms: float
    host_bytes: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"`kind` must be one of {KINDS}, got {self.kind!r}")
        if self.host_bytes < 0:
            raise ValueError(f"`host_bytes` must be >= 0, got {self.host_bytes!r}")


@dataclass(frozen=True)
class LossOption:
    """The fused loss, measured: ``freed_bytes`` of the peak it frees, ``extra_ms`` it adds to a step (negative: it
    saves time)."""

    freed_bytes: int
    extra_ms: float


@dataclass(frozen=True)
class Measurement:
    """What a measurement of the model, as a proposal left it, says.

    Attributes:
        peak: the step's peak, bytes.
        owner: what holds the largest share of it (a link's name, or the loss's logits).
        links: each link's options as measured on the model then (by link name, in the model's order); the first
            measurement's and the one after the fused loss are chosen among, later ones may leave it empty.
        loss: the fused loss's option (the first measurement only; None: the model has no vocabulary head, or it
            was refused).
    """

    peak: int
    owner: str = ""
    links: Mapping[str, Sequence[LinkOption]] = field(default_factory=dict)
    loss: LossOption | None = None


@dataclass(frozen=True)
class Proposal:
    """The levers to apply (in place of the last proposal's) and measure: the fused loss or not, and an option per
    link named (the others as they are)."""

    loss: bool
    links: Mapping[str, LinkOption] = field(default_factory=dict)


@dataclass(frozen=True)
class Choice:
    """What :func:`choose_levers` picked: an option per link, the bytes they free and the milliseconds they add."""

    links: dict[str, LinkOption]
    freed_bytes: int
    extra_ms: float
    host_bytes: int


def choose_levers(
    links: Mapping[str, Sequence[LinkOption]],
    need: float,
    host_limit: int | None = None,
) -> Choice:
    """The cheapest options (at most one per link) that free at least ``need`` bytes, within ``host_limit`` bytes of
    host memory; where no set frees that much, the set that frees the most this way (the floor).

    Ties go to the link first in ``links``' order, then to the kind first in :data:`KINDS`.

    Example:
        >>> links = {
        ...     "h.0": [LinkOption("block", 100, 10.0), LinkOption("offload", 90, 0.0, host_bytes=128)],
        ...     "h.1": [LinkOption("block", 100, 10.0), LinkOption("pointwise", 60, 1.0)],
        ... }
        >>> sorted((name, o.kind) for name, o in choose_levers(links, 150).links.items())  # hidden copies first
        [('h.0', 'offload'), ('h.1', 'pointwise')]
        >>> sorted((name, o.kind) for name, o in choose_levers(links, 150, host_limit=0).links.items())
        [('h.0', 'block'), ('h.1', 'pointwise')]
        >>> choose_levers(links, 1000).freed_bytes  # nothing frees that much: the most it can
        200
    """
    names = list(links)
    options = {name: [o for o in links[name] if o.freed_bytes > 0] for name in names}
    limit = float("inf") if host_limit is None else host_limit
    chosen: dict[str, LinkOption] = {}

    def totals(picked: Mapping[str, LinkOption]) -> tuple[int, float, int]:
        values = picked.values()
        return sum(o.freed_bytes for o in values), sum(o.extra_ms for o in values), sum(o.host_bytes for o in values)

    def moves() -> list[tuple[str, LinkOption, int, float]]:
        """Each option that frees more than its link's current one, within the host bound: (link, option, bytes
        more, milliseconds more)."""
        _, _, host = totals(chosen)
        found = []
        for name in names:
            current = chosen.get(name)
            freed, ms, held = (
                (0, 0.0, 0) if current is None else (current.freed_bytes, current.extra_ms, current.host_bytes)
            )
            for option in options[name]:
                if option.freed_bytes > freed and host - held + option.host_bytes <= limit:
                    found.append((name, option, option.freed_bytes - freed, option.extra_ms - ms))
        return found

    def order(move: tuple[str, LinkOption, int, float]) -> tuple[float, int, int]:
        name, option, more, ms = move
        return (ms / more, names.index(name), KINDS.index(option.kind))

    while totals(chosen)[0] < need and (found := moves()):
        gap = need - totals(chosen)[0]
        closing = [m for m in found if m[2] >= gap]
        best = min(found, key=order)
        if closing:  # one move closes the gap: the cheapest of those, where no way by the best rate is cheaper
            cheapest = min(closing, key=lambda m: (m[3], *order(m)))
            by_rate = best[3] if best[2] >= gap else best[3] / best[2] * gap  # the least the best rate can cost
            best = cheapest if cheapest[3] <= by_rate else best
        chosen[best[0]] = best[1]
    if totals(chosen)[0] >= need:
        _give_back(chosen, options, need, names)
    freed, ms, host = totals(chosen)
    return Choice({name: chosen[name] for name in names if name in chosen}, freed, ms, host)


def _give_back(
    chosen: dict[str, LinkOption], options: Mapping[str, Sequence[LinkOption]], need: float, names: list[str]
) -> None:
    """Each choice, dearest first, given back or exchanged for the cheapest option of its link that still meets
    ``need`` (within the host memory the set held)."""
    host_held = sum(o.host_bytes for o in chosen.values())
    for name in sorted(chosen, key=lambda n: (-chosen[n].extra_ms, names.index(n))):
        current = chosen[name]
        rest = sum(o.freed_bytes for n, o in chosen.items() if n != name)
        host_rest = host_held - current.host_bytes
        cheaper = [
            o
            for o in options[name]
            if o.extra_ms < current.extra_ms and rest + o.freed_bytes >= need and host_rest + o.host_bytes <= host_held
        ]
        if rest >= need and current.extra_ms >= 0:
            del chosen[name]
        elif cheaper:
            chosen[name] = min(cheaper, key=lambda o: (o.extra_ms, KINDS.index(o.kind)))
        host_held = sum(o.host_bytes for o in chosen.values())


@dataclass
class LeverPlan:
    """What the levers' planner chose, and its figures (bytes; milliseconds per step).

    Attributes:
        loss: the fused loss is applied.
        links: the option chosen per link, by name (in the model's order); links not named are left as they are.
        baseline_bytes: the peak before any lever.
        budget_bytes: the peak to stay under.
        loss_bytes: the peak measured with the fused loss alone (None: not taken).
        owner: what held the largest share of the peak before any lever; ``owner_after_loss`` after the fused loss.
        predicted_bytes: the peak the chosen set was predicted to reach.
        measured_bytes: the peak measured with it.
        extra_ms: milliseconds the levers add to a step (predicted from each lever's measured cost; negative: saved).
        host_bytes: pinned host memory the chosen offloads hold.
        tried: every set measured, in order: ``(what it was, peak measured)``.
        loss_refused: why the fused loss was not offered (a model without a vocabulary head), or None.
        offload: what runs the offloads chosen, to enter around the training steps (an ``ActivationOffload``, from
            :func:`~.plan_levers.plan_levers`), or None.
        checkpointed: the links checkpointed, by name: the blocks chosen whole (a ResNet's ``"stem"`` too) and the
            parts of those chosen by parts, each a run of its own as ``apply_plan(model, runs)`` takes them (with
            the ``units`` the plan was made with).
        pointwise: the links whose pointwise chains are recomputed (``recompute_pointwise(model, units=...)``, after
            the checkpoints), by name; empty where an injected lever took that kind.
        offloaded: the modules the offload holds the tensors of, by name in the model (a link's module: a stem's
            too), as ``ActivationOffload([model.get_submodule(name) for name in offloaded])`` takes them.
        loss_module: the module whose loss is fused, by name in the model (``""``: the model itself; a Hugging Face
            model held by a LightningModule: its attribute's name).
    """

    loss: bool
    links: dict[str, LinkOption]
    baseline_bytes: int
    budget_bytes: int
    loss_bytes: int | None = None
    owner: str = ""
    owner_after_loss: str | None = None
    predicted_bytes: int | None = None
    measured_bytes: int | None = None
    extra_ms: float = 0.0
    host_bytes: int = 0
    tried: list[tuple[str, int]] = field(default_factory=list)
    loss_refused: str | None = None
    offload: Any = None
    checkpointed: list[str] = field(default_factory=list)
    pointwise: list[str] = field(default_factory=list)
    loss_module: str = ""
    offloaded: list[str] = field(default_factory=list)

    @property
    def held(self) -> bool:
        """The measured peak meets the budget."""
        return self.peak_bytes <= self.budget_bytes

    @property
    def peak_bytes(self) -> int:
        """The peak measured with the plan's levers (the baseline's where nothing was measured after it; 0 is a
        measurement: every saved tensor moved off the device)."""
        return self.baseline_bytes if self.measured_bytes is None else self.measured_bytes

    def kinds(self) -> dict[str, list[str]]:
        """The links chosen, by kind of lever (:data:`KINDS`' order; kinds chosen for none left out)."""
        by_kind: dict[str, list[str]] = {}
        for kind in KINDS:
            names = [name for name, option in self.links.items() if option.kind == kind]
            if names:
                by_kind[kind] = names
        return by_kind

    def calls(self) -> list[str]:
        """The calls that apply this plan to a fresh copy of its model, one a line.

        Example:
            >>> links = {"h.0": LinkOption("block", 30, 2.0), "h.1": LinkOption("pointwise", 10, 0.2)}
            >>> plan = LeverPlan(True, links, 100, 50, checkpointed=["h.0"], pointwise=["h.1"])
            >>> for line in plan.calls():
            ...     print(line)
            apply_fused_loss(model)
            apply_plan(model, [['h.0']])
            recompute_pointwise(model, units=['h.1'])
        """
        lines = ["apply_fused_loss(model)"] if self.loss else []
        if self.checkpointed:
            lines.append(f"apply_plan(model, {[[name] for name in self.checkpointed]!r})")
        kinds = self.kinds()
        if self.pointwise:  # after the checkpoints, as plan_levers applies them
            lines.append(f"recompute_pointwise(model, units={self.pointwise!r})")
        elif "pointwise" in kinds:
            lines.append(f"the injected pointwise lever's apply(model, {kinds['pointwise']!r})")
        offloaded = self.offloaded or self._offloaded_links()
        if offloaded:  # plan.offload holds the planned model's modules: a fresh copy needs its own
            lines.append(
                f"offload = ActivationOffload([model.get_submodule(name) for name in {offloaded!r}])  # enter it"
                " around the training steps: with offload: ..."
            )
        return lines

    def _offloaded_links(self) -> list[str]:
        """The links an offload holds the tensors of (:data:`OFFLOADED` kinds), by name."""
        return [name for name, option in self.links.items() if option.kind in OFFLOADED]

    def record(self) -> dict[str, Any]:
        """What was chosen as plain data (bools, strings, lists of strings), to keep beside a checkpoint and hand to
        :func:`~.plan_levers.apply_record` on a fresh copy of the model: the same levers, nothing measured.

        Raises:
            ValueError: a plan with offload or an injected lever chosen: offload is a context around the steps (enter
                ``plan.offload``), an injected lever is applied by its own code; neither is a change a record holds.

        Example:
            >>> links = {"h.0": LinkOption("block", 30, 2.0), "h.1": LinkOption("pointwise", 10, 0.2)}
            >>> LeverPlan(True, links, 100, 50, checkpointed=["h.0"], pointwise=["h.1"], loss_module="model").record()
            {'version': 1, 'fused_loss': True, 'loss_module': 'model', 'checkpointed': ['h.0'], 'pointwise': ['h.1']}
        """
        offloaded = self._offloaded_links()
        if offloaded:
            raise ValueError(
                f"the plan offloads {offloaded!r}: offload is a context around the training steps (enter"
                " `plan.offload`), not a change to the model that a record re-applies"
            )
        injected = [name for name, o in self.links.items() if o.kind == "pointwise" and name not in self.pointwise]
        if injected:
            raise ValueError(f"the plan holds an injected lever on {injected!r}: its own code applies it, not a record")
        return {
            "version": RECORD_VERSION,
            "fused_loss": self.loss,
            "loss_module": self.loss_module,
            "checkpointed": list(self.checkpointed),
            "pointwise": list(self.pointwise),
        }

    def summary(self) -> str:
        """One line: the levers taken, the figures, and where the budget is not met, the floor reached.

        Example:
            >>> plan = LeverPlan(True, {"h.0": LinkOption("block", 30, 2.0)}, baseline_bytes=100_000_000,
            ...                  budget_bytes=40_000_000, loss_bytes=50_000_000, owner="the loss's logits",
            ...                  owner_after_loss="h.0", predicted_bytes=38_000_000, measured_bytes=39_000_000,
            ...                  extra_ms=2.5)
            >>> print(plan.summary())  # doctest: +NORMALIZE_WHITESPACE
            levers: the fused loss (peak 100.0 MB -> 50.0 MB; it was held by the loss's logits, then by h.0), block
            recomputed in h.0; budget 40.0 MB, predicted 38.0 MB, measured 39.0 MB, +2.5 ms per step
        """
        size = size_formatter(self.baseline_bytes or self.budget_bytes)
        taken = []
        if self.loss:
            after = f", then by {self.owner_after_loss}" if self.owner_after_loss else ""
            held = f"; it was held by {self.owner}{after}" if self.owner else ""
            taken.append(f"the fused loss (peak {size(self.baseline_bytes)} -> {size(self.loss_bytes or 0)}{held})")
        words = {"block": "block recomputed", "parts": "parts recomputed", "pointwise": "pointwise chains recomputed",
                 "offload": "offloaded", "block_offload": "block recomputed, its input offloaded"}  # fmt: skip
        for kind, names in self.kinds().items():
            taken.append(f"{words[kind]} in {', '.join(names)}")
        text = f"levers: {', '.join(taken) if taken else 'none'}; budget {size(self.budget_bytes)}"
        if self.predicted_bytes is not None:
            text += f", predicted {size(self.predicted_bytes)}"
        text += f", measured {size(self.peak_bytes)}, {self.extra_ms:+.1f} ms per step"
        if self.host_bytes:
            text += f", {size(self.host_bytes)} of pinned host memory"
        if not self.held:
            floor = self.peak_bytes
            share = round(100 * floor / max(self.baseline_bytes, 1))
            tried = "; ".join(f"{what}: {size(peak)}" for what, peak in self.tried)
            text += (
                f"; budget not met: the floor reached is {size(floor)} ({share} % of baseline"
                f" {size(self.baseline_bytes)}), every lever that frees memory taken; tried {tried}"
            )
        if self.loss_refused:
            text += f"; no fused loss: {self.loss_refused}"
        return text


class LeverSearch:
    """The levers for a budget, as a step object: :meth:`propose` names the levers to apply and measure,
    :meth:`observe` takes the :class:`Measurement`, :attr:`result` is the :class:`LeverPlan`.

    1. The model as it is: its peak, what holds it, its links' options and the fused loss's (``Measurement.loss``).
       Within the budget: nothing to do.
    2. Over it, with a fused loss that frees memory: the fused loss alone, measured again with every link's options
       (the logits no longer hold the peak: a block may, and what each link frees is read again). A fused loss that
       did not lower the peak as measured is left out.
    3. The links' options: :func:`choose_levers` for the gap left, applied and measured. Over the budget as measured,
       the need is read again from the sets measured (:meth:`_need`): after one, the gap widened by the most a
       prediction missed; after two, also the bytes the line through their last two points (freed as measured
       against freed as predicted) says would close it, so that a miss that grows with the set (a share of each
       link's bytes) is caught as well as one that does not (the one block recomputed in backward). The
       :data:`ROUNDS`-th set is the one that frees the most (the floor). The result is the first set measured within
       the budget, else the one of the lowest peak; where that one offloads, the floor without offload is measured
       as well and the lower taken (copies that do not free on the card what they free in the count cannot make a
       plan worse than recomputation alone). The last proposal is always the result's own set, measured.

    Args:
        budget: the peak to stay under, bytes, or a fraction of the first measured peak (a float).
        host_limit: the most pinned host memory offload may hold, bytes (None: no bound).

    Example:
        >>> search = LeverSearch(budget=0.5)
        >>> search.propose()
        Proposal(loss=False, links={})
        >>> blocks = {"h.0": [LinkOption("block", 30, 3.0)], "h.1": [LinkOption("block", 30, 3.0)]}
        >>> search.observe(Measurement(100, "the loss's logits", blocks, loss=LossOption(40, -1.0)))
        >>> search.propose()  # the fused loss first
        Proposal(loss=True, links={})
        >>> search.observe(Measurement(65, "h.0", {"h.0": [LinkOption("block", 20, 3.0)], "h.1": blocks["h.1"]}))
        >>> search.propose().links  # 15 over: one block
        {'h.1': LinkOption(kind='block', freed_bytes=30, extra_ms=3.0, host_bytes=0)}
        >>> search.observe(Measurement(36))
        >>> search.propose() is None, search.result.held, search.result.extra_ms
        (True, True, 2.0)
    """

    def __init__(self, budget: int | float, host_limit: int | None = None) -> None:
        if isinstance(budget, bool) or not isinstance(budget, int | float) or budget <= 0:
            raise ValueError(f"`budget` must be a positive number of bytes or a fraction, got {budget!r}")
        if isinstance(budget, float) and budget > 1:
            raise ValueError(f"`budget` as a fraction must be in (0, 1], got {budget!r}")
        if host_limit is not None and host_limit < 0:
            raise ValueError(f"`host_limit` must be >= 0 or None, got {host_limit!r}")
        self._budget = budget
        self.host_limit = host_limit
        self.budget: int | None = None if isinstance(budget, float) else budget
        self._pending: Proposal | None = Proposal(False)
        self._phase = "baseline"  # -> "loss" -> "links" -> "final" -> "done"
        self._baseline: Measurement | None = None
        self._start: Measurement | None = None  # the measurement the links are chosen on
        self._loss = False
        self._loss_bytes: int | None = None
        self._choices: list[tuple[Choice, int, int]] = []  # each set measured: its choice, predicted, measured peak
        self._final: tuple[Choice, int, int] | None = None
        self._copyless = False  # the floor without offload was proposed (an offloading set measured over the budget)
        self._last = Proposal(False)
        self.tried: list[tuple[str, int]] = []

    def propose(self) -> Proposal | None:
        """The levers to apply and measure next, or None when the search is over."""
        return self._pending

    def observe(self, measured: Measurement) -> None:
        """The measurement of the model as the last proposal left it."""
        if self._pending is None:
            raise RuntimeError("LeverSearch.observe() called after the search ended")
        proposal = self._last = self._pending
        self.tried.append((_describe(proposal), measured.peak))
        if self._phase == "baseline":
            self._baseline = self._start = measured
            if self.budget is None:
                self.budget = max(1, int(measured.peak * self._budget))
            loss = measured.loss
            if measured.peak <= self.budget:
                self._end(Choice({}, 0, 0.0, 0), measured.peak, measured.peak)
            elif loss is not None and loss.freed_bytes > 0:
                self._phase, self._pending = "loss", Proposal(True)
            else:
                self._choose()
        elif self._phase == "loss":
            assert self._baseline is not None
            if measured.peak < self._baseline.peak:  # measured, not taken on trust
                self._loss, self._loss_bytes, self._start = True, measured.peak, measured
            if self._loss and measured.peak <= self.budget:  # type: ignore[operator]
                self._end(Choice({}, 0, 0.0, 0), measured.peak, measured.peak)
            else:
                self._choose()
        elif self._phase == "links":
            choice, predicted, _ = self._choices[-1]
            self._choices[-1] = (choice, predicted, measured.peak)
            if measured.peak <= self.budget or self._copyless:  # type: ignore[operator]
                self._finish()
            else:
                self._choose()
        else:  # "final": the result's own set, measured last
            assert self._final is not None
            choice, predicted, _ = self._final
            self._final = (choice, predicted, measured.peak)
            self._phase, self._pending = "done", None

    @property
    def result(self) -> LeverPlan | None:
        """The plan, once :meth:`propose` returns None."""
        if self._pending is not None or self._final is None or self._baseline is None:
            return None
        choice, predicted, peak = self._final
        loss_ms = self._baseline.loss.extra_ms if self._loss and self._baseline.loss is not None else 0.0
        return LeverPlan(
            loss=self._loss,
            links=dict(choice.links),
            baseline_bytes=self._baseline.peak,
            budget_bytes=self.budget,  # type: ignore[arg-type]
            loss_bytes=self._loss_bytes,
            owner=self._baseline.owner,
            owner_after_loss=self._start.owner if self._loss and self._start is not None else None,
            predicted_bytes=predicted,
            measured_bytes=peak,
            extra_ms=round(choice.extra_ms + loss_ms, 6),
            host_bytes=choice.host_bytes,
            tried=list(self.tried),
        )

    def _choose(self) -> None:
        """Choose the links' options for the need :meth:`_need` reads (the last round: the set that frees the most);
        settle where that changes nothing."""
        assert self._start is not None
        start = self._start
        need = float("inf") if len(self._choices) == ROUNDS - 1 else self._need()  # the floor: all that frees memory
        choice = choose_levers(start.links, need, self.host_limit)
        if self._choices and choice.links == self._choices[-1][0].links:  # nothing more to take: the floor
            self._finish()
        elif not choice.links:  # no lever frees anything: the model as it is (with the fused loss, where taken)
            self._end(choice, start.peak, start.peak)
        else:
            self._choices.append((choice, start.peak - choice.freed_bytes, start.peak))
            self._phase, self._pending = "links", Proposal(self._loss, choice.links)

    def _need(self) -> float:
        """The bytes the links must free, as predicted, for the measured peak to meet the budget: the gap; widened by
        the most a measured set's prediction missed; and after two sets, at least what the line through the last two
        (freed as measured against freed as predicted) says closes the gap. Where the second freed no more than the
        first as measured, more of the same will not do: every lever (the floor)."""
        assert self._start is not None and self.budget is not None
        gap = self._start.peak - self.budget
        sets = [(choice.freed_bytes, self._start.peak - peak) for choice, _, peak in self._choices]  # freed: said, seen
        need: float = gap + max((predicted - measured for predicted, measured in sets), default=0)
        if len(sets) >= 2:
            (predicted_1, measured_1), (predicted_2, measured_2) = sets[-2:]
            if measured_2 <= measured_1 or predicted_2 <= predicted_1:
                return float("inf")
            slope = (measured_2 - measured_1) / (predicted_2 - predicted_1)
            need = max(need, predicted_2 + (gap - measured_2) / slope)
        return max(need, gap)

    def _finish(self) -> None:
        """The first set measured within the budget, else the one of the lowest peak. Where none held and the lowest
        offloads (its copies may hold memory the prediction freed: a card's streams, not the CPU's ledger), the floor
        without offload is measured too, once, and the lower of the two taken."""
        held = [c for c in self._choices if c[2] <= self.budget]  # type: ignore[operator]
        lowest = min(self._choices, key=lambda c: c[2])
        if not held and not self._copyless and any(o.kind in OFFLOADED for o in lowest[0].links.values()):
            self._copyless = True
            assert self._start is not None
            options = {name: [o for o in each if o.kind not in OFFLOADED] for name, each in self._start.links.items()}
            choice = choose_levers(options, float("inf"), self.host_limit)
            if choice.links and all(choice.links != c[0].links for c in self._choices):
                self._choices.append((choice, self._start.peak - choice.freed_bytes, self._start.peak))
                self._phase, self._pending = "links", Proposal(self._loss, choice.links)
                return
        self._end(*(held[0] if held else lowest))

    def _end(self, choice: Choice, predicted: int, peak: int) -> None:
        """Settle for ``choice``: done where the model is as it says (the last proposal), else measured once more."""
        self._final = (choice, predicted, peak)
        proposal = Proposal(self._loss, choice.links)
        if proposal == self._last:
            self._phase, self._pending = "done", None
        else:
            self._phase, self._pending = "final", proposal


def _describe(proposal: Proposal) -> str:
    """A proposal in words, for :attr:`LeverPlan.tried`."""
    parts = ["fused loss"] if proposal.loss else []
    parts += [f"{name}: {option.kind}" for name, option in proposal.links.items()]
    return ", ".join(parts) or "as it is"
