"""The callbacks under sharded strategies on the CPU: ModelParallelStrategy with FSDP2's ``fully_shard`` on two gloo
processes (tests/sharded_run.py's scenarios, each its own ``fit``, in the suite's one two-rank launch), the tuners'
in-place restore of each rank's shards, and the refusals. Lightning builds FSDPStrategy only on a GPU: its cells are
tests/gpu/test_gpu_sharded.py's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import TinyModel, ddp_scenario_results

from lightning_memguard import AccumulationTuner, ActivationCheckpointing, BatchSizeTuner
from lightning_memguard.checkpointing import is_checkpointed

SCENARIOS = (
    "batch_size",
    "accumulation",
    "guard",
    "adapt",
    "checkpointing",
    "budget",
    "oom_forward",
    "oom_backward",
    "oom_head",
    "oom_stem",
    "oom_accumulation",
)


@pytest.fixture(scope="module")
def sharded(ddp_launch) -> dict[str, dict[int, dict]]:
    """Each scenario's results on both ranks, from the suite's one two-rank launch (conftest.DDP_SCENARIOS)."""
    return {s: ddp_scenario_results(ddp_launch, f"sharded_run:{s}", s + "-rank{rank}.json") for s in SCENARIOS}


@pytest.fixture
def one_rank_mesh(tmp_path):
    """A gloo process group of this one process and its device mesh: FSDP2's ``fully_shard`` on the CPU."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _ranks(sharded, scenario):
    return sharded[scenario][0], sharded[scenario][1]


@pytest.mark.parametrize("scenario", ["batch_size", "accumulation"])
def test_the_tuners_under_model_parallel_put_every_ranks_shards_back_and_agree(sharded, scenario):
    r0, r1 = _ranks(sharded, scenario)
    assert r0 == r1  # one choice, the same trials, on both ranks
    r = r0
    assert r["sharded"]  # the weights were DTensors: FSDP2 held them
    # rank 1's smaller card: 16 samples per device would not fit there, so neither rank runs them
    expected = {"batch_size": [[4, 1, "ok"], [8, 1, "ok"], [16, 1, "predicted_over"]],
                "accumulation": [[4, 4, "ok"], [8, 2, "ok"], [16, 1, "predicted_over"]]}[scenario]  # fmt: skip
    assert r["results"] == expected
    assert r["batch_size"] == r["model_batch_size"] == r["samples_at_first_batch"] == 8
    if scenario == "accumulation":
        assert r["accumulate"] == r["trainer_accumulate"] == 2
    # the run starts where it was: each rank's shards as before the trials, no optimizer state, no step taken
    assert r["weights_put_back"] and r["global_step_at_first_batch"] == 0
    assert r["optimizer_state_before_and_at_first_batch"] == [0, 0]


@pytest.mark.parametrize("scenario", ["oom_forward", "oom_backward", "oom_head", "oom_stem", "oom_accumulation"])
def test_an_out_of_memory_error_on_one_sharded_rank_is_every_ranks_and_nobody_waits(sharded, scenario):
    """Rank 1 alone runs out of memory above 8 samples, in the middle of FSDP2's collectives: inside a sharded
    block's forward, inside a sharded block's backward, in the head's backward before any block's, or in the stem's
    after every block's (the last stretch, met at the end of backward); and under AccumulationTuner in a block's
    backward, where the micro-batches before the last reduce no gradients. Every rank learns it at the next agreement
    point, the search goes on, and the run trains a step at 8 on both ranks. Before torch 2.14 (no ``reset_iter_state``)
    every rank ends the run there with the same error instead (seen on torch 2.11)."""
    from torch.distributed.fsdp import FSDPModule

    r0, r1 = _ranks(sharded, scenario)
    if not hasattr(FSDPModule, "reset_iter_state"):
        for rank, r in enumerate((r0, r1)):
            assert r["ended"].startswith(
                f"Out of memory in a trial at batch size 16 under ModelParallelStrategy (rank {rank})"
            )
            assert "torch 2.14" in r["ended"] and r["global_step"] == 0
        return
    assert r0 == r1
    accumulation = scenario == "oom_accumulation"
    expected = (
        [[4, 4, "ok"], [8, 2, "ok"], [16, 1, "oom"]] if accumulation else [[4, 1, "ok"], [8, 1, "ok"], [16, 1, "oom"]]
    )
    assert r0["results"] == expected and r0["accumulate"] == (2 if accumulation else 1)
    assert r0["batch_size"] == r0["model_batch_size"] == r0["samples_at_first_batch"] == 8
    assert r0["weights_put_back"] and r0["optimizer_state_before_and_at_first_batch"] == [0, 0]
    assert r0["global_step"] == 1  # and then trained


def test_memguard_under_model_parallel_stops_every_rank_with_the_spilling_ranks_numbers(sharded):
    r0, r1 = _ranks(sharded, "guard")
    assert r0["should_stop"] and r1["should_stop"] and r0["global_step"] == r1["global_step"]
    (warning,) = r0["warnings"]
    assert "Another rank's GPU memory spilled into system RAM (rank 1)" in warning
    assert "peak 17.00 GB against 16.00 GB" in warning and "MemGuard stopped the Trainer" in warning
    for r in (r0, r1):
        (epoch,) = r["epochs"]
        # the highest rank's peak; samples/s summed over the ranks (20 + 40); the logged key is the table's figure
        assert epoch["peak_allocated_gb"] == pytest.approx(17.0)
        assert epoch["samples_per_sec"] == pytest.approx(60.0) == r["logged_samples_per_sec"]


def test_checkpointing_the_sharded_blocks_trains_exactly_as_without(sharded):
    """ActivationCheckpointing() on a model whose configure_model shards its blocks: applied right after that hook,
    on every rank; three steps end on the same weights, bit for bit, as the run without it."""
    r0, r1 = _ranks(sharded, "checkpointing")
    for r in (r0, r1):
        assert r["checkpointed_blocks"] > 0 and r["same_keys"]
        assert r["max_difference"] == 0.0


def test_a_budget_under_model_parallel_is_measured_on_every_rank_and_rank_zeros_plan_applied(sharded):
    r0, r1 = _ranks(sharded, "budget")
    assert r0["planned_here"] and r1["planned_here"]  # each rank ran the measurement (the forward gathers shards)
    assert r0["runs"] == r1["runs"] and r0["runs"]
    # a ResNet's stem link checkpoints its four modules; the plan may hold it: FSDP2's gathered weights, which it
    # frees after each block's forward, are not a block's activations (the ledger), and the stem saves the most
    stem = ["net.bn1", "net.conv1", "net.maxpool", "net.relu"]
    planned = sorted(m for run in r0["runs"] for name in run for m in (stem if name == "net.stem" else [name]))
    assert r0["checkpointed"] == r1["checkpointed"] == planned


def test_the_trials_state_of_a_sharded_model_is_put_back_in_place(one_rank_mesh):
    """FSDP2 on one gloo process: an optimizer that already holds state and a scheduler that changed the learning
    rate; after more steps everything is put back into the same tensors (the optimizer still points at them)."""
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from lightning_memguard.tuning.training_state import load_training_state, training_state

    def full(t):
        return (t.full_tensor() if isinstance(t, DTensor) else t).clone()

    mesh = one_rank_mesh
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    fully_shard(net[0], mesh=mesh)
    fully_shard(net, mesh=mesh)
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)

    def step():
        net(torch.randn(4, 8)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()

    trainer = SimpleNamespace(
        strategy=ModelParallelStrategy(), lightning_module=net, optimizers=[optimizer],
        lr_scheduler_configs=[SimpleNamespace(scheduler=scheduler)], precision_plugin=Precision(),
    )  # fmt: skip
    fresh = training_state(trainer)  # before any step: no optimizer state
    step()
    load_training_state(trainer, fresh)
    assert len(optimizer.state) == 0 and optimizer.param_groups[0]["lr"] == 0.01

    step()
    weights = {k: full(v) for k, v in net.state_dict().items()}
    moments = {i: {k: full(v) for k, v in optimizer.state[p].items()} for i, p in enumerate(net.parameters())}
    lr, params = optimizer.param_groups[0]["lr"], list(net.parameters())
    saved = training_state(trainer)
    step(), step()
    load_training_state(trainer, saved)
    assert all(torch.equal(weights[k], full(v)) for k, v in net.state_dict().items())
    assert all(
        torch.equal(moments[i][k], full(v))
        for i, p in enumerate(net.parameters())
        for k, v in optimizer.state[p].items()
    )
    assert optimizer.param_groups[0]["lr"] == lr and list(net.parameters()) == params
    assert isinstance(params[0], DTensor)


def _deepspeed():
    """A DeepSpeedStrategy as the callbacks see it: DeepSpeed itself is not installed here, so it is made without
    its ``__init__`` (which would refuse for that reason)."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    return DeepSpeedStrategy.__new__(DeepSpeedStrategy)


@pytest.mark.parametrize("tuner_cls", [BatchSizeTuner, AccumulationTuner])
def test_deepspeed_is_refused_by_the_tuners_before_anything_is_measured(tuner_cls):
    tuner = BatchSizeTuner(cache=False) if tuner_cls is BatchSizeTuner else AccumulationTuner(16, cache=False)
    with pytest.raises(ValueError, match=r"does not support DeepSpeedStrategy.*strategy='fsdp', 'ddp' or one device"):
        tuner.setup(SimpleNamespace(strategy=_deepspeed(), world_size=1), TinyModel(), "fit")


@pytest.mark.parametrize(
    "strategy, world_size, budget, match",
    [
        ("deepspeed", 1, None, "does not support DeepSpeedStrategy"),
        ("fsdp", 2, 0.6, "under FSDPStrategy on several devices cannot measure.*ModelParallelStrategy"),
    ],
)
def test_activation_checkpointing_refuses_what_it_cannot_measure_in_setup(strategy, world_size, budget, match):
    from lightning.pytorch.strategies import FSDPStrategy

    held = _deepspeed() if strategy == "deepspeed" else FSDPStrategy()
    trainer = SimpleNamespace(strategy=held, world_size=world_size)
    with pytest.raises(ValueError, match=match):
        ActivationCheckpointing(memory_budget=budget).setup(trainer, TinyModel(), "fit")


def test_activation_checkpointing_budget_on_one_fsdp_device_is_not_refused():
    from lightning.pytorch.strategies import FSDPStrategy

    model = TinyModel()
    model.example_input_array = torch.randn(2, 16)
    classes = [type(m) for m in model.modules()]
    trainer = SimpleNamespace(strategy=FSDPStrategy(), world_size=1)
    callback = ActivationCheckpointing(memory_budget=0.6)
    callback.setup(trainer, model, "fit")  # planned at fit start, on the device: nothing changed yet
    assert [type(m) for m in model.modules()] == classes and not is_checkpointed(model)
    assert callback.plan is None
    trainer.world_size = 2  # the same budget on two devices: each rank holds a flat shard, refused in setup
    with pytest.raises(ValueError, match="cannot measure the blocks"):
        callback.setup(trainer, model, "fit")


def test_a_run_may_not_join_blocks_that_fully_shard_made_units_of_their_own(one_rank_mesh):
    """A run calls its members' forward, which FSDP2's gathering hooks do not see: a plan that joins two sharded
    blocks (made on the unsharded model, say) is refused by name, as the planner never makes one."""
    from torch.distributed.fsdp import fully_shard
    from torchvision.models.resnet import BasicBlock

    from lightning_memguard.checkpointing import apply_plan

    mesh = one_rank_mesh
    net = torch.nn.Sequential(BasicBlock(8, 8), BasicBlock(8, 8))
    apply_plan(torch.nn.Sequential(BasicBlock(8, 8), BasicBlock(8, 8)), [["0", "1"]])  # unsharded: one run
    for block in net:
        fully_shard(block, mesh=mesh)
    with pytest.raises(ValueError, match="'0' and '1' cannot share a run.*fully_shard"):
        apply_plan(net, [["0", "1"]])


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x=None):
        return self.linear(x).relu()


class _Shapes(torch.nn.Module):
    """The shapes a sharded model's forward takes: a block called twice, a block given its input by keyword, a block
    whose output never reaches the loss, a block checkpointed from outside (its forward runs again in backward),
    and, with ``head_is_a_unit``, a root whose output is a sharded unit's own."""

    def __init__(self, head_is_a_unit: bool):
        super().__init__()
        self.stem, self.twice, self.keyword, self.unused = torch.nn.Linear(8, 16), _Block(), _Block(), _Block()
        self.recomputed, self.head = _Block(), torch.nn.Linear(16, 2)
        self.head_is_a_unit = head_is_a_unit

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = self.twice(self.twice(self.stem(x)))
        h = self.keyword(x=h)
        self.unused(h)
        h = checkpoint(self.recomputed, h, use_reentrant=False)
        return self.head(h)


@pytest.mark.parametrize(("head_is_a_unit", "compiled"), [(False, False), (True, False), (False, True)])
def test_every_collective_of_a_sharded_step_comes_right_after_an_agreement_point(
    one_rank_mesh, head_is_a_unit, compiled
):
    """FSDP2 on one gloo process, every event of a training step in order: FSDP's gathers, reductions and end of
    backward (its own functions, wrapped), each layer's compute (a hook as its forward starts and as its output's
    gradient arrives) and the agreement points. A rank that fails in a compute leaves the others going on to the
    next event: it must be a point, never a collective (else they would wait in it). So before every collective,
    past any collective issued with it, comes a point. Also under ``torch.compile`` (aot_eager), which runs FSDP's
    hooks and ours outside its graphs."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    from lightning_memguard.tuning.sharded_agreement import UnitPoints, fsdp_units

    events: list[str] = []

    def logged(fn, name):
        def call(self, *args, **kwargs):
            events.append(name)
            return fn(self, *args, **kwargs)

        return call

    patch = pytest.MonkeyPatch()
    patch.setattr(FSDPParamGroup, "unshard", logged(FSDPParamGroup.unshard, "collective"))
    patch.setattr(FSDPParamGroup, "post_backward", logged(FSDPParamGroup.post_backward, "collective"))
    patch.setattr(
        FSDPState, "_root_post_backward_final_callback",
        logged(FSDPState._root_post_backward_final_callback, "collective"),
    )  # fmt: skip
    try:
        torch.manual_seed(0)
        net = _Shapes(head_is_a_unit)

        def computing(module, args, out):
            out.register_hook(lambda grad: events.append("compute"))  # its backward starts

        for block in (net.twice, net.keyword, net.unused, net.recomputed, *([net.head] if head_is_a_unit else [])):
            fully_shard(block, mesh=one_rank_mesh)
        fully_shard(net, mesh=one_rank_mesh)
        for module in net.modules():  # after FSDP's hooks, as the layer's own compute comes after them
            if isinstance(module, torch.nn.Linear):
                module.register_forward_pre_hook(lambda module, args: events.append("compute"))
                module.register_forward_hook(computing)
        points = UnitPoints(fsdp_units(net), lambda failed: events.append("point") or failed)
        run = torch.compile(net, backend="aot_eager") if compiled else net
        with points.installed():
            for _ in range(2):  # a second step, as the trials take
                events.clear()
                points.new_step()
                run(torch.randn(4, 8)).sum().backward()
                last = None
                for i, event in enumerate(events):
                    if event == "collective":
                        assert last == "point", f"a collective after a compute, at {i}: {events}"
                    else:
                        last = event
                assert events.count("collective") > 10 and "compute" in events
    finally:
        patch.undo()
        torch._dynamo.reset()


def test_an_out_of_memory_error_inside_fsdps_own_code_is_not_agreed_on(one_rank_mesh, monkeypatch):
    """FSDP's gather runs out of memory: the other ranks may already wait in that gather, where an agreement would
    meet nobody, so the failing rank does not agree (its trial ends the run); an error in a layer's own compute is
    said at the next point."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from lightning_memguard.tuning.sharded_agreement import UnitPoints, fsdp_units

    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2))
    fully_shard(net[1], mesh=one_rank_mesh)
    fully_shard(net, mesh=one_rank_mesh)
    said: list[bool] = []
    points = UnitPoints(fsdp_units(net), lambda failed: said.append(failed) or False)

    def no_room(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (injected in FSDP's gather)")

    with monkeypatch.context() as patch, points.installed():
        patch.setattr(FSDPParamGroup, "unshard", no_room)
        with pytest.raises(torch.OutOfMemoryError) as inside:
            net(torch.randn(4, 8))
    assert said == [False]  # the root's point, then its gather failed
    assert not points.failed_here(inside.value, in_backward=False) and said == [False]

    net[0].register_forward_hook(lambda module, args, out: no_room())
    with pytest.raises(torch.OutOfMemoryError) as compute, points.installed():
        net(torch.randn(4, 8))
    assert points.failed_here(compute.value, in_backward=False) and said[-1] is True


def test_an_agreed_error_ends_the_run_where_torch_cannot_reset_fsdps_step(one_rank_mesh, monkeypatch):
    """Before torch 2.14 nothing public puts FSDP2's half-done step back: the agreed error becomes one that ends the
    run (on every rank, as every rank agreed) instead of a search going on with gathered weights and a gradient
    reduction never queued. With ``reset_iter_state`` the units are resharded and the error stays the agreed one."""
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.tensor import DTensor

    from lightning_memguard.tuning.sharded_agreement import (
        AgreedOutOfMemory,
        OutOfMemoryEndsRun,
        UnitPoints,
        fsdp_units,
    )

    mesh = one_rank_mesh
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    fully_shard(net[2], mesh=mesh)
    fully_shard(net, mesh=mesh)
    shards = [p.to_local().clone() for p in net.parameters()]
    another_rank_failed = iter([False, True])  # the root's forward passes, the block's point hears of it
    points = UnitPoints(fsdp_units(net), lambda failed: next(another_rank_failed))
    if hasattr(FSDPModule, "reset_iter_state"):  # torch 2.14 and later
        with pytest.raises(AgreedOutOfMemory), points.installed():
            net(torch.randn(4, 8))
        assert all(isinstance(p, DTensor) for p in net.parameters())  # every unit back to its shard
        net(torch.randn(4, 8)).sum().backward()  # and the next step runs
        monkeypatch.delattr(FSDPModule, "reset_iter_state")
    another_rank_failed = iter([False, True])
    with pytest.raises(OutOfMemoryEndsRun, match="reset_iter_state"), points.installed():
        net(torch.randn(4, 8))
    # back to its shards all the same, for the trials' restore (the root would stay gathered otherwise)
    assert all(isinstance(p, DTensor) for p in net.parameters())
    assert [p.to_local().shape for p in net.parameters()] == [s.shape for s in shards]


def test_an_out_of_memory_error_nobody_can_learn_ends_the_run_naming_the_trial(tmp_path):
    """What a sharded rank raises where no agreement point is left (see above), here from the training step on one
    device: the tuner puts the run back and ends it with the trial's size and what to do, instead of searching on
    while the other ranks would wait."""
    from lightning.pytorch import Trainer
    from tuner_helpers import BatchClock

    from lightning_memguard.testing import ImageClassifier
    from lightning_memguard.tuning.sharded_agreement import OutOfMemoryEndsRun

    class FailsUnshared(ImageClassifier):
        def training_step(self, batch, batch_idx):
            if batch.shape[0] > 8:
                try:
                    raise torch.OutOfMemoryError("CUDA out of memory (injected)")
                except torch.OutOfMemoryError as err:
                    raise OutOfMemoryEndsRun("the other ranks wait inside FSDP's collectives") from err
            return super().training_step(batch, batch_idx)

    from conftest import FakeProbe, trainer_kwargs

    model = FailsUnshared(arch="resnet18", image_size=16, batch_size=4, steps_per_epoch=50, pool_size=16)
    clock = BatchClock()  # throughput rises with the size: the search reaches 16
    tuner = BatchSizeTuner(
        init_size=4, max_size=64, probe=FakeProbe(), cache=False, warmup_steps=1, timed_steps=1, clock=clock
    )
    trainer = Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=[clock, tuner]))
    with pytest.raises(
        RuntimeError, match=r"Out of memory in a trial at batch size 16 under SingleDeviceStrategy \(rank 0\)"
    ) as caught:
        trainer.fit(model)
    assert "wait inside FSDP's collectives" in str(caught.value)
    assert "smaller upper bound than 16" in str(caught.value)
    assert isinstance(caught.value.__cause__, torch.OutOfMemoryError)
    assert model.batch_size == 4  # put back


def test_memguard_adapts_every_sharded_rank_in_the_same_step_with_the_unsplit_runs_weights(sharded):
    """On rank 1 alone another application takes memory at step 2 (tests/sharded_run.py ``adapt``): both ranks split
    their batches of 4 in two from that step, and their shards train as the same run unsplit (BatchNorm frozen)."""
    r0, r1 = _ranks(sharded, "adapt")
    for r in (r0, r1):
        assert r["adaptations"] == [[2, 1, 2]] and r["global_step"] == 8
        assert r["largest_forward"] == [4, 4] + [2] * 6
        assert r["max_difference"] < 1e-4  # float sums in another order, after 8 steps
