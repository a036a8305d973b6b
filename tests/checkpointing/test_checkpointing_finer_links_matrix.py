"""Finer links (parts of blocks checkpointed alone, or nested in their checkpointed block) across the runs users make:
a resumed fit, DDP and ModelParallelStrategy (FSDP2) on two CPU processes, pickling (``ddp_spawn``, deepcopy) and
``torch.compile``. Each cell trains exactly as the plain model, bit for bit. Lightning builds FSDPStrategy only on a
GPU (see test_sharded.py), so it has no cell here."""

from __future__ import annotations

import copy
import io
import json
import subprocess
import sys
from typing import Any

import pytest
import torch
from conftest import ddp_scenario_results, ddp_scenarios, trainer_kwargs
from finer_links_run import GIVEN, ViTClassifier, steady_forward_times, vit
from lightning.pytorch import Trainer
from torch import nn

from lightning_memguard import ActivationCheckpointing
from lightning_memguard.checkpointing import apply_plan, is_checkpointed


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()  # a vocabulary of 100 leaves GPT-2's token ids outside it: said, and harmless here
    torch.manual_seed(0)  # dropout in the embeddings, attention and MLP: recomputation must draw the same numbers
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100))


# per family: the model, a batch, and runs with a part nested in its checkpointed block and parts alone in others
FAMILIES = {
    "timm": (vit, lambda: torch.randn(2, 3, 32, 32), [[name.removeprefix("net.") for name in run] for run in GIVEN]),
    "hf": (
        _gpt2,
        lambda: {"input_ids": torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))},
        [["transformer.h.0"], ["transformer.h.0.attn"], ["transformer.h.0.mlp"], ["transformer.h.1.mlp"]],
    ),
}


def _step(model: nn.Module, x: Any, grads_of: nn.Module | None = None) -> dict[str, torch.Tensor]:
    """One training step's gradients and the buffers after it, the same seed before it (``grads_of``: the module
    whose parameters ``model`` trains, where ``model`` is a compiled wrapper of it). A Hugging Face model is called
    with ``use_cache=False``, as its own switch and ours call it while they checkpoint: the reference for
    bit-identity (since transformers 5 the cached path builds its attention mask otherwise, which rounds the
    attention's output differently in the last bit: 28 of GPT-2's 28 gradients differ between the two calls of the
    plain model)."""
    torch.manual_seed(7)
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(**x, use_cache=False) if isinstance(x, dict) else model(x)
    (out.logits if hasattr(out, "logits") else out).float().pow(2).mean().backward()
    held = grads_of if grads_of is not None else model
    state = {f"grad:{n}": p.grad.clone() for n, p in held.named_parameters() if p.grad is not None}
    return state | {f"buffer:{n}": b.clone() for n, b in held.named_buffers()}


def _same(plain: dict[str, torch.Tensor], ours: dict[str, torch.Tensor]) -> None:
    assert plain.keys() == ours.keys()
    for name in plain:
        torch.testing.assert_close(ours[name], plain[name], rtol=0, atol=0, msg=name)


def _checkpointed(model: nn.Module) -> list[str]:
    return sorted(name for name, m in model.named_modules() if is_checkpointed(m))


def _names(runs: list[list[str]]) -> list[str]:
    return sorted(name for run in runs for name in run)


def _has_parts(runs: list[list[str]]) -> bool:
    return any(name.rpartition(".")[2] in ("attn", "mlp") for run in runs for name in run)


# --- a fit resumed from its checkpoint --------------------------------------------------------------------------------


def _fit_and_resume(tmp_path, callbacks: tuple[list, list]) -> tuple[ViTClassifier, list[Trainer]]:
    """One epoch, then a new Trainer and a new model resumed from its checkpoint for a second; the same seed before
    each fit (Lightning does not restore the generators)."""
    trainers = []
    for epochs, listed in zip((1, 2), callbacks, strict=True):
        model = ViTClassifier()
        resume = {"ckpt_path": trainers[-1].checkpoint_callback.best_model_path} if trainers else {}
        folder = tmp_path / f"epochs{epochs}"
        trainer = Trainer(**trainer_kwargs(folder, max_epochs=epochs, enable_checkpointing=True, callbacks=listed))
        torch.manual_seed(0)
        trainer.fit(model, **resume)
        trainers.append(trainer)
    return model, trainers


@pytest.fixture(scope="module")
def plain_resumed(tmp_path_factory) -> dict[str, torch.Tensor]:
    model, _ = _fit_and_resume(tmp_path_factory.mktemp("plain"), ([], []))
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("planned", ["budget", "nested"])
def test_a_resumed_fit_re_applies_the_runs_parts_included_without_measuring(tmp_path, plain_resumed, planned):
    """``budget``: measured at 0.8 of the plain peak (the forward times held steady), parts of unchecked blocks
    chosen. ``nested``: the first fit was handed runs with parts nested in their block and parts alone (as its own
    resume would hand them). The resumed fit (a new Trainer, model and callback, configured the same) checkpoints
    the same modules without measuring, and ends on the plain run's weights, bit for bit."""
    first, again = ActivationCheckpointing(memory_budget=0.8), ActivationCheckpointing(memory_budget=0.8)
    if planned == "nested":
        first.load_state_dict({"runs": GIVEN})
    with steady_forward_times():
        model, (trainer, resumed) = _fit_and_resume(tmp_path, ([first], [again]))
    assert first.runs and _has_parts(first.runs)
    if planned == "budget":
        assert first.plan is not None and first.plan.parts, first.plan and first.plan.summary()
    assert again.plan is None  # nothing measured again
    assert again.runs == first.runs and trainer.global_step == 4 and resumed.global_step == 8
    assert _checkpointed(model) == _names(first.runs)
    _same(plain_resumed, model.state_dict())


# --- DDP and ModelParallelStrategy (FSDP2) on two processes -----------------------------------------------------------


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """tests/finer_links_run.py's scenarios, in one two-rank launch of their own (``conftest.ddp_scenarios``)."""
    return ddp_scenarios(tmp_path_factory, "finer-links", ["finer_links_run:ddp", "finer_links_run:fsdp2"], timeout=300)


@pytest.mark.parametrize("who", ["callback", "strategy"])
def test_ddp_every_rank_applies_rank_zeros_runs_parts_included_and_trains_as_plain_ddp(two_ranks, who):
    """ActivationCheckpointing under ``"ddp"``, and CheckpointingDDPStrategy: rank zero measures, and both ranks
    checkpoint the parts it chose and end on plain DDP's weights."""
    ranks = ddp_scenario_results(two_ranks, "finer_links_run:ddp", "ddp-rank{rank}.json")
    r0, r1 = ranks[0][who], ranks[1][who]
    assert r0["parts"] and r1["parts"] is None  # planned on rank zero alone
    assert r0["runs"] == r1["runs"] and _has_parts(r0["runs"])
    for r in (r0, r1):
        assert r["checkpointed"] == [n.removeprefix("net.") for n in _names(r0["runs"])]
        assert r["same_keys"] and r["differ"] == [] and r["step"] == 2


@pytest.mark.parametrize("how", ["budget", "nested", "given"])
def test_model_parallel_every_rank_checkpoints_the_same_parts_and_trains_as_without(two_ranks, how):
    """FSDP2's ``fully_shard`` on each ViT block: ``budget``: every rank measures at 0.8 (which parts, if any, is
    not asserted: on the CPU the gathered weights make the counted bytes vary from pass to pass); ``nested``: the
    measured peaks favour parts nested in their checkpointed blocks (under a budget of half the peak); ``given``:
    runs of parts alone and nested handed to the callback, as a resumed run's checkpoint does. Each rank
    checkpoints rank zero's runs, and its shards end as the run without checkpointing left them."""
    ranks = ddp_scenario_results(two_ranks, "finer_links_run:fsdp2", "fsdp2-rank{rank}.json")
    r0, r1 = ranks[0][how], ranks[1][how]
    assert r0["runs"] == r1["runs"]
    if how == "nested":
        assert r0["parts"] == r1["parts"] == [f"net.blocks.{i}.{p}" for i in range(3) for p in ("attn", "mlp")]
    if how == "given":
        assert r0["runs"] == GIVEN and r0["parts"] is None  # nothing measured
    for r in (r0, r1):
        assert r["checkpointed"] == [n.removeprefix("net.") for n in _names(r0["runs"])]
        assert r["same_keys"] and r["differ"] == [] and r["step"] == 2


# --- pickling (ddp_spawn, torch.save) and deepcopy --------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_parts_alone_and_nested_survive_save_load_and_deepcopy(family):
    build, batch, runs = FAMILIES[family]
    plain, x = build(), batch()
    ours = copy.deepcopy(plain)
    apply_plan(ours, runs)
    buffer = io.BytesIO()
    torch.save(ours, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    expected = _step(plain, x)
    for other in (loaded, copy.deepcopy(ours)):
        assert [type(m) for m in other.modules()] == [type(m) for m in ours.modules()]
        assert _checkpointed(other) == _names(runs)
        _same(expected, _step(other, x))


_LOAD_AND_STEP = """
import json, sys, torch
model, x = torch.load(sys.argv[1], weights_only=False), torch.load(sys.argv[2])
torch.manual_seed(7)
model.train()
model(x).float().pow(2).mean().backward()
torch.save({n: p.grad for n, p in model.named_parameters()}, sys.argv[3])
print(json.dumps(sorted(n for n, m in model.named_modules() if hasattr(m, "_memguard_original"))))
"""


def test_a_model_with_parts_loads_and_trains_the_same_in_a_fresh_interpreter(tmp_path):
    """What ``ddp_spawn`` does to the model (Windows' only start method): pickled, and unpickled where none of the
    checkpointed classes were ever made."""
    build, batch, runs = FAMILIES["timm"]
    plain, x = build(), batch()
    ours = copy.deepcopy(plain)
    apply_plan(ours, runs)
    torch.save(ours, tmp_path / "model.pt")
    torch.save(x, tmp_path / "x.pt")
    args = [str(tmp_path / name) for name in ("model.pt", "x.pt", "grads.pt")]
    done = subprocess.run([sys.executable, "-c", _LOAD_AND_STEP, *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == _names(runs)
    grads = torch.load(tmp_path / "grads.pt")
    expected = _step(plain, x)
    assert grads.keys() == {k.removeprefix("grad:") for k in expected if k.startswith("grad:")}
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[f"grad:{name}"], rtol=0, atol=0, msg=name)


# --- torch.compile ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_after_parts_alone_and_nested_trains_as_the_plain_model(family):
    """``torch.compile(backend="aot_eager")`` of a model whose parts are checkpointed alone and inside their
    checkpointed block: the same gradients and buffers as the plain eager model, dropout included."""
    build, batch, runs = FAMILIES[family]
    plain, x = build(), batch()
    ours = copy.deepcopy(plain)
    apply_plan(ours, runs)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(ours, backend="aot_eager")
        _same(_step(plain, x), _step(compiled, x, grads_of=ours))
    finally:
        torch._dynamo.reset()
