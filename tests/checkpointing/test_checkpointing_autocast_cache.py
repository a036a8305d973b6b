"""Under autocast, a checkpointed block's low-precision weight copies go when its forward ends (autocast's cache would
hold them to the end of the whole forward, where a fused loss makes its gradients), for whole blocks and for
pointwise recomputation alike; the gradients stay the plain model's, bit for bit, and the cache setting the step
runs under is given back."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from lightning_memguard import _autograd
from lightning_memguard.checkpointing import checkpoint_blocks
from lightning_memguard.levers.pointwise import recompute_pointwise

WIDTH = 64


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Stack(nn.Module):
    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(depth))
        self.head = nn.Linear(WIDTH, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class WeightCasts(TorchDispatchMode):
    """Watches every bf16 copy of a weight matrix of the layers (the shapes of ``up`` and ``down``) made while on."""

    def __init__(self) -> None:
        super().__init__()
        self.freed: list[Callable[[], bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if (
            func is torch.ops.aten._to_copy.default
            and isinstance(out, torch.Tensor)
            and out.dtype == torch.bfloat16
            and out.shape in {(4 * WIDTH, WIDTH), (WIDTH, 4 * WIDTH)}
        ):
            self.freed.append(_autograd.storage_watch(out))
        return out


def copies_alive_at_forward_end(model: nn.Module, x: torch.Tensor) -> tuple[int, int, torch.Tensor, bool]:
    """How many layer-weight copies the forward made, how many are still alive as it ends (inside autocast, where
    a loss would be computed), the loss, and whether autocast's cache was on there."""
    casts = WeightCasts()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with casts:
            loss = model(x).float().square().mean()
        alive = sum(not freed() for freed in casts.freed)
        cache_on = torch.is_autocast_cache_enabled()
    return len(casts.freed), alive, loss, cache_on


class TorchCheckpointed(Stack):
    """The same stack checkpointed layer by layer with ``torch.utils.checkpoint`` alone: the cache keeps the copies."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False)
        return self.head(x)


def gradients(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x).float().square().mean()
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_autocast_cache_holds_the_copies_of_a_plain_torch_checkpoint_to_the_forward_end() -> None:
    """What the library avoids: the same layers under torch's checkpoint alone keep every copy alive."""
    torch.manual_seed(0)
    model = TorchCheckpointed()
    made, alive, _, _ = copies_alive_at_forward_end(model, torch.randn(4, WIDTH))
    assert made == 2 * len(model.layers) and alive == made


@pytest.mark.parametrize("lever", ["whole_blocks", "pointwise"])
def test_checkpointed_layers_free_their_weight_copies_with_bit_identical_gradients(lever: str) -> None:
    torch.manual_seed(0)
    plain = Stack()
    changed = copy.deepcopy(plain)
    if lever == "whole_blocks":
        checkpoint_blocks(changed, units=[f"layers.{i}" for i in range(len(plain.layers))])
    else:
        recompute_pointwise(changed, units=[f"layers.{i}" for i in range(len(plain.layers))])
    x = torch.randn(4, WIDTH)

    made, alive, _, cache_on = copies_alive_at_forward_end(changed, x)
    assert made == 2 * len(plain.layers)
    assert alive == 0  # each layer's copies went with its forward
    assert cache_on  # the step's own setting, given back after each block

    expected, got = gradients(plain, x), gradients(changed, x)
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name


def test_a_block_that_raises_gives_the_cache_setting_back() -> None:
    class Failing(Layer):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise ValueError("bad input")

    model = Stack(depth=1)
    model.layers[0] = Failing()
    checkpoint_blocks(model, units=["layers.0"])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(ValueError, match="bad input"):
            model(torch.randn(2, WIDTH))
        assert torch.is_autocast_cache_enabled()
