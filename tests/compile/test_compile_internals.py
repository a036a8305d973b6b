"""The torch.compile internals the library names in one place (lightning_memguard/_compiler/), on the CPU."""

from __future__ import annotations

import pytest
import torch
from conftest import TinyModel
from lightning.pytorch.utilities.compile import from_compiled

from lightning_memguard import _compiler


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def test_is_compiled_knows_every_way_a_model_is_compiled():
    assert not _compiler.is_compiled(_mlp())
    assert _compiler.is_compiled(torch.compile(_mlp(), backend="eager"))  # torch.compile(model)
    inner = TinyModel()
    inner.net = torch.compile(inner.net, backend="eager")  # a compiled submodule
    assert _compiler.is_compiled(inner)
    in_place = _mlp()
    in_place.compile(backend="eager")  # nn.Module.compile()
    assert _compiler.is_compiled(in_place)
    lightning = from_compiled(torch.compile(TinyModel(), backend="eager"))  # what fit(torch.compile(module)) gets
    assert _compiler.is_compiled(lightning)
    assert _compiler.unwrapped(torch.compile(model := _mlp(), backend="eager")) is model
    assert _compiler.unwrapped(model) is model


def test_compiles_counts_each_new_graph():
    model = torch.compile(_mlp(), backend="eager")
    before = _compiler.compiles()
    model(torch.randn(2, 4))
    model(torch.randn(2, 4))  # the same graph again
    assert _compiler.compiles() == before + 1


def test_static_graph_per_size_compiles_each_size_static_and_restores_dynamos_settings():
    sizes = []

    def backend(gm, example_inputs):
        sizes.append({tuple(t.shape) for t in example_inputs if torch.is_tensor(t)} | {type(t) for t in example_inputs})
        return gm.forward

    model = torch.compile(_mlp(), backend=backend)
    config = torch._dynamo.config
    automatic, limit = config.automatic_dynamic_shapes, config.recompile_limit
    with _compiler.static_graph_per_size(sizes=16):
        assert not config.automatic_dynamic_shapes and config.recompile_limit == limit + 16
        for batch in range(1, 12):  # more sizes than Dynamo's default limit of 8
            model(torch.randn(batch, 4))
    assert (config.automatic_dynamic_shapes, config.recompile_limit) == (automatic, limit)
    assert len(sizes) == 11  # each size its own graph, none fell back to eager at the limit
    for batch, shapes in zip(range(1, 12), sizes, strict=True):
        assert (batch, 4) in shapes and torch.SymInt not in shapes


def test_activation_memory_budget_is_set_inside_and_restored():
    before = torch._functorch.config.activation_memory_budget
    with _compiler.activation_memory_budget(0.5):
        assert torch._functorch.config.activation_memory_budget == 0.5
    assert torch._functorch.config.activation_memory_budget == before
    with _compiler.activation_memory_budget(None):  # compile's default: nothing set
        assert torch._functorch.config.activation_memory_budget == before


def test_fresh_compiled_compiles_anew_with_the_models_own_backend():
    calls = []

    def backend(gm, example_inputs):
        calls.append(len(example_inputs))
        return gm.forward

    model = torch.compile(_mlp(), backend=backend)
    x = torch.randn(2, 4)
    model(x)
    assert len(calls) == 1
    first, second = _compiler.fresh_compiled(model, None), _compiler.fresh_compiled(model, None)
    first(model, (x,))
    first(model, (x,))  # its graph is cached now
    second(model, (x,))  # a new function: a new compile, under the settings of the moment
    assert len(calls) == 3
    # Dynamo's caches were emptied when `second` was made: the model's own call compiles again too (a model split
    # into graphs compiles parts of itself in its own frames, which a new function alone would not renew)
    torch.testing.assert_close(first(model, (x,)), model(x))
    assert len(calls) == 4
    options = _compiler.fresh_compiled(_mlp(), {"backend": backend})
    options(_mlp(), (x,))
    assert len(calls) == 5


class _Broken(torch.nn.Module):
    """Two graphs: Dynamo compiles ``a`` in this ``forward``'s frame and ``b`` in the function it resumes in after
    the break (a code object of Dynamo's own, kept for the next compile of this ``forward``)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)

    def forward(self, x):
        y = self.a(x).relu()
        torch._dynamo.graph_break()
        return self.b(y)


def test_fresh_compiled_compiles_every_graph_of_a_model_that_breaks_anew():
    """Why a measurement empties all of Dynamo's caches (docs/architecture.md): the frames of a model that breaks into
    graphs, its ``forward`` and the resume function after the break, keep their graphs from the user's compile, and
    Dynamo's guards do not look at compile's settings, so nothing short of a reset compiles both parts again."""
    calls = []

    def backend(gm, example_inputs):
        calls.append(len(example_inputs))
        return gm.forward

    model, x = _Broken(), torch.randn(2, 4)
    torch.compile(model, backend=backend)(x)  # the user's compile: two graphs
    assert len(calls) == 2
    with _compiler.activation_memory_budget(0.5):  # a setting the cached graphs were not compiled under
        _compiler.fresh_compiled(model, {"backend": backend})(model, (x,))
    assert len(calls) == 4  # both parts compiled anew, under the setting of the moment


def test_eager_runs_compiled_code_eagerly():
    calls = []

    def backend(gm, example_inputs):
        calls.append(1)
        return gm.forward

    model = torch.compile(_mlp(), backend=backend)
    with _compiler.eager():
        model(torch.randn(2, 4))
    assert calls == []
    model(torch.randn(2, 4))
    assert calls == [1]


def test_a_compile_watch_says_whether_dynamo_compiled_since_its_last_look():
    torch._dynamo.reset()
    watch = _compiler.CompileWatch()
    assert not watch.moved()
    torch.compile(lambda x: x * 2, backend="eager")(torch.ones(3))
    assert watch.moved() and not watch.moved()  # once per compile
    torch._dynamo.reset()


def test_inductor_missing_names_what_inductor_lacks_here(monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real_find_spec(name)
    )
    assert _compiler.inductor_missing(cuda=True) == "triton"
    monkeypatch.setenv("CXX", "my-c++")
    monkeypatch.setattr("shutil.which", lambda name: "/opt/bin/my-c++" if name == "my-c++" else None)
    assert _compiler.inductor_missing(cuda=False) is None  # $CXX is honoured
    monkeypatch.delenv("CXX")
    assert _compiler.inductor_missing(cuda=False) == "c++"
    assert "aot_eager" in _compiler.backends() and "inductor" in _compiler.backends()
