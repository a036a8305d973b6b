"""Which blocks to checkpoint for a memory budget: profiles in, a choice and its predicted peak out, and the
searches that check it against measured peaks (step objects: ``propose()``, ``observe()``, ``result``).

Pure: numbers in, decisions out; no torch and no Lightning import. :mod:`.plan_eager` and :mod:`.plan_compiled`
measure what these choose.

The model is a chain of links (a ResNet: its stem, then its blocks), each feeding the next. Adjacent chosen links
that may be joined can be checkpointed as one run: the tensors between them are freed too, at no extra
recomputation, but the whole run's activations come back at once when it is recomputed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Part:
    """A finer link: a module inside link ``link`` (a transformer layer's attention or MLP), measured like a link.
    Checkpointed in a link left unchecked, it frees its own activations but its input and output, for its own
    forward again in backward; inside a checkpointed link (nested), the link's recomputation holds that much less at
    once, for the part's forward a third time."""

    link: int
    profile: BlockProfile


@dataclass(frozen=True)
class BlockProfile:
    """One link of the chain, measured on a real batch.

    Attributes:
        name: the link's name (a block's qualified name in the model, or ``"stem"``).
        saved_bytes: activations first saved for backward while it runs.
        input_bytes: its input's bytes that a run starting here keeps and no earlier link counts: the part of
            ``saved_bytes`` that is its input, plus, with the rebuild, an input the link before rebuilds.
        output_bytes: its output's bytes, kept when a run ends here (the next link needs it): the part of
            ``saved_bytes`` that is its output, or with the rebuild, an output it would otherwise rebuild.
        forward_ms: its forward time (paid again in backward when it is checkpointed).
        recomputed_bytes: activations its recomputation brings back at once, where that differs from
            ``saved_bytes`` (a block that keeps less than a plain one while it is not checkpointed).
        one_tensor: its output is one tensor. A run hands each member's output to the next inside one checkpoint
            and keeps its last output by a weak reference, so only links that give one tensor are joined (HRNet's
            stages, which pass lists, are checkpointed one by one).
        calls: how many times its forward ran in the step. A run's first link runs the others after it on every
            call, so one called again outside its ``nn.Sequential`` (a block used twice) begins no run.
        recomputable: a checkpoint may recompute it. False where it changes its input in place in its forward (its
            recomputation would start from the changed input) or its forward runs past the hooks (nothing is known
            of it): it is never chosen.
        input_storages: ``input_bytes`` storage by storage: each one's bytes charged to this link, and whether
            another link takes it as an input too (an encoder's output, which every decoder layer is given): what
            moving this link's input alone would, or would not, take off the device.
    """

    name: str
    saved_bytes: int
    input_bytes: int
    output_bytes: int
    forward_ms: float
    recomputed_bytes: int | None = None
    one_tensor: bool = True
    calls: int = 1
    recomputable: bool = True
    input_storages: tuple[tuple[int, bool], ...] = ()

    @property
    def recomputed(self) -> int:
        """Bytes that come back while this link is recomputed in backward."""
        return self.saved_bytes if self.recomputed_bytes is None else self.recomputed_bytes

    @property
    def saving(self) -> int:
        """Bytes freed by checkpointing this link alone."""
        return max(0, self.saved_bytes - self.input_bytes - self.output_bytes)


def budget_bytes(baseline: int, memory_budget: float | int) -> int:
    """A fraction of the baseline peak, or bytes as they are.

    Example:
        >>> budget_bytes(1000, 0.6), budget_bytes(1000, 700)
        (600, 700)
    """
    return int(baseline * memory_budget) if isinstance(memory_budget, float) else memory_budget


def best_runs(
    chosen: set[int],
    profiles: Sequence[BlockProfile],
    baseline: int,
    joinable: Sequence[bool],
    gradients: bool = True,
    parts: Sequence[Part] = (),
) -> list[list[int]]:
    """Where to cut the chosen links into runs (``parts``: the finer links checkpointed with them). Joining two runs
    frees the tensor between them but brings back more at once when they are recomputed; runs are joined, the best
    join first, while that lowers the predicted peak.

    Example:
        >>> a = BlockProfile("a", saved_bytes=100, input_bytes=10, output_bytes=20, forward_ms=1.0)
        >>> b = BlockProfile("b", saved_bytes=100, input_bytes=0, output_bytes=20, forward_ms=1.0)
        >>> c = BlockProfile("c", saved_bytes=400, input_bytes=0, output_bytes=0, forward_ms=1.0)
        >>> best_runs({0, 1}, [a, b, c], 1000, [True, True])  # c still holds its own: join a and b
        [[0, 1]]
        >>> best_runs({0, 1, 2}, [a, b, c], 1000, [True, True])  # one run of all would bring everything back
        [[0, 1], [2]]
        >>> listing = BlockProfile("a", saved_bytes=100, input_bytes=10, output_bytes=20, forward_ms=1.0,
        ...                        one_tensor=False)  # gives a list: never joined
        >>> best_runs({0, 1}, [listing, b, c], 1000, [True, True])
        [[0], [1]]
    """
    runs = [[i] for i in sorted(chosen)]
    peak = predict_peak(baseline, profiles, runs, gradients, parts)
    while True:
        best: tuple[int, list[list[int]]] | None = None
        for k in range(len(runs) - 1):
            left, right = runs[k], runs[k + 1]
            if right[0] != left[-1] + 1 or not joinable[left[-1]]:
                continue
            if not (profiles[left[-1]].one_tensor and profiles[right[0]].one_tensor) or profiles[left[0]].calls > 1:
                continue
            trial = [*runs[:k], left + right, *runs[k + 2 :]]
            trial_peak = predict_peak(baseline, profiles, trial, gradients, parts)
            if trial_peak < peak and (best is None or trial_peak < best[0]):
                best = (trial_peak, trial)
        if best is None:
            return runs
        peak, runs = best


def predict_peak(
    baseline: int,
    profiles: Sequence[BlockProfile],
    runs: Sequence[Sequence[int]],
    gradients: bool = True,
    parts: Sequence[Part] = (),
) -> int:
    """Peak of a step with ``runs`` checkpointed: the larger of the end of the forward pass (what the runs free is
    gone) and each run's recomputation in backward (the run's own activations are back, the links after it are
    already freed, and with ``gradients``, gradients as large as the run's output flow through it: about twice that
    is held; leave them out where the baseline counts saved activations only, as on the CPU).

    ``parts`` are the finer links checkpointed too (:class:`Part`): in a link left unchecked, a part frees what it
    saves but its input and output, and brings it back when it is recomputed (the link's own bytes before it still
    held); in a checkpointed link, the link's recomputation brings back that much less, and the part's own
    recomputation brings it back on top of the rest.

    Example:
        >>> a = BlockProfile("a", saved_bytes=100, input_bytes=10, output_bytes=20, forward_ms=1.0)
        >>> b = BlockProfile("b", saved_bytes=100, input_bytes=0, output_bytes=20, forward_ms=1.0)
        >>> c = BlockProfile("c", saved_bytes=400, input_bytes=0, output_bytes=0, forward_ms=1.0)
        >>> predict_peak(1000, [a, b, c], [[0]])  # a alone: its input and output stay
        930
        >>> predict_peak(1000, [a, b, c], [[0, 1]])  # a and b as one run: a's output is freed too
        830
        >>> predict_peak(1000, [a, b, c], [[2]])  # the last link is recomputed while all before it is still held
        1000
        >>> lean = BlockProfile("c", saved_bytes=300, input_bytes=0, output_bytes=0, forward_ms=1.0,
        ...                     recomputed_bytes=400)  # keeps 300 unchecked, brings back 400 when recomputed
        >>> predict_peak(900, [a, b, lean], [[2]])
        1000
        >>> attn = Part(2, BlockProfile("c.attn", saved_bytes=160, input_bytes=10, output_bytes=0, forward_ms=0.5))
        >>> mlp = Part(2, BlockProfile("c.mlp", saved_bytes=170, input_bytes=10, output_bytes=0, forward_ms=0.5))
        >>> predict_peak(1000, [a, b, c], [], parts=[mlp])  # c keeps 240, and gets 160 back while all else is held
        1000
        >>> predict_peak(1000, [a, b, c], [[0, 1], [2]])  # c checkpointed: its recomputation brings back all 400
        830
        >>> predict_peak(1000, [a, b, c], [[0, 1], [2]], parts=[attn, mlp])  # nested: 90, then 160 at most on top
        680
    """
    total = sum(p.saved_bytes for p in profiles)
    other = baseline - total  # weights, gradients, the head's activations
    kept = [p.saved_bytes for p in profiles]
    recomputed = [p.recomputed for p in profiles]
    run_of = {i: run for run in runs for i in run}
    for part in parts:
        if part.link in run_of:
            recomputed[part.link] = max(0, recomputed[part.link] - part.profile.saving)
        else:
            kept[part.link] = max(0, kept[part.link] - part.profile.saving)
    for run in runs:
        for i in run:
            kept[i] = 0
        kept[run[0]] += profiles[run[0]].input_bytes
        kept[run[-1]] += profiles[run[-1]].output_bytes
    peak = other + sum(kept)

    def grad(last: int) -> int:
        """The gradient flowing out of link ``last``; at the chain's end it is part of the baseline's own peak."""
        return max(profiles[last].output_bytes, profiles[last + 1].input_bytes) if last + 1 < len(profiles) else 0

    for run in runs:
        live = other + sum(kept[: run[0]]) + sum(recomputed[i] for i in run) + 2 * grad(run[-1]) * gradients
        peak = max(peak, live)
    for part in parts:  # a part's recomputation, on top of its link's (nested) or of what its link keeps
        within = run_of.get(part.link)
        if within:
            held, last = sum(kept[: within[0]]) + sum(recomputed[i] for i in within), within[-1]
        else:
            held, last = sum(kept[: part.link + 1]), part.link
        peak = max(peak, other + held + part.profile.saving + 2 * grad(last) * gradients)
    return peak


def value(profile: BlockProfile) -> float:
    """Bytes freed per millisecond of recomputation."""
    return profile.saving / max(profile.forward_ms, 1e-6)


def choose_blocks(
    profiles: Sequence[BlockProfile],
    baseline: int,
    budget: int,
    joinable: Sequence[bool] | None = None,
    gradients: bool = True,
    parts: Sequence[Part] = (),
) -> tuple[set[int], list[list[int]], int]:
    """The cheapest set of links, greedily by :func:`value`, whose predicted peak, cut into runs by
    :func:`best_runs`, fits ``budget``.

    With ``parts`` (finer links, :class:`Part`), index ``len(profiles) + k`` is ``parts[k]``: first links and parts
    of links left unchecked are chosen, most valuable first (a link chosen takes its parts' place); where even every
    link does not fit, parts inside the checkpointed links are added, most valuable first, each only where it lowers
    the predicted peak (nested, a part makes its link's recomputation hold less at once).

    Returns the chosen indices, the links' runs and the predicted peak. If no set fits, every link is chosen (every
    link a checkpoint may recompute: one that is not, :attr:`BlockProfile.recomputable`, never is).

    Example:
        >>> cheap = BlockProfile("cheap", saved_bytes=400, input_bytes=100, output_bytes=0, forward_ms=1.0)
        >>> dear = BlockProfile("dear", saved_bytes=400, input_bytes=100, output_bytes=0, forward_ms=4.0)
        >>> small = BlockProfile("small", saved_bytes=60, input_bytes=50, output_bytes=0, forward_ms=1.0)
        >>> choose_blocks([dear, small, cheap], baseline=1000, budget=900, joinable=[False, False])
        ({0, 2}, [[0], [2]], 700)
        >>> mlp = Part(0, BlockProfile("dear.mlp", saved_bytes=250, input_bytes=50, output_bytes=0, forward_ms=1.0))
        >>> choose_blocks([dear, small, cheap], 1000, 900, [False, False], parts=[mlp])  # the MLP, not all of dear
        ({2, 3}, [[2]], 800)
        >>> layer = BlockProfile("layer", saved_bytes=400, input_bytes=100, output_bytes=0, forward_ms=2.05)
        >>> attn = Part(0, BlockProfile("layer.attn", saved_bytes=200, input_bytes=50, output_bytes=0, forward_ms=0.9))
        >>> mlp = Part(0, BlockProfile("layer.mlp", saved_bytes=200, input_bytes=50, output_bytes=0, forward_ms=1.0))
        >>> choose_blocks([layer, small, cheap], 1000, 800, [False, False], parts=[attn, mlp])  # both: the layer
        ({0, 2}, [[0], [2]], 700)
    """
    joins = list(joinable) if joinable is not None else [False] * max(len(profiles) - 1, 0)
    n = len(profiles)
    candidates = [*profiles, *(part.profile for part in parts)]
    order = sorted(
        (i for i, c in enumerate(candidates) if c.recomputable),
        key=lambda i: (-value(candidates[i]), -candidates[i].saving, i),
    )

    def planned(chosen: set[int]) -> tuple[list[list[int]], int]:
        finer = [parts[i - n] for i in sorted(chosen) if i >= n]
        runs = best_runs({i for i in chosen if i < n}, profiles, baseline, joins, gradients, finer)
        return runs, predict_peak(baseline, profiles, runs, gradients, finer)

    def whole_for_parts(
        chosen: set[int], link: int, runs: list[list[int]], peak: int
    ) -> tuple[set[int], list[list[int]], int]:
        """Every part of ``link`` chosen: the link instead, where its forward costs no more than theirs (within
        10 %) and the peak is no higher (its checkpoint frees what is between its parts too)."""
        own = [n + k for k, part in enumerate(parts) if part.link == link]
        if not set(own) <= chosen or profiles[link].forward_ms > 1.1 * sum(
            parts[j - n].profile.forward_ms for j in own
        ):
            return chosen, runs, peak
        trial = (chosen - set(own)) | {link}
        trial_runs, trial_peak = planned(trial)
        return (trial, trial_runs, trial_peak) if trial_peak <= peak else (chosen, runs, peak)

    chosen: set[int] = set()
    runs, peak = planned(chosen)
    for nested in (False, True):
        for i in order:
            if peak <= budget:
                break
            if i in chosen or (i >= n and (parts[i - n].link in chosen) != nested):
                continue
            trial = chosen | {i}
            if i < n:  # the link's checkpoint takes its parts' place
                trial -= {j for j in trial if j >= n and parts[j - n].link == i}
            trial_runs, trial_peak = planned(trial)
            if i >= n and trial_peak >= peak:
                continue  # a part that frees nothing at the peak (recomputed while all else is held)
            chosen, runs, peak = trial, trial_runs, trial_peak
            if i >= n and not nested:
                chosen, runs, peak = whole_for_parts(chosen, parts[i - n].link, runs, peak)
    return chosen, runs, peak


NEAR = 0.01
"""Where no set of links fits a budget, peaks within this share of the lowest seen count as the same floor."""


class BudgetSearch:
    """Which links to checkpoint so that the *measured* peak fits ``budget``, as a step object.

    It starts from a predicted choice (:func:`choose_blocks`). :meth:`propose` names the set of links to apply and
    measure next; :meth:`observe` takes that set's measured peak. While the peak is over the budget, the most
    valuable link not yet chosen is added. Once it fits, each chosen link is given back in turn, least valuable
    first, and stays out if the peak still fits. If nothing fits, the set with the lowest peak seen is kept, unless
    a smaller set came within :data:`NEAR` of that peak (the smallest such: a hair of memory is not worth a block's
    recomputation, as nested finer links that lower the floor by 0.1 % for 30 % more time). The last proposal is
    always the result's own set, measured, so the model ends in the state the result describes.

    Args:
        chosen: the predicted choice (link indices).
        values: each link's value (bytes freed per millisecond of recomputation), by index.
        budget: the peak to stay under, in bytes.
        give_back: try giving links back once it fits (one measurement per chosen link); False where a measurement
            is dear (under ``torch.compile`` each one compiles the model).
        savings: each link's predicted bytes freed, by index; given, a set that does not fit gets as many more
            links at once as the gap needs, their predicted savings scaled by how much of its prediction the last
            set really freed (where a measurement is dear: fewer of them); without, one link at a time.
        among: the links it may add or give back (default: all); the others of ``chosen`` stay chosen.

    With ``savings``:

        >>> search = BudgetSearch(set(), values=[3.0, 2.0, 1.0], budget=50, give_back=False, savings=[20, 20, 20])
        >>> search.observe(100)  # nothing chosen, 50 over: each link is predicted to free 20
        >>> sorted(search.propose())  # three links are needed for 50
        [0, 1, 2]

    Example:
        >>> peaks = {(): 100, (0,): 80, (0, 1): 60, (1,): 70}
        >>> search = BudgetSearch({0}, values=[3.0, 2.0], budget=70)
        >>> while (links := search.propose()) is not None:
        ...     search.observe(peaks[tuple(sorted(links))])
        >>> search.tried, search.result
        ([((0,), 80), ((0, 1), 60), ((0,), 80), ((1,), 70), ((1,), 70)], ({1}, 70))

    Nothing fits: the lowest peak, unless a smaller set came within 1 % of it:

        >>> peaks = {(0,): 1004, (0, 1): 1000, (0, 1, 2): 995}
        >>> search = BudgetSearch({0}, values=[3.0, 2.0, 1.0], budget=900)
        >>> while (links := search.propose()) is not None:
        ...     search.observe(peaks[tuple(sorted(links))])
        >>> search.result
        ({0}, 1004)
    """

    def __init__(
        self,
        chosen: set[int],
        values: Sequence[float],
        budget: int,
        give_back: bool = True,
        savings: Sequence[int] | None = None,
        among: Iterable[int] | None = None,
    ) -> None:
        self.budget = budget
        self.give_back = give_back
        self._savings = None if savings is None else list(savings)
        self._first: tuple[int, int] | None = None  # (peak, predicted saving) of the first set measured
        self._values = list(values)
        self._chosen = set(chosen)
        self._among = set(range(len(self._values))) if among is None else set(among)
        self._rest = sorted(self._among - self._chosen, key=lambda i: -self._values[i])
        self._phase = "add"  # "add" -> "give back" -> "final" -> "done"
        self._pending: set[int] | None = set(self._chosen)
        self._give_back: list[int] = []
        self._trying: int | None = None
        self._lowest: tuple[int, set[int]] | None = None
        self._measured: int | None = None
        self.tried: list[tuple[tuple[int, ...], int]] = []  # every set measured, in order, and its peak

    def propose(self) -> set[int] | None:
        """The links to apply and measure next, or None when the search is over."""
        return None if self._pending is None else set(self._pending)

    def observe(self, peak: int) -> None:
        """The measured peak of the last proposal."""
        if self._pending is None:
            raise RuntimeError("BudgetSearch.observe() called after the search ended")
        proposed = self._pending
        self.tried.append((tuple(sorted(proposed)), peak))
        if self._lowest is None or peak < self._lowest[0]:
            self._lowest = (peak, set(proposed))
        if self._phase == "add":
            if peak > self.budget and self._rest:  # the prediction was optimistic: add the next best link(s)
                if self._savings is None:
                    self._chosen.add(self._rest.pop(0))
                else:
                    self._add_for_gap(proposed, peak)
                self._pending = set(self._chosen)
            elif peak <= self.budget and not self.give_back:
                self._measured, self._pending, self._phase = peak, None, "done"  # this set, just measured
            elif peak <= self.budget:  # it fits: give back what it fits without, least valuable first
                self._phase = "give back"
                self._give_back = sorted(self._chosen & self._among, key=lambda i: self._values[i])
                self._next_give_back()
            else:  # nothing fits: the lowest peak seen, or the smallest set near it
                lowest = self._lowest[0]
                near = [set(links) for links, seen in self.tried if seen <= lowest + NEAR * lowest]
                self._chosen = min(near, key=len)
                self._finish()
        elif self._phase == "give back":
            if peak <= self.budget:
                self._chosen.discard(self._trying)  # type: ignore[arg-type]
            self._next_give_back()
        else:  # "final": the result's own set, measured last
            self._measured = peak
            self._pending = None
            self._phase = "done"

    @property
    def result(self) -> tuple[set[int], int] | None:
        """The chosen links and their measured peak, once :meth:`propose` returns None."""
        return None if self._measured is None else (set(self._chosen), self._measured)

    def _add_for_gap(self, proposed: set[int], peak: int) -> None:
        """Add the next most valuable links until their scaled predicted savings cover what is still over."""
        savings = self._savings
        assert savings is not None
        predicted = sum(savings[i] for i in proposed)
        if self._first is None:
            self._first = (peak, predicted)
        first_peak, first_predicted = self._first
        freed, expected = first_peak - peak, predicted - first_predicted
        scale = min(1.0, max(0.1, freed / expected)) if expected > 0 and freed > 0 else 1.0
        gap, added, count = peak - self.budget, 0, 0
        while self._rest and (count == 0 or added * scale < gap):  # at least one
            i = self._rest.pop(0)
            self._chosen.add(i)
            added, count = added + savings[i], count + 1

    def _next_give_back(self) -> None:
        if self._give_back:
            self._trying = self._give_back.pop(0)
            self._pending = self._chosen - {self._trying}
        else:
            self._finish()

    def _finish(self) -> None:
        self._phase = "final"
        self._pending = set(self._chosen)


@dataclass(frozen=True)
class Combination:
    """One combination measured by :class:`CompileBudgetSearch`: compile's setting (an index into its settings),
    the links checkpointed, the peak in bytes and the seconds per step."""

    setting: int
    links: frozenset[int]
    peak: int
    seconds: float


class CompileBudgetSearch:
    """Which of compile's settings, with which links checkpointed, is the fastest combination within a budget, as a
    step object: :meth:`propose` names ``(setting index, links)`` to apply and measure compiled, :meth:`observe` takes
    its peak and step time, :attr:`result` is the pick.

    Every setting is measured alone first (the first of them, compile's default, sets the budget where ``budget``
    is a function of its peak). Then each setting that does not fit alone, fastest alone first, gets links added
    (:class:`BudgetSearch` without giving back, as many links at once as the gap needs) until it fits. It rests on
    a heuristic, since each measurement under compile costs a compile: checkpointing more links, or a lower setting,
    adds recomputation and is taken not to make a step faster. So a setting is left as soon as it is no faster than
    a fit already found (alone, or with links that still do not fit), and a set that holds all the links of a fit
    under a setting no lower than its own is not measured. The heuristic can miss the fastest combination: compile's
    choices are not monotonic (on the H200 a ResNet50 with every block ran 19 % faster under setting 0.5 than under
    0.8, both slower than compile's default with them), and step times are compared as measured, without a margin
    for their noise (about 2 %).

    Args:
        levels: each setting's ``activation_memory_budget``, compile's default first (its value in force).
        first: the links predicted to bring a setting's peak alone within the budget: ``first(peak, budget)``.
        values: each link's value (bytes freed per millisecond of recomputation), by index.
        savings: each link's predicted bytes freed, by index.
        budget: the peak to stay under, in bytes, or a function of compile's default peak alone (in bytes).

    Example:
        >>> peaks = {(0, ()): 100, (1, ()): 70, (0, (0,)): 60}
        >>> times = {(0, ()): 1.0, (1, ()): 1.3, (0, (0,)): 1.2}
        >>> search = CompileBudgetSearch([1.0, 0.5], lambda peak, budget: {0}, [3.0, 2.0], [40, 20], budget=75)
        >>> while (step := search.propose()) is not None:
        ...     key = (step[0], tuple(sorted(step[1])))
        ...     search.observe(peaks[key], times[key])
        >>> [(c.setting, sorted(c.links), c.peak) for c in search.tried], search.budget
        ([(0, [], 100), (1, [], 70), (0, [0], 60)], 75)
        >>> pick = search.tried[search.result]
        >>> pick.setting, sorted(pick.links)
        (0, [0])
    """

    def __init__(
        self,
        levels: Sequence[float],
        first: Callable[[int, int], set[int]],
        values: Sequence[float],
        savings: Sequence[int],
        budget: int | Callable[[int], int],
    ) -> None:
        if not levels:
            raise ValueError("no settings to search")
        self._levels, self._first, self._values, self._savings = list(levels), first, list(values), list(savings)
        self._budget = budget
        self.budget: int | None = None if callable(budget) else int(budget)
        self.tried: list[Combination] = []
        self._queue: list[int] = []  # settings still to search with links, fastest alone first
        self._inner: BudgetSearch | None = None
        self._setting = 0
        self._pending: tuple[int, frozenset[int]] | None = (0, frozenset())

    def propose(self) -> tuple[int, set[int]] | None:
        """The setting and links to apply and measure next, or None when the search is over."""
        return None if self._pending is None else (self._pending[0], set(self._pending[1]))

    def observe(self, peak: int, seconds: float) -> None:
        """The measured peak (bytes) and step time (seconds) of the last proposal."""
        if self._pending is None:
            raise RuntimeError("CompileBudgetSearch.observe() called after the search ended")
        setting, links = self._pending
        self.tried.append(Combination(setting, links, peak, seconds))
        if self.budget is None:
            self.budget = int(self._budget(peak))  # type: ignore[operator]
        if self._inner is None and setting + 1 < len(self._levels):  # the settings alone, in turn
            self._pending = (setting + 1, frozenset())
            return
        if self._inner is None:  # all measured alone: search those that do not fit, fastest first
            alone = [c for c in self.tried if not c.links and c.peak > self.budget]
            self._queue = [c.setting for c in sorted(alone, key=lambda c: c.seconds)]
        elif peak <= self.budget or seconds >= self._fastest():
            self._inner = None  # it fits, or it is already too slow to win with more links
        else:
            self._inner.observe(peak)
        self._pending = self._next()

    @property
    def result(self) -> int | None:
        """The index in :attr:`tried` of the fastest combination within the budget (else of the lowest peak), once
        :meth:`propose` returns None."""
        if self._pending is not None:
            return None
        return fastest_within([(c.peak, c.seconds) for c in self.tried], self.budget)  # type: ignore[arg-type]

    def alone(self, setting: int) -> Combination | None:
        """The measurement of ``setting`` without links, once made."""
        return next((c for c in self.tried if c.setting == setting and not c.links), None)

    def _fastest(self) -> float:
        return min((c.seconds for c in self.tried if c.peak <= self.budget), default=float("inf"))  # type: ignore[operator]

    def _next(self) -> tuple[int, frozenset[int]] | None:
        while True:
            if self._inner is None:
                if not self._queue:
                    return None
                self._setting = self._queue.pop(0)
                alone = self.alone(self._setting)
                assert alone is not None  # every setting is measured alone before any gets links
                if alone.seconds >= self._fastest():
                    continue  # links would only slow it down
                first = self._first(alone.peak, self.budget)  # type: ignore[arg-type]
                self._inner = BudgetSearch(first, self._values, self.budget, give_back=False, savings=self._savings)  # type: ignore[arg-type]
                if not first:  # none predicted: the setting alone is the first set, measured already
                    self._inner.observe(alone.peak)
            links = self._inner.propose()
            measured = [c for c in self.tried if c.setting == self._setting and c.links == frozenset(links or ())]
            if links is None or measured or self._dominated(frozenset(links)):
                self._inner = None  # over (or only the lowest set again, measured before), or cannot win
                continue
            return (self._setting, frozenset(links))

    def _dominated(self, links: frozenset[int]) -> bool:
        level = self._levels[self._setting]
        return any(
            c.peak <= self.budget and self._levels[c.setting] >= level and c.links <= links  # type: ignore[operator]
            for c in self.tried
        )


def fastest_within(candidates: Sequence[tuple[int, float]], budget: int) -> int:
    """Index of the fastest candidate, each ``(peak bytes, seconds per step)``, whose peak is within ``budget``;
    if none is, the one with the lowest peak.

    Example:
        >>> fastest_within([(90, 1.0), (60, 1.4), (55, 1.2)], budget=60)
        2
        >>> fastest_within([(90, 1.0), (80, 1.4)], budget=60)
        1
    """
    if not candidates:
        raise ValueError("no candidates to choose from")
    held = [i for i, (peak, _) in enumerate(candidates) if peak <= budget]
    if held:
        return min(held, key=lambda i: candidates[i][1])
    return min(range(len(candidates)), key=lambda i: candidates[i][0])
