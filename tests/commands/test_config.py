"""MemGuard configured the way many Lightning users do it: a LightningCLI YAML file."""

from __future__ import annotations

import pytest

pytest.importorskip("jsonargparse")

from conftest import TinyModel  # noqa: E402
from lightning.pytorch.cli import LightningCLI  # noqa: E402

from lightning_memguard import MemGuard  # noqa: E402


def test_lightning_cli_yaml_builds_and_runs_memguard(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(
        f"""
trainer:
  accelerator: cpu
  max_epochs: 2
  default_root_dir: {tmp_path}
  enable_progress_bar: false
  enable_checkpointing: false
  logger:
    class_path: lightning.pytorch.loggers.CSVLogger
    init_args:
      save_dir: {tmp_path}
  callbacks:
    - class_path: lightning_memguard.MemGuard
      init_args:
        capacity: 16GB
        headroom: 0.1
        on_spill: stop
        read_every: 5
"""
    )
    cli = LightningCLI(TinyModel, args=["fit", "--config", str(config)], save_config_kwargs={"overwrite": True})
    (guard,) = [c for c in cli.trainer.callbacks if isinstance(c, MemGuard)]
    assert guard.capacity == 16 * 10**9 and guard.headroom == 0.1 and guard.on_spill == "stop"
    assert len(guard.epochs) == 2
    assert float(cli.trainer.callback_metrics["memguard/capacity_gb"]) == pytest.approx(16.0)


def test_lightning_cli_rejects_a_bad_capacity(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(
        """
trainer:
  accelerator: cpu
  callbacks:
    - class_path: lightning_memguard.MemGuard
      init_args:
        capacity: 16XB
"""
    )
    with pytest.raises(ValueError, match="`capacity` must be .*'16XB'"):
        LightningCLI(TinyModel, args=["--config", str(config)], run=False)
