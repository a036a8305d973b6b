"""The rebuild beyond ResNets: torchvision's Conv2dNormActivation units (MobileNet, EfficientNet, RegNet) keep only
their convolution output and rebuild the BatchNorm and activation outputs in backward."""

from __future__ import annotations

import copy
import pickle
import subprocess
import sys

import pytest
import torch
import torchvision
from conftest import fused_calls
from torch import nn
from torchvision.models.mobilenetv2 import InvertedResidual
from torchvision.ops.misc import Conv2dNormActivation, SqueezeExcitation

from lightning_memguard.checkpointing import (
    checkpoint_blocks,
    rebuild_bn_relu,
    remove_checkpointing,
    remove_rebuild,
)
from lightning_memguard.checkpointing.rebuild import RebuiltConvNormActivation, TakesRecipes
from lightning_memguard.checkpointing.wrap import preserved_state


@pytest.fixture(autouse=True)
def _deterministic():
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


def _step(model: nn.Module, forward=None, steps: int = 1, size: int = 64) -> dict[str, torch.Tensor]:
    """SGD steps on fixed random batches (dropout and stochastic depth draw from the same seed); the gradients of
    the last step and every buffer."""
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.train()
    for _ in range(steps):
        x, y = torch.randn(2, 3, size, size), torch.randint(0, 10, (2,))
        opt.zero_grad()
        nn.functional.cross_entropy((forward or model)(x), y).backward()
        opt.step()
    state = {f"grad:{n}": p.grad.clone() for n, p in model.named_parameters()}
    state.update({f"buf:{n}": b.clone() for n, b in model.named_buffers()})
    return state


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], **tolerance: float) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], msg=key, **tolerance)


def _saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct storages a forward pass saves for backward, as saved-tensor hooks around the model see
    them (parameters, buffers and the batch not counted)."""
    held = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers(), x]}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in held:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with preserved_state(model), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).sum().backward()
    return sum(seen.values())


def _swapped(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if hasattr(type(m), "_memguard_original")]


def _tiny(activation=nn.SiLU) -> nn.Sequential:
    """The pieces of an EfficientNet / MobileNetV3 block in a row: units with each activation, a depthwise unit,
    SqueezeExcitation after it, a unit without activation, dropout."""
    torch.manual_seed(0)
    return nn.Sequential(
        Conv2dNormActivation(3, 8, stride=2, activation_layer=activation),
        Conv2dNormActivation(8, 8, groups=8, activation_layer=nn.Hardswish),
        SqueezeExcitation(8, 4),
        Conv2dNormActivation(8, 16, kernel_size=1, activation_layer=nn.ReLU6),
        Conv2dNormActivation(16, 16, kernel_size=1, activation_layer=None),
        nn.Conv2d(16, 16, 3, padding=1),
        Conv2dNormActivation(16, 16, activation_layer=nn.ReLU),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Dropout(0.5),
        nn.Linear(16, 10),
    )


# The models' small-input saving, measured on this code: mobilenet_v2 62 %, mobilenet_v3_small 52 %,
# efficientnet_b0 56 %, regnet_y_400mf 33 % (its block outputs, relu(proj + f), stay)
MODELS = {"mobilenet_v2": 0.55, "mobilenet_v3_small": 0.45, "efficientnet_b0": 0.5, "regnet_y_400mf": 0.3}


@pytest.mark.parametrize("arch", list(MODELS))
def test_units_train_bit_for_bit_like_the_plain_model_and_keep_far_less(arch):
    """Gradients and BatchNorm buffers the same as the same seeded plain run (with EfficientNet's stochastic depth
    and every classifier's dropout), and a large part of what backward keeps gone."""
    torch.manual_seed(1)
    plain = torchvision.models.get_model(arch, num_classes=10)
    ours = copy.deepcopy(plain)
    units = sum(isinstance(m, Conv2dNormActivation) for m in plain.modules())
    assert rebuild_bn_relu(ours) == units
    x = torch.randn(2, 3, 64, 64)
    saved = {name: _saved_bytes(model, x) for name, model in (("plain", plain), ("ours", ours))}
    assert saved["ours"] <= (1 - MODELS[arch]) * saved["plain"], saved
    _assert_same(_step(plain), _step(ours), rtol=0, atol=0)  # on the CPU the rebuild makes the same bits


UNIT_ACTIVATIONS = [(nn.ReLU, True), (nn.ReLU6, True), (nn.ReLU6, False), (nn.SiLU, True), (nn.SiLU, False)]
UNIT_ACTIVATIONS += [(nn.Hardswish, True), (None, True)]


@pytest.mark.parametrize(("activation", "inplace"), UNIT_ACTIVATIONS)
def test_what_one_unit_keeps(activation, inplace):
    """A plain unit followed by a convolution keeps three tensors of the unit's output size (the convolution
    output, the BatchNorm output or a copy of it, the activation output); with a ReLU (its output only) or no
    activation, two. Rebuilt, only the convolution output stays."""
    torch.manual_seed(0)
    plain = nn.Sequential(
        Conv2dNormActivation(3, 8, activation_layer=activation, inplace=inplace),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 10),
    )
    ours = copy.deepcopy(plain)
    assert rebuild_bn_relu(ours) == 1
    assert isinstance(ours[1], TakesRecipes)  # the convolution after the unit saves the unit's recipe
    x = torch.randn(2, 3, 16, 16)
    one = 2 * 8 * 16 * 16 * 4  # bytes of one float tensor of the unit's output size
    kept = 2 if activation in (nn.ReLU, None) else 3
    assert _saved_bytes(plain, x) - _saved_bytes(ours, x) == (kept - 1) * one
    _assert_same(_step(plain, size=16), _step(ours, size=16), rtol=0, atol=0)


def test_a_relu_that_is_not_in_place_and_other_norms_are_left_alone():
    from torchvision.ops.misc import FrozenBatchNorm2d

    model = nn.Sequential(
        Conv2dNormActivation(3, 8, inplace=False),  # its ReLU keeps a second tensor anyway
        Conv2dNormActivation(8, 8, norm_layer=FrozenBatchNorm2d),
        Conv2dNormActivation(8, 8, activation_layer=nn.GELU, inplace=None),
    )
    assert rebuild_bn_relu(model) == 0 and _swapped(model) == []


def test_a_unit_output_changed_in_place_afterwards_is_kept_as_it_is():
    """MobileNetV3's ``result += input`` and EfficientNet's (where stochastic depth hands the tensor on unchanged)
    change a unit's output in place after it got its recipe: what runs next must keep the changed tensor."""

    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.unit = Conv2dNormActivation(8, 8, activation_layer=None)
            self.act = Conv2dNormActivation(8, 8, activation_layer=nn.SiLU)
            self.conv = nn.Conv2d(8, 10, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.unit(x)
            y += x  # in place on a unit's output
            z = self.act(y)
            z.mul_(2)  # and on an activation's
            return self.conv(z).mean((2, 3))

    torch.manual_seed(0)
    plain = nn.Sequential(Conv2dNormActivation(3, 8), Residual())
    ours = copy.deepcopy(plain)
    assert rebuild_bn_relu(ours) == 3
    _assert_same(_step(plain, size=16), _step(ours, size=16), rtol=0, atol=0)


def test_eval_mode_and_no_grad_run_the_plain_forward():
    plain, ours = _tiny(), _tiny()
    rebuild_bn_relu(ours)
    x = torch.randn(2, 3, 32, 32)
    plain.eval()
    ours.eval()
    assert torch.equal(plain(x), ours(x))
    assert _saved_bytes(ours, x) == _saved_bytes(plain, x)  # eval mode with gradients: all is kept, as in plain
    plain.train()
    ours.train()
    with torch.no_grad(), preserved_state(plain), preserved_state(ours):
        torch.manual_seed(0)
        a = plain(x)
        torch.manual_seed(0)
        assert torch.equal(a, ours(x))


def test_torch_compile_runs_the_units_as_usual():
    plain, ours = _tiny(), _tiny()
    rebuild_bn_relu(ours)
    torch.use_deterministic_algorithms(False)  # the compiler's own kernels need not be deterministic here
    a = _step(plain, forward=torch.compile(plain, backend="aot_eager"), size=32, steps=2)
    b = _step(ours, forward=torch.compile(ours, backend="aot_eager"), size=32, steps=2)
    _assert_same(a, b)
    assert int(b["buf:0.1.num_batches_tracked"]) == 2


def test_units_inside_a_checkpoint_run_as_usual_and_checkpointing_after_the_rebuild_undoes_cleanly():
    torch.manual_seed(1)
    plain = torchvision.models.mobilenet_v2(num_classes=10)
    ours = copy.deepcopy(plain)
    rebuild_bn_relu(ours)
    checkpoint_blocks(ours, units={InvertedResidual})  # the blocks' units now run inside checkpoints
    _assert_same(_step(plain), _step(ours), rtol=0, atol=0)
    assert remove_rebuild(ours) == 35  # the stem's, the last and those inside checkpointed blocks
    assert all(type(m) is Conv2dNormActivation for m in ours.modules() if isinstance(m, Conv2dNormActivation))
    assert remove_checkpointing(ours) == 17 and _swapped(ours) == []


def test_checkpoint_blocks_rebuilds_the_units_of_its_blocks():
    torch.manual_seed(1)
    plain = torchvision.models.efficientnet_b0(num_classes=10)
    ours = copy.deepcopy(plain)
    keys = list(plain.state_dict())
    plan = checkpoint_blocks(ours, rebuild_bn_relu=True)  # found by structure: the MBConv blocks
    assert plan.blocks == [] and len(plan.rebuilt) == plan.candidates == 16
    assert "rebuilt in 16" in plan.summary() and list(ours.state_dict()) == keys
    assert not isinstance(ours.features[0], RebuiltConvNormActivation)  # the stem is no block: left as it is
    in_blocks = sum(isinstance(m, Conv2dNormActivation) for m in ours.features[1:-1].modules())
    assert sum(isinstance(m, RebuiltConvNormActivation) for m in ours.modules()) == in_blocks
    _assert_same(_step(plain), _step(ours), rtol=0, atol=0)
    assert remove_rebuild(ours) == in_blocks and _swapped(ours) == []


def test_a_budget_with_the_rebuild_checkpoints_the_rest_and_trains_the_same():
    torch.manual_seed(1)
    plain = torchvision.models.mobilenet_v2(num_classes=10)
    ours = copy.deepcopy(plain)
    x = torch.randn(4, 3, 64, 64)
    before = {n: b.clone() for n, b in ours.named_buffers()}
    plan = checkpoint_blocks(ours, units={InvertedResidual}, memory_budget=0.3, example_input=x, rebuild_bn_relu=True)
    assert plan.held, plan.summary()
    assert all(torch.equal(before[n], b) for n, b in ours.named_buffers())  # planning left no trace
    assert plan.blocks and plan.rebuilt and not set(plan.blocks) & set(plan.rebuilt)
    assert set(plan.blocks) | set(plan.rebuilt) == {f"features.{i}" for i in range(1, 18)}
    _assert_same(_step(plain), _step(ours), rtol=0, atol=0)


def test_the_error_names_the_units():
    with pytest.raises(ValueError, match="BasicBlock or Bottleneck blocks, a ResNet stem or Conv2dNormActivation"):
        checkpoint_blocks(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), units={nn.Linear}, rebuild_bn_relu=True)


def test_rebuilt_units_pickle_deepcopy_and_load_in_a_fresh_interpreter(tmp_path):
    model = _tiny()
    rebuild_bn_relu(model)
    swapped = sorted({type(m).__name__ for m in model.modules() if hasattr(type(m), "_memguard_original")})
    assert swapped == ["RebuiltCNAConv2dNormActivation", "TakesRecipesConv2d", "TakesRecipesSqueezeExcitation"]
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert [type(m) for m in twin.modules()] == [type(m) for m in model.modules()]
    torch.save(model, tmp_path / "model.pt")
    script = (
        "import sys, torch; model = torch.load(sys.argv[1], weights_only=False); "
        "model(torch.randn(2, 3, 32, 32)).sum().backward(); "
        "print(sorted({type(m).__name__ for m in model.modules() if hasattr(type(m), '_memguard_original')}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "model.pt")], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == str(swapped)


def test_the_one_pass_kernel_rebuilds_the_batchnorm_outputs_of_units(monkeypatch):
    """CPU twin of test_rebuilt_units_under_bf16_and_channels_last (tests/gpu/test_gpu.py), in Triton's interpreter:
    each unit's BatchNorm (+ ReLU) output is one kernel pass, its other activation PyTorch's own after it."""
    pytest.importorskip("triton")
    from lightning_memguard.checkpointing import _fused

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _fused._kernel.cache_clear()  # built again, for the interpreter
    ran = fused_calls(monkeypatch)
    try:
        plain, ours = _tiny(), _tiny()
        rebuild_bn_relu(ours)
        a, b = _step(plain, size=32), _step(ours, size=32)
    finally:
        _fused._kernel.cache_clear()
    assert len(ran) == 5 and all(ran)  # once for each of the five units
    for key in a:
        if key.startswith("buf:"):
            assert torch.equal(a[key], b[key]), key
        else:
            assert (a[key] - b[key]).abs().max() <= 1e-5 * a[key].abs().max(), key  # the kernel's rounding


def test_units_under_bf16_autocast_and_channels_last_match_the_plain_model_to_rounding():
    """The CPU twin of the GPU test under bf16 autocast: the classifier's dropout draws the same mask in both."""
    import copy

    import torchvision

    from lightning_memguard.checkpointing import rebuild_bn_relu

    torch.manual_seed(0)
    plain = torchvision.models.mobilenet_v2(num_classes=10).to(memory_format=torch.channels_last)
    ours = copy.deepcopy(plain)
    assert rebuild_bn_relu(ours) == 35
    x = torch.randn(4, 3, 64, 64).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (4,))
    grads = {}
    for name, model in (("plain", plain), ("ours", ours)):
        torch.manual_seed(1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.nn.functional.cross_entropy(model(x), y).backward()
        grads[name] = [p.grad.float() for p in model.parameters()]
    for a, b in zip(grads["plain"], grads["ours"], strict=True):
        assert (a - b).abs().max() <= 2e-2 * a.abs().max() + 1e-6
    assert all(torch.equal(a, b) for a, b in zip(plain.buffers(), ours.buffers(), strict=True))
