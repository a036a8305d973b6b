"""The checkpointing strategies: single device, DDP on 2 CPU processes, and a LightningCLI config."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import ddp_scenario_results, trainer_kwargs
from lightning.pytorch import Trainer
from torchvision.models.resnet import BasicBlock

from lightning_memguard.strategies import CheckpointingDDPStrategy, CheckpointingSingleDeviceStrategy
from lightning_memguard.testing import ImageClassifier


def _model() -> ImageClassifier:
    model = ImageClassifier("resnet18", image_size=16, batch_size=4, steps_per_epoch=3, pool_size=8, seed=0)
    model.example_input_array = model.images[:4].clone()
    return model


def _fit(tmp_path, strategy) -> ImageClassifier:
    model = _model()
    torch.manual_seed(0)
    kwargs = trainer_kwargs(tmp_path, max_epochs=1, strategy=strategy)
    kwargs.pop("devices") if not isinstance(strategy, str) else None
    Trainer(**kwargs).fit(model)
    return model


@pytest.mark.parametrize("budget", [None, 0.6])
def test_single_device_strategy_checkpoints_and_trains_as_the_plain_model(tmp_path, budget):
    plain = _fit(tmp_path, "auto")
    strategy = CheckpointingSingleDeviceStrategy(
        "cpu", activation_checkpointing_policy={BasicBlock}, memory_budget=budget
    )
    checked = _fit(tmp_path, strategy)
    assert strategy.checkpointing.runs, "nothing was checkpointed"
    assert any(hasattr(m, "_memguard_original") for m in checked.net.modules())
    for a, b in zip(plain.state_dict().values(), checked.state_dict().values(), strict=True):
        assert torch.equal(a, b)  # three steps later: the same weights and BatchNorm statistics


def test_strategy_arguments_are_checked_at_construction():
    with pytest.raises(TypeError, match="`units` must be 'auto', module classes or names, or a callable .*, got 3"):
        CheckpointingDDPStrategy(activation_checkpointing_policy=3)
    with pytest.raises(ValueError, match="`memory_budget` as a fraction must be in \\(0, 1\\], got 1.5"):
        CheckpointingSingleDeviceStrategy("cpu", memory_budget=1.5)
    with pytest.raises(TypeError, match="`rebuild_bn_relu` must be a bool, got 'yes'"):
        CheckpointingDDPStrategy(rebuild_bn_relu="yes")


def test_a_budget_without_an_example_input_is_a_clear_error(tmp_path):
    model = _model()
    model.example_input_array = None
    kwargs = trainer_kwargs(tmp_path, strategy=CheckpointingSingleDeviceStrategy("cpu", memory_budget=0.6))
    kwargs.pop("devices")
    with pytest.raises(ValueError, match="CheckpointingSingleDeviceStrategy\\(memory_budget=...\\) measures"):
        Trainer(**kwargs).fit(model)


# the DDP scenarios run in one launch with test_ddp.py's and test_ddp_guard.py's (conftest.DDP_SCENARIOS, the
# ddp_launch fixture); planning_fails last, as it ends the launch


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_ddp_ranks_apply_rank_zeros_plan_and_train_as_plain_ddp(ddp_launch, mode):
    """Compiled: rank zero measures under compile and both ranks take its runs and compile's setting with them."""
    results = ddp_scenario_results(ddp_launch, f"ddp_strategy_run:{mode}", "strategy{rank}.json")
    ranks = [results[0], results[1]]
    assert ranks[0]["runs"] and ranks[0]["runs"] == ranks[1]["runs"]
    assert ranks[0]["swapped"] == ranks[1]["swapped"]
    # rank zero's choice of a graph per stage (or one graph), made by timing, is every rank's
    assert ranks[0]["split_graphs"] == ranks[1]["split_graphs"] and ranks[0]["split"] == ranks[1]["split"]
    assert bool(ranks[1]["split"]) is ranks[1]["split_graphs"] and (mode == "compiled" or not ranks[0]["split"])
    assert ranks[0]["compile_setting"] == ranks[1]["compile_setting"] == (0.5 if mode == "compiled" else None)
    if mode == "compiled":  # and both ranks trained under it
        assert ranks[0]["step_settings"] == ranks[1]["step_settings"] == [0.5, 0.5, 0.5]
    assert ranks[0]["compiled_plan"] is (mode == "compiled") and ranks[1]["compiled_plan"] is None  # rank 0 measured
    assert all(r["same_weights"] and r["step"] == 3 for r in ranks)


def test_ddp_rank_zero_failing_while_it_plans_ends_every_rank(ddp_launch):
    """The other ranks wait in the broadcast for rank zero's plan: its error must end the run, not leave them there."""
    launch = json.loads((ddp_launch / "launch.json").read_text(encoding="utf-8"))
    stderr = (ddp_launch / "stderr.txt").read_text(encoding="utf-8")
    # a hang would wait for gloo's 30-minute timeout: past the launch's limit (returncode None)
    assert launch["returncode"] is not None and launch["returncode"] != 0, stderr[-3000:]
    assert "injected while rank zero plans" in stderr
    assert not list((ddp_launch / "ddp_strategy_run" / "planning_fails").glob("strategy*.json"))


def test_a_lightning_cli_config_builds_the_strategy(tmp_path):
    pytest.importorskip("jsonargparse")
    from lightning.pytorch.cli import LightningCLI

    config = tmp_path / "config.yaml"
    config.write_text(
        f"""
trainer:
  accelerator: cpu
  max_epochs: 1
  default_root_dir: {tmp_path}
  enable_progress_bar: false
  enable_checkpointing: false
  logger: false
  strategy:
    class_path: lightning_memguard.strategies.CheckpointingSingleDeviceStrategy
    init_args:
      device: cpu
      activation_checkpointing_policy: auto
      rebuild_bn_relu: true
model:
  arch: resnet18
  image_size: 16
  batch_size: 4
  steps_per_epoch: 2
  pool_size: 8
""",
        encoding="utf-8",
    )
    cli = LightningCLI(ImageClassifier, args=["fit", "--config", str(config)], save_config_kwargs={"overwrite": True})
    strategy = cli.trainer.strategy
    assert isinstance(strategy, CheckpointingSingleDeviceStrategy) and strategy.checkpointing.settings.rebuild_bn_relu
    assert cli.trainer.global_step == 2
    assert any(type(m).__name__.startswith("Rebuilt") for m in cli.model.net.modules())


def test_the_settings_old_attributes_still_work_and_warn_that_they_moved():
    """``strategy.checkpointing.memory_budget`` moved to ``strategy.checkpointing.settings.memory_budget``: the old
    path reads and sets the same settings for a release, with a DeprecationWarning at the user's line."""
    from lightning_memguard import ActivationCheckpointing

    strategy = CheckpointingDDPStrategy(activation_checkpointing_policy={BasicBlock}, memory_budget=0.6)
    policy = strategy.checkpointing
    moved = r"`checkpointing.memory_budget` moved to `checkpointing.settings.memory_budget`"
    with pytest.warns(DeprecationWarning, match=moved) as caught:
        assert policy.memory_budget == 0.6
    assert caught[0].filename == __file__
    for name in ("units", "bn_correct", "rebuild_bn_relu", "rebuild_config"):
        with pytest.warns(DeprecationWarning, match=f"`checkpointing.{name}` moved"):
            assert getattr(policy, name) == getattr(policy.settings, name)
    with pytest.warns(DeprecationWarning, match=moved):
        policy.memory_budget = "2GB"
    assert policy.settings.memory_budget == "2GB"
    too_large = r"`memory_budget` as a fraction must be in \(0, 1\], got 1.5"
    with pytest.warns(DeprecationWarning, match=moved), pytest.raises(ValueError, match=too_large):
        policy.memory_budget = 1.5  # checked as the constructor checks it
    callback = ActivationCheckpointing()
    with pytest.warns(DeprecationWarning, match=moved):
        callback.policy.memory_budget = 0.5
    assert callback.memory_budget == 0.5 and callback.settings is callback.policy.settings
