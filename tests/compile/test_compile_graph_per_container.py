"""Checkpointed blocks under torch.compile, one compiled graph per container.

On the H200 a compiled ResNet50 with every block checkpointed, trained, peaks at 4.78 GB as one graph and at 4.08 GB
with a graph per stage (eager mode: 3.84 GB), each block's input gradient realized as one buffer (before that:
5.19 and 4.39 GB; ``benchmarks/compile_peak.py``, ``benchmarks/compile.py``). CPU: the ``aot_eager`` backend; what is
checked is the logic (which graphs Dynamo makes, that they keep static shapes, the same gradients and BatchNorm
statistics as eager mode, that the plan measures both forms and re-applies its choice); the GPU figures are in
``benchmarks/results/``.
"""

from __future__ import annotations

import pickle

import pytest
import torch
from conftest import planner_step_times, trainer_kwargs
from lightning.pytorch import Trainer
from models import small_resnet
from test_compile_checkpointing_budget import Net, _fresh_dynamo, _resnet  # noqa: F401 - _fresh_dynamo: autouse

from lightning_memguard import ActivationCheckpointing, _compiler
from lightning_memguard.checkpointing import apply_plan, checkpoint_blocks, checkpoint_resnet, remove_checkpointing
from lightning_memguard.checkpointing.wrap import GraphSplit

STAGES = ["layer1", "layer2", "layer3", "layer4"]


class _Graphs:
    """A Dynamo backend that records each graph (its input shapes, and whether any is symbolic), then runs it
    through ``aot_eager``."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        shapes = [
            tuple(n.meta["example_value"].shape)
            for n in gm.graph.nodes
            if n.op == "placeholder" and isinstance(n.meta.get("example_value"), torch.Tensor)
        ]
        dynamic = any(isinstance(d, torch.SymInt) for shape in shapes for d in shape)
        self.graphs.append({"inputs": shapes, "dynamic": dynamic, "nodes": len(gm.graph.nodes)})
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)


def _step(run, model, x):
    model.zero_grad(set_to_none=True)
    run(x).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_every_block_compiles_one_static_graph_per_stage_with_eager_gradients_and_statistics():
    x = torch.randn(4, 3, 64, 64)
    eager = _resnet()
    plain_grads = _step(eager, eager, x)
    model = _resnet()
    plan = checkpoint_resnet(model, compile=True)  # it will be compiled
    assert plan.graph_splits == STAGES
    assert all(isinstance(getattr(model, s), GraphSplit) for s in STAGES)
    backend = _Graphs()
    compiled = torch.compile(model, backend=backend)
    grads = _step(compiled, model, x)
    # the stem's graph, then one per stage (each stage's input is its own shape), then the head's
    stage_graphs = [g for g in backend.graphs if g["nodes"] > 20]
    assert len(stage_graphs) >= 4, backend.graphs
    assert not any(g["dynamic"] for g in backend.graphs), backend.graphs  # each stage specialised to its shapes
    assert grads.keys() == plain_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=1e-4, atol=1e-5, msg=name)
    for (name, buf), (_, plain) in zip(model.named_buffers(), eager.named_buffers(), strict=True):
        torch.testing.assert_close(buf, plain, msg=name)  # BatchNorm statistics updated once, as in eager mode
    # a second step runs the graphs made by the first: nothing recompiles
    made = len(backend.graphs)
    _step(compiled, model, x)
    assert len(backend.graphs) == made


def test_in_eager_mode_a_split_changes_nothing_and_comes_off_with_the_checkpointing():
    x = torch.randn(2, 3, 32, 32)
    plain = _resnet()
    model = _resnet()
    checkpoint_resnet(model, compile=True)
    torch.testing.assert_close(model(x), plain(x))
    copy = pickle.loads(pickle.dumps(model))  # a split pickles as its mixin and original class
    assert isinstance(copy.layer2, GraphSplit) and copy.layer2.memguard_split == "layer2"
    remove_checkpointing(model)
    assert all(type(getattr(model, s)) is torch.nn.Sequential for s in STAGES)
    assert not [k for m in model.modules() for k in m.__dict__ if "memguard" in k]


def test_blocks_in_one_container_are_not_split_and_apply_plan_splits_only_when_asked():
    model = _resnet()
    apply_plan(model, [["layer1.0"], ["layer1.1"]], split_graphs=True)
    assert not any(isinstance(m, GraphSplit) for m in model.modules())  # one container: one graph is enough
    remove_checkpointing(model)
    apply_plan(model, [["layer1.0"], ["layer3.1"]])
    assert not any(isinstance(m, GraphSplit) for m in model.modules())
    remove_checkpointing(model)
    apply_plan(model, [["layer1.0"], ["layer3.1"]], split_graphs=True)
    assert [n for n, m in model.named_modules() if isinstance(m, GraphSplit)] == ["layer1", "layer3"]


def _compiled_plan(monkeypatch, one_graph_s):
    """A compiled budget plan in which compile's default with blocks and a graph per stage is the fastest that fits
    (0.1 s a step, other settings 0.2 s), and its blocks as one graph take ``one_graph_s``."""
    planner_step_times(monkeypatch, lambda setting, blocks, split: one_graph_s if blocks and not split else
                       0.1 if setting == 1.0 else 0.2)  # fmt: skip
    model = small_resnet()
    x = torch.randn(4, 3, 64, 64)
    plan = checkpoint_resnet(model, memory_budget=0.2, example_input=x, compile={"backend": "aot_eager"})
    split = [c for c in plan.compile_candidates if c["graph_splits"]]
    assert len(split) == 1 and split[0]["activation_memory_budget"] is None  # 0.8 and 0.5: slower alone
    assert plan.compile_candidates[-1]["runs"] == split[0]["runs"] and not plan.compile_candidates[-1]["graph_splits"]
    return model, plan, split[0], plan.compile_candidates[-1]


def test_a_compiled_budget_keeps_one_graph_where_it_fits_and_is_faster(monkeypatch):
    model, plan, first, twin = _compiled_plan(monkeypatch, 0.090)
    assert len({r[0].split(".")[0] for r in first["runs"]}) > 1
    assert twin["activation_memory_budget"] == first["activation_memory_budget"]
    assert twin["peak_bytes"] <= plan.budget_bytes  # it fits (on the CPU one graph saves fewer bytes)
    assert plan.graph_splits == [] and not any(isinstance(m, GraphSplit) for m in model.modules())
    assert "a graph per container" not in plan.summary()


def test_one_graph_that_is_faster_only_within_the_noise_is_not_taken(monkeypatch):
    model, plan, first, _ = _compiled_plan(monkeypatch, 0.099)  # 1 % faster: within ONE_GRAPH_MARGIN
    assert plan.graph_splits == first["graph_splits"] != []
    assert [n for n, m in model.named_modules() if isinstance(m, GraphSplit)] == plan.graph_splits


def test_a_compiled_budget_that_keeps_its_split_applies_it_and_says_so(monkeypatch):
    model, plan, first, _ = _compiled_plan(monkeypatch, 0.150)  # one graph slower
    assert plan.graph_splits == first["graph_splits"] != []
    assert [n for n, m in model.named_modules() if isinstance(m, GraphSplit)] == plan.graph_splits
    assert "a graph per container" in plan.summary()


def test_the_callback_keeps_the_split_for_a_resumed_run(tmp_path):
    trainer = Trainer(**trainer_kwargs(tmp_path, max_steps=1, callbacks=[ActivationCheckpointing()]))
    module = Net()
    trainer.fit(torch.compile(module, backend="aot_eager"))
    callback = next(c for c in trainer.callbacks if isinstance(c, ActivationCheckpointing))
    assert callback.state_dict()["split_graphs"] is True
    assert [n for n, m in module.named_modules() if isinstance(m, GraphSplit)] == [f"net.{s}" for s in STAGES]
    fresh = ActivationCheckpointing()
    fresh.load_state_dict(callback.state_dict())  # what a resumed run gets from its checkpoint
    resumed = Net()
    fresh.policy.apply(resumed)
    assert [n for n, m in resumed.named_modules() if isinstance(m, GraphSplit)] == [f"net.{s}" for s in STAGES]


def test_an_eager_model_is_not_split_so_fullgraph_compiles_and_export_work():
    model = _resnet()
    plan = checkpoint_resnet(model)  # not compiled, not said to be
    assert plan.graph_splits == [] and not any(isinstance(m, GraphSplit) for m in model.modules())
    x = torch.randn(2, 3, 32, 32)
    torch.compile(model, backend="aot_eager", fullgraph=True)(x).sum().backward()


def test_a_plan_applied_again_to_a_split_model_changes_nothing_and_splits_apply_twice_without_error():
    model = _resnet()
    runs = [["layer1.0", "layer1.1"], ["layer2.0"]]
    apply_plan(model, runs, split_graphs=True)
    with pytest.warns(UserWarning, match="already checkpointed"):
        apply_plan(model, runs, split_graphs=True)  # a second fit with the same callback: the run is still joinable
    apply_plan(model, [["layer3.0"], ["layer4.0"]], split_graphs=True)  # stages 1 and 2 split already
    assert [n for n, m in model.named_modules() if isinstance(m, GraphSplit)] == STAGES
    remove_checkpointing(model)
    assert not any(isinstance(m, GraphSplit) for m in model.modules())


class _Backwards:
    """``aot_eager``, keeping each backward graph (AOTAutograd's, partitioned as for Inductor)."""

    def __init__(self):
        self.graphs = []

    def backend(self, gm, example_inputs):
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs, bw_compiler=self._backward)

    def _backward(self, gm, example_inputs):
        from torch._dynamo.backends.debugging import boxed_nop

        self.graphs.append(gm)
        return boxed_nop(gm, example_inputs)

    def realized(self):
        """Calls of the realizing op in the backward graphs (functionalized: an ``auto_functionalized`` node)."""
        op = torch.ops.lightning_memguard.realize_.default
        return sum(
            1
            for gm in self.graphs
            for node in gm.graph.nodes
            if node.op == "call_function" and (node.target is op or op in node.args)
        )


@pytest.mark.skipif(_compiler.graphs._REALIZE is None, reason="torch.library.custom_op came with torch 2.4")
@pytest.mark.parametrize("split", [True, False], ids=["graph_per_stage", "one_graph"])
def test_each_checkpointed_block_takes_its_gradient_as_one_buffer_in_the_compiled_backward(split):
    """In one compiled backward Inductor would add a residual block's two gradient paths inside every consumer,
    keeping both alive through the next block's backward (measured on the H200: the stages' backward peaked 0.5 GB
    above eager mode's). Each block's input gradient goes through the realizing op instead, once, and the gradients
    are eager mode's."""
    x = torch.randn(2, 3, 32, 32)
    eager = _resnet()
    plain_grads = _step(eager, eager, x)
    model = _resnet()
    plan = checkpoint_resnet(model, compile=split)  # compile=True: it will be compiled, so a graph per stage
    assert bool(plan.graph_splits) is split
    recorded = _Backwards()
    grads = _step(torch.compile(model, backend=recorded.backend), model, x)
    blocks = [name for name in plan.blocks if name != "stem"]  # the stem's input, the image, needs no gradient
    assert len(blocks) == 8 and recorded.realized() == len(blocks)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=1e-4, atol=1e-5, msg=name)


def test_outside_compile_a_gradient_passes_as_it_is():
    x = torch.randn(3, requires_grad=True)
    assert _compiler.gradient_realized(x) is x  # eager mode: autograd adds the paths into one tensor already
    model = _resnet()
    checkpoint_resnet(model)
    out = model(torch.randn(2, 3, 32, 32))
    names = set()
    todo = [out.grad_fn]
    while todo:  # no node of the realizing Function in an eager graph
        node = todo.pop()
        names.add(type(node).__name__)
        todo += [n for n, _ in node.next_functions if n is not None]
    assert not any("Realized" in name for name in names)


@pytest.mark.skipif(
    _compiler.inductor_missing(cuda=False) is not None, reason="Inductor on the CPU needs a C++ compiler"
)
def test_under_inductor_the_realized_gradients_are_eager_modes():
    """Inductor itself, with the realizing op in its backward (on the CPU, in float64 so that any difference is a
    wrong gradient, not rounding)."""
    from torchvision.models.resnet import BasicBlock

    def stages(seed=0):
        torch.manual_seed(seed)
        stage = lambda: torch.nn.Sequential(BasicBlock(8, 8), BasicBlock(8, 8))  # noqa: E731
        return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), stage(), stage()).double()

    x = torch.randn(4, 3, 12, 12, dtype=torch.float64)
    eager = stages()
    plain_grads = _step(eager, eager, x)
    model = stages()
    plan = checkpoint_blocks(model, "auto", compile=True)
    assert plan.graph_splits == ["1", "2"] and len(plan.blocks) == 4
    grads = _step(torch.compile(model, backend="inductor"), model, x)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=1e-9, atol=1e-12, msg=name)


def test_a_block_fed_a_tensor_subclass_trains_compiled_as_before():
    """A nested (jagged) tensor, like a DTensor, is a tensor subclass the realizing op has no rule for: its
    gradient passes as it is, and the compiled model trains as the eager one."""

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)

        def forward(self, x):
            return x + self.fc(x).relu()

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 8), Block(), Block(), Block())

    x = torch.nested.nested_tensor([torch.randn(3, 8), torch.randn(5, 8)], layout=torch.jagged)
    eager = model()
    eager(x).values().sum().backward()
    ours = model()
    checkpoint_blocks(ours, {Block})
    torch.compile(ours, backend="aot_eager")(x).values().sum().backward()
    for (name, a), b in zip(eager.named_parameters(), ours.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, msg=name)
