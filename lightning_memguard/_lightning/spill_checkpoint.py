"""The checkpoint MemGuard writes when it stops a spilling run: where it goes, and how it is written so that a full
disk or a kill never leaves a partial file under its name, and never hides the spill."""

from __future__ import annotations

import contextlib
import os
import re
import shutil

import psutil
from lightning.pytorch import Trainer

from lightning_memguard._lightning.privates import checkpoint_contents

_TEMPORARY = re.compile(r"^\..+\.(\d+)\.memguard-tmp$")  # ".<final name>.<pid>.memguard-tmp"


def checkpoint_folder(trainer: Trainer, chosen: str | os.PathLike[str] | None) -> str:
    """Where the spill checkpoint goes: ``chosen``, else where Lightning writes this run's checkpoints (the
    ModelCheckpoint's folder, else ``<log_dir or default_root_dir>/checkpoints``, as ModelCheckpoint would)."""
    if chosen is not None:
        return os.path.expanduser(os.fspath(chosen))
    dirpath = getattr(trainer.checkpoint_callback, "dirpath", None)
    if isinstance(dirpath, str | os.PathLike) and dirpath:
        return os.fspath(dirpath)
    return os.path.join(trainer.log_dir or trainer.default_root_dir, "checkpoints")


def write_checkpoint(trainer: Trainer, path: str) -> str | None:
    """Write the Trainer's full checkpoint to ``path``: into a temporary file beside it, flushed to disk, then
    renamed. Returns None, or why it could not be written (no partial file is left then). Every rank calls it (the
    strategy may gather) and every rank gets rank zero's answer.

    Temporary files of processes that were killed while writing here are removed first.
    """
    folder = os.path.dirname(path) or "."
    temporary = trainer.strategy.broadcast(
        os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.memguard-tmp")
    )
    error: str | None = None
    try:
        checkpoint = checkpoint_contents(trainer)
        if trainer.is_global_zero:
            os.makedirs(folder, exist_ok=True)
            remove_stale_temporaries(folder)
        trainer.strategy.save_checkpoint(checkpoint, temporary)
        if trainer.is_global_zero:
            _flush_to_disk(temporary)
            os.replace(temporary, path)
    except Exception as err:  # whatever stops the write, the run must still learn of the spill
        error = f"{type(err).__name__}: {err}"
        if trainer.is_global_zero:
            _remove(temporary)
    return trainer.strategy.broadcast(error)


def remove_stale_temporaries(folder: str) -> None:
    """Remove the temporary files that a process killed while writing left in ``folder`` (its pid is gone)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        match = _TEMPORARY.match(name)
        if match and not psutil.pid_exists(int(match.group(1))):
            _remove(os.path.join(folder, name))


def _flush_to_disk(path: str) -> None:
    if os.path.isfile(path):
        with open(path, "rb+") as f:
            os.fsync(f.fileno())


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.remove(path)
