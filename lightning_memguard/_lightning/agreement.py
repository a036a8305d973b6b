"""How ranks share what each measured: every rank's figures gathered, and a stop decision agreed without
synchronising the device every step."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch
import torch.distributed as dist
from lightning.pytorch import Trainer


class StopVote:
    """Each step every rank casts a vote; :meth:`cast` returns the OR of all ranks' votes from ``lag`` steps ago.

    On CUDA the all-reduce runs on the device stream and its result is copied to pinned host memory; it is read
    ``lag`` steps later, when the device has long finished it, so the host never waits for the device. Every rank
    reads the same step's result, so every rank reaches the same decision at the same step. On the CPU (gloo) and
    in a single process there is no lag.
    """

    def __init__(self, device: torch.device, world_size: int) -> None:
        self.distributed = world_size > 1 and dist.is_available() and dist.is_initialized()
        self.lag = 2 if self.distributed and device.type == "cuda" else 0
        self._device = device
        self._flag: torch.Tensor | None = None
        self._local = False
        self._pending: deque[tuple[torch.Tensor, torch.cuda.Event]] = deque()
        self._free: list[torch.Tensor] = []  # pinned one-element buffers, reused: no allocation per step

    def cast(self, stop: bool) -> bool:
        """Vote (``stop`` is sticky: once True, this rank keeps voting True); return the agreed decision."""
        if not self.distributed:
            return stop
        if self._flag is None:
            self._flag = torch.zeros(1, dtype=torch.int32, device=self._device)
        if stop and not self._local:
            self._flag.fill_(1)
            self._local = True
        dist.all_reduce(self._flag, op=dist.ReduceOp.MAX)
        if self.lag == 0:
            return bool(self._flag.item())
        host = self._free.pop() if self._free else torch.empty(1, dtype=torch.int32, pin_memory=True)
        host.copy_(self._flag, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending.append((host, event))
        if len(self._pending) <= self.lag:
            return False
        host, done = self._pending.popleft()
        done.synchronize()  # recorded `lag` steps ago: already complete in practice
        agreed = bool(host.item())
        self._free.append(host)
        return agreed


def gather_rows(trainer: Trainer, row: Sequence[float]) -> list[list[float]]:
    """Every rank's ``row`` of figures, rank by rank (one all-gather; a single process gets its own row back).

    Example:
        >>> from lightning import Trainer
        >>> gather_rows(Trainer(logger=False, enable_progress_bar=False), [1.0, 2.5])
        [[1.0, 2.5]]
    """
    if trainer.world_size <= 1:
        return [list(row)]
    mine = torch.tensor(list(row), dtype=torch.float64, device=trainer.strategy.root_device)
    return trainer.strategy.all_gather(mine).reshape(-1, len(row)).tolist()
