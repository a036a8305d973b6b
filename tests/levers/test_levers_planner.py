"""The levers' chooser and its search with injected figures: the fused loss first and the links chosen again after it,
offload only where its copies hide (or where it is still the cheaper lever) and within the host bound, a pointwise
chain before a whole block where it meets the budget for less, the floor and its figures where no set meets it, and
ties decided the same way every time."""

from __future__ import annotations

import ast
import pathlib

import pytest

from lightning_memguard.levers import choose
from lightning_memguard.levers.choose import (
    LeverSearch,
    LinkOption,
    LossOption,
    Measurement,
    Proposal,
    choose_levers,
)


def block(freed: int, ms: float) -> LinkOption:
    return LinkOption("block", freed, ms)


def run(search: LeverSearch, measure) -> list[Proposal]:
    """Drive ``search`` with ``measure(proposal) -> Measurement``; the proposals made, in order."""
    proposals = []
    while (proposal := search.propose()) is not None:
        proposals.append(proposal)
        search.observe(measure(proposal))
    return proposals


class FakeModel:
    """Peaks as the options say, with the fused loss changing the links' figures (its logits no longer hold the
    peak), ``miss`` bytes the predictions leave out per link chosen, and ``fixed`` bytes once any link is chosen
    (as the one block a backward recomputes holds)."""

    def __init__(
        self, peak: int, before: dict, after: dict, loss: LossOption | None, miss: int = 0, fixed: int = 0
    ) -> None:
        self.peak, self.before, self.after, self.loss, self.miss, self.fixed = peak, before, after, loss, miss, fixed

    def __call__(self, proposal: Proposal) -> Measurement:
        loss = proposal.loss and self.loss is not None
        peak = self.peak - (self.loss.freed_bytes if loss else 0)  # type: ignore[union-attr]
        peak -= sum(o.freed_bytes - self.miss for o in proposal.links.values())
        peak += self.fixed if proposal.links else 0
        links = self.after if loss else self.before
        owner = max(links, key=lambda n: max(o.freed_bytes for o in links[n])) if loss else "the loss's logits"
        return Measurement(peak, owner, links, self.loss if not proposal.loss and not proposal.links else None)


def test_the_fused_loss_is_taken_first_and_the_links_chosen_as_measured_after_it():
    before = {"h.0": [block(10, 1.0)], "h.1": [block(10, 1.0)]}
    after = {"h.0": [block(30, 3.0)], "h.1": [block(25, 3.0)]}  # measured again: what each frees has changed
    model = FakeModel(1000, before, after, LossOption(600, -2.0))
    search = LeverSearch(budget=380)  # bytes as they are
    proposals = run(search, model)
    assert [(p.loss, sorted(p.links)) for p in proposals] == [(False, []), (True, []), (True, ["h.0"])]
    plan = search.result
    assert plan.loss and plan.loss_bytes == 400 and plan.measured_bytes == 370 and plan.held
    assert (plan.owner, plan.owner_after_loss) == ("the loss's logits", "h.0")
    assert plan.extra_ms == 1.0  # the block's 3 ms, less the 2 the fused loss saves
    assert plan.tried == [("as it is", 1000), ("fused loss", 400), ("fused loss, h.0: block", 370)]
    assert "the fused loss (peak 1.0 kB -> 0.4 kB; it was held by the loss's logits, then by h.0)" in plan.summary()


def test_a_fused_loss_that_meets_the_budget_alone_is_all_there_is():
    model = FakeModel(1000, {"h.0": [block(10, 1.0)]}, {"h.0": [block(10, 1.0)]}, LossOption(600, 0.5))
    search = LeverSearch(budget=0.5)
    assert [p.loss for p in run(search, model)] == [False, True]
    assert search.result.links == {} and search.result.held and search.result.budget_bytes == 500


def test_a_fused_loss_that_does_not_lower_the_measured_peak_is_left_out():
    links = {"h.0": [block(300, 2.0)]}
    model = FakeModel(1000, links, links, LossOption(-5, 0.0))
    model.loss = LossOption(0, 0.0)  # measured: frees nothing
    search = LeverSearch(budget=800)
    assert [p.loss for p in run(search, model)] == [False, False]  # never proposed: it frees nothing
    plan = search.result
    assert not plan.loss and list(plan.links) == ["h.0"] and plan.measured_bytes == 700


def test_a_fused_loss_measured_higher_is_taken_back_with_the_links_chosen_without_it():
    links = {"h.0": [block(300, 2.0)]}

    def measure(proposal: Proposal) -> Measurement:
        peak = 1000 + (10 if proposal.loss else 0) - sum(o.freed_bytes for o in proposal.links.values())
        return Measurement(peak, "h.0", links, LossOption(50, 0.0))  # predicted to free 50, measured 10 more

    search = LeverSearch(budget=800)
    proposals = run(search, measure)
    assert [(p.loss, sorted(p.links)) for p in proposals] == [(False, []), (True, []), (False, ["h.0"])]
    assert not search.result.loss and search.result.loss_bytes is None


def test_offload_is_taken_where_its_copies_hide_and_recomputation_where_they_show():
    links = {
        "h.0": [block(100, 5.0), LinkOption("offload", 100, 0.0, host_bytes=128)],  # hidden
        "h.1": [block(100, 5.0), LinkOption("offload", 100, 20.0, host_bytes=128)],  # the last: exposed
    }
    choice = choose_levers(links, need=200)
    assert {name: o.kind for name, o in choice.links.items()} == {"h.0": "offload", "h.1": "block"}
    assert (choice.freed_bytes, choice.extra_ms, choice.host_bytes) == (200, 5.0, 128)
    # an exposed offload that still costs less than recomputing is taken
    cheaper = {"h.0": [block(100, 5.0), LinkOption("offload", 100, 2.0, host_bytes=128)]}
    assert choose_levers(cheaper, need=100).links["h.0"].kind == "offload"


def test_the_host_bound_is_respected():
    links = {f"h.{i}": [block(100, 5.0 + i), LinkOption("offload", 100, 0.0, host_bytes=256)] for i in range(3)}
    assert [o.kind for o in choose_levers(links, need=300).links.values()] == ["offload"] * 3
    bounded = choose_levers(links, need=300, host_limit=600)
    assert [o.kind for o in bounded.links.values()] == ["offload", "offload", "block"]  # the dearest block kept
    assert bounded.host_bytes == 512 <= 600
    assert [o.kind for o in choose_levers(links, need=300, host_limit=0).links.values()] == ["block"] * 3
    # the search hands its bound to every choice
    search = LeverSearch(budget=700, host_limit=300)
    run(search, FakeModel(1000, links, links, None))
    assert search.result.host_bytes == 256 and search.result.held


def test_a_pointwise_chain_is_taken_before_a_whole_block_where_it_meets_the_budget_for_less():
    links = {name: [block(100, 5.0), LinkOption("pointwise", 40, 0.5)] for name in ("h.0", "h.1", "h.2")}
    assert [o.kind for o in choose_levers(links, need=120).links.values()] == ["pointwise"] * 3  # 1.5 ms
    # 130 is beyond the chains (120): one block and the others' chains, no more blocks than the gap needs
    kinds = [o.kind for o in choose_levers(links, need=130).links.values()]
    assert sorted(kinds) == ["block", "pointwise"] and len(kinds) == 2  # 5.5 ms, not two blocks' 10
    # parts sit between them: taken where they close the gap for less than a block
    links["h.0"].append(LinkOption("parts", 70, 2.0))
    kinds = {n: o.kind for n, o in choose_levers(links, need=150).links.items()}
    assert kinds == {"h.0": "parts", "h.1": "pointwise", "h.2": "pointwise"}  # 3 ms, a block and two chains 6


def test_one_move_that_closes_the_gap_beats_a_better_rate_that_overshoots():
    links = {"a": [block(1000, 50.0)], "b": [block(100, 10.0)]}  # a: 0.05 ms a byte, b: 0.1; 100 needed
    assert list(choose_levers(links, need=100).links) == ["b"]


def test_choices_that_are_not_needed_are_given_back():
    links = {"a": [block(30, 0.3)], "c": [block(100, 2.0)]}  # a at the best rate first, then c closes the gap
    choice = choose_levers(links, need=100)
    assert list(choice.links) == ["c"] and choice.extra_ms == 2.0  # a is not needed beside c: given back
    links = {"a": [block(60, 1.0)], "b": [block(60, 1.0)], "c": [block(100, 3.0)]}
    assert list(choose_levers(links, need=100).links) == ["a", "b"]  # 2 ms, c alone 3


def test_ties_are_decided_by_the_links_order_then_the_kind():
    same = [block(100, 5.0), LinkOption("pointwise", 100, 5.0), LinkOption("offload", 100, 5.0)]
    links = {"h.1": same, "h.0": same}
    for _ in range(3):
        choice = choose_levers(links, need=100)
        assert {n: o.kind for n, o in choice.links.items()} == {"h.1": "block"}
    assert list(choose_levers(dict(reversed(links.items())), need=100).links) == ["h.0"]


def test_a_budget_no_set_meets_says_the_floor_reached_and_the_figures():
    links = {"h.0": [block(100, 5.0), LinkOption("pointwise", 40, 0.5)], "h.1": [block(150, 5.0)]}
    search = LeverSearch(budget=500)
    proposals = run(search, FakeModel(1000, links, links, None))
    assert [sorted((n, o.kind) for n, o in p.links.items()) for p in proposals] == [
        [],
        [("h.0", "block"), ("h.1", "block")],  # every lever that frees memory: no set does better
    ]
    plan = search.result
    assert not plan.held and plan.measured_bytes == 750 and plan.predicted_bytes == 750
    summary = plan.summary()
    assert "budget not met: the floor reached is 0.8 kB (75 % of baseline 1.0 kB)" in summary
    assert "tried as it is: 1.0 kB; h.0: block, h.1: block: 0.8 kB" in summary


def test_a_prediction_that_misses_widens_the_gap_then_settles_for_the_floor():
    links = {f"h.{i}": [block(100, 1.0 + i)] for i in range(4)}
    search = LeverSearch(budget=800)
    proposals = run(search, FakeModel(1000, links, links, None, miss=40))  # each link frees 60, not 100
    # 200 over: two links (measured 880); widened by the 80 missed: three (820); the line through the two (0.6 byte
    # measured per byte predicted) says 334 bytes: all four, the floor
    assert [sorted(p.links) for p in proposals] == [[], ["h.0", "h.1"], ["h.0", "h.1", "h.2"], list(links)]
    plan = search.result
    assert plan.held and plan.measured_bytes == 760 and plan.predicted_bytes == 600
    # never fits: the first set is already the floor, and the lowest peak is kept, measured last
    search = LeverSearch(budget=100)
    proposals = run(search, FakeModel(1000, links, links, None, miss=40))
    assert [sorted(p.links) for p in proposals] == [[], list(links)]  # the most it can free, at once
    assert search.result.measured_bytes == 760 and not search.result.held
    assert proposals[-1].links == search.result.links


def picked(proposals: list[Proposal]) -> list[int]:
    """How many links each proposal took."""
    return [len(p.links) for p in proposals]


def test_a_miss_that_grows_with_the_set_is_read_off_the_two_sets_measured_before_the_floor():
    links = {f"h.{i}": [block(100, 1.0 + i)] for i in range(8)}
    # each link frees 70, not 100, and any set holds 60 more (the block recomputed in backward): 70 n - 60 freed
    search = LeverSearch(budget=700)
    proposals = run(search, FakeModel(1000, links, links, None, miss=30, fixed=60))
    # 300 over: three links (850 measured); widened by their miss of 150: five (710, 10 over); the line through
    # (300, 150) and (500, 290) says 515 bytes: six links (640), not all eight (500)
    assert picked(proposals) == [0, 3, 5, 6]
    plan = search.result
    assert plan.held and plan.measured_bytes == 640 and plan.predicted_bytes == 400
    assert [peak for _, peak in plan.tried] == [1000, 850, 710, 640]


def test_a_miss_that_does_not_grow_is_closed_by_the_first_widening():
    links = {f"h.{i}": [block(100, 1.0 + i)] for i in range(8)}
    search = LeverSearch(budget=700)
    proposals = run(search, FakeModel(1000, links, links, None, fixed=150))  # 100 n - 150 freed
    assert picked(proposals) == [0, 3, 5]  # 300 over, 150 missed: five links, 650 measured
    assert search.result.held and search.result.measured_bytes == 650


def test_sets_that_free_no_more_as_measured_go_to_the_floor():
    links = {f"h.{i}": [block(100, 1.0 + i)] for i in range(8)}

    def flat(proposal: Proposal) -> Measurement:  # any set frees 100 as measured, however many links it takes
        return Measurement(900 if proposal.links else 1000, "h.0", links)

    search = LeverSearch(budget=700)
    proposals = run(search, flat)
    # the floor third (no line to read); nothing met: the first set of the lowest peak, measured again last
    assert picked(proposals) == [0, 3, 5, 8, 3]
    assert not search.result.held and search.result.measured_bytes == 900
    assert search.result.links == proposals[1].links == proposals[-1].links


def test_a_model_within_its_budget_is_left_as_it_is():
    search = LeverSearch(budget=2000)
    assert run(search, FakeModel(1000, {}, {}, LossOption(500, 0.0))) == [Proposal(False)]
    assert search.result.held and search.result.links == {} and not search.result.loss


def test_observe_after_the_end_and_bad_arguments_are_refused():
    search = LeverSearch(budget=2000)
    search.observe(Measurement(10))
    with pytest.raises(RuntimeError, match=r"observe\(\) called after the search ended"):
        search.observe(Measurement(10))
    with pytest.raises(ValueError, match=r"`budget` must be a positive number of bytes or a fraction, got -1"):
        LeverSearch(budget=-1)
    with pytest.raises(ValueError, match=r"`budget` as a fraction must be in \(0, 1\], got 1.5"):
        LeverSearch(budget=1.5)
    with pytest.raises(ValueError, match=r"`host_limit` must be >= 0 or None, got -3"):
        LeverSearch(budget=10, host_limit=-3)
    with pytest.raises(ValueError, match=r"`kind` must be one of .* got 'swap'"):
        LinkOption("swap", 1, 1.0)


def test_the_chooser_imports_neither_torch_nor_lightning():
    tree = ast.parse(pathlib.Path(choose.__file__).read_text(encoding="utf-8"))
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not [m for m in imported if m.split(".")[0] in ("torch", "lightning")]
    assert all(not m.startswith("lightning_memguard") or m == "lightning_memguard.core.units" for m in imported)


def test_where_offloaded_inputs_do_not_free_on_the_card_what_they_count_the_floor_without_offload_is_measured_too():
    links = {f"h.{i}": [block(100, 1.0), LinkOption("block_offload", 130, 1.5, host_bytes=32)] for i in range(4)}

    def card(copies: int):  # the copies hold ``copies`` bytes more than the count says
        def measure(proposal: Proposal) -> Measurement:
            held = copies if any(o.kind == "block_offload" for o in proposal.links.values()) else 0
            return Measurement(1000 - sum(o.freed_bytes for o in proposal.links.values()) + held, "h.0", links)

        return measure

    search = LeverSearch(budget=500)
    proposals = run(search, card(200))
    kinds = [sorted({o.kind for o in p.links.values()}) for p in proposals]
    # the floor with every input offloaded measures 680, recomputation alone 600: that one is the plan, measured last
    assert kinds[1] == ["block_offload"] and kinds[-1] == ["block"]
    plan = search.result
    assert not plan.held and plan.measured_bytes == 600 and set(plan.kinds()) == {"block"} and plan.host_bytes == 0
    assert proposals[-1].links == plan.links
    # where the offloaded floor is the lower, it stays the plan; and recomputation's floor is measured once only
    search = LeverSearch(budget=400)
    proposals = run(search, card(0))
    assert set(search.result.kinds()) == {"block_offload"} and search.result.measured_bytes == 480
    assert sum(1 for p in proposals if {o.kind for o in p.links.values()} == {"block"}) == 1
