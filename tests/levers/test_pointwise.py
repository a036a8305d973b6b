"""Pointwise recomputation inside a block (selective activation checkpointing, matrix products saved) on the CPU: the
gradients are the plain block's bit for bit (float32, bf16 autocast, with dropout, compiled with aot_eager), BatchNorm's
running statistics move once, no matrix product or convolution runs again in backward, the bytes it frees are the
tensors its shapes say, the per-link measurement (injected clock) leaves the model as it was, and a whole timm model
gets it block by block."""

from __future__ import annotations

import copy
import pickle

import pytest
import timm
import torch
import torchvision
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy

from lightning_memguard.checkpointing import checkpoint_blocks, remove_checkpointing
from lightning_memguard.checkpointing.model_map import map_model
from lightning_memguard.levers.pointwise import (
    PointwiseCost,
    PointwiseRecomputed,
    measure_pointwise,
    pointwise_policy,
    recompute_pointwise,
    remove_pointwise,
)

B, N, C = 2, 16, 64  # tokens: batch, sequence, width
F32 = 4  # bytes


class SwiGLUBlock(nn.Module):
    """A Llama-style MLP block: RMSNorm, then down(silu(gate(y)) * up(y)), added to the residual stream."""

    def __init__(self, width: int = C, hidden: int = 96) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(width)
        self.gate = nn.Linear(width, hidden, bias=False)
        self.up = nn.Linear(width, hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        return x + self.down(nn.functional.silu(self.gate(y)) * self.up(y))


def vit_block(**kwargs) -> nn.Module:
    return timm.models.vision_transformer.Block(C, 4, **kwargs)


def block(kind: str) -> tuple[nn.Module, torch.Tensor]:
    """A block of each kind and an input for it (an activation: it requires grad)."""
    torch.manual_seed(0)
    module, x = {
        "vit": lambda: (vit_block(), torch.randn(B, N, C)),
        "swiglu": lambda: (SwiGLUBlock(), torch.randn(B, N, C)),
        "convnext": lambda: (timm.models.convnext.ConvNeXtBlock(32, ls_init_value=0.5), torch.randn(2, 32, 8, 8)),
        "bottleneck": lambda: (torchvision.models.resnet.Bottleneck(64, 16), torch.randn(2, 64, 8, 8)),
    }[kind]()
    return module.train(), x.requires_grad_()


KINDS = ["vit", "swiglu", "convnext", "bottleneck"]


def step(module: nn.Module, x: torch.Tensor, autocast: bool = False, seed: int = 1) -> tuple[list[torch.Tensor], dict]:
    """One forward and backward from a fixed seed: the gradients (the input's last) and the buffers after it."""
    module.zero_grad(set_to_none=True)
    x.grad = None
    torch.manual_seed(seed)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = module(x)
    (out.float() * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
    grads = [p.grad.clone() for p in module.parameters()] + [x.grad.clone()]
    return grads, {name: b.clone() for name, b in module.named_buffers()}


def assert_same(a: tuple[list[torch.Tensor], dict], b: tuple[list[torch.Tensor], dict]) -> None:
    assert all(torch.equal(g, h) for g, h in zip(a[0], b[0], strict=True))
    assert a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
@pytest.mark.parametrize("kind", KINDS)
def test_gradients_and_buffers_are_the_plain_blocks_bit_for_bit(kind, autocast):
    module, x = block(kind)
    plain_module = copy.deepcopy(module)
    plain = step(plain_module, x, autocast)
    recompute_pointwise(module)
    assert isinstance(module, PointwiseRecomputed)
    assert_same(step(module, x, autocast), plain)


def test_batchnorm_running_statistics_move_once_per_step():
    module, x = block("bottleneck")
    plain_module = copy.deepcopy(module)
    recompute_pointwise(module)
    for _ in range(2):
        step(plain_module, x)
        step(module, x)
    assert int(module.bn1.num_batches_tracked) == 2
    for name, buffer in plain_module.named_buffers():
        assert torch.equal(dict(module.named_buffers())[name], buffer), name


def test_dropout_and_stochastic_depth_draw_the_same_masks():
    """Dropout after attention, in the MLP and stochastic depth: recomputed from the restored generator, in order.
    Attention dropout (which the fused attention op draws itself) makes that op recomputed too."""
    torch.manual_seed(0)
    module = vit_block(proj_drop=0.2, attn_drop=0.2, drop_path=0.2).train()
    x = torch.randn(B, N, C, requires_grad=True)
    plain = step(copy.deepcopy(module), x)
    recompute_pointwise(module)
    assert_same(step(module, x), plain)
    assert not torch.equal(step(module, x, seed=2)[0][-1], plain[0][-1])  # the masks matter


def test_the_policy_saves_products_and_attention_and_recomputes_the_rest():
    aten = torch.ops.aten
    q = torch.zeros(1, 1, 4, 8)
    assert pointwise_policy(None, aten.addmm.default) == CheckpointPolicy.MUST_SAVE
    assert pointwise_policy(None, aten.convolution.default) == CheckpointPolicy.MUST_SAVE
    flash = aten._scaled_dot_product_flash_attention_for_cpu.default
    assert pointwise_policy(None, flash, q, q, q) == CheckpointPolicy.MUST_SAVE
    assert pointwise_policy(None, flash, q, q, q, 0.1) == CheckpointPolicy.PREFER_RECOMPUTE  # it draws
    for op in (aten.gelu.default, aten.native_layer_norm.default, aten.native_batch_norm.default, aten.mul.Tensor):
        assert pointwise_policy(None, op) == CheckpointPolicy.PREFER_RECOMPUTE


class MatmulsRun(TorchDispatchMode):
    """Counts the matrix products, convolutions and attention that run (a product in a gradient counts too)."""

    OPS = ("mm", "addmm", "bmm", "baddbmm", "convolution", "_scaled_dot_product_flash_attention_for_cpu")

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket.__name__ in self.OPS
        return func(*args, **(kwargs or {}))


def backward_products(module: nn.Module, x: torch.Tensor) -> int:
    out = module(x)
    with MatmulsRun() as run:
        out.sum().backward()
    return run.count


@pytest.mark.parametrize("kind", KINDS)
def test_no_matrix_product_or_convolution_runs_again_in_backward(kind):
    """Backward runs the products of the gradients only: as many as the plain block's backward (a convolution's
    gradient is ``convolution_backward``, so a block of convolutions runs none); checkpointed whole, it runs its
    forward's again."""
    module, x = block(kind)
    plain = backward_products(copy.deepcopy(module), x)
    assert backward_products(recompute_pointwise(copy.deepcopy(module)), x) == plain
    whole = nn.Sequential(copy.deepcopy(module))
    checkpoint_blocks(whole, units=["0"])
    assert backward_products(whole, x) > plain


def _ln_stats(rows: int) -> int:
    return 2 * rows * F32  # LayerNorm's mean and reciprocal deviation, one float per row


# the bytes recompute_pointwise frees, tensor by tensor from the shapes: + what the plain block saves and the
# selective checkpoint recomputes instead, - the products' outputs it keeps that the plain block did not
EXPECTED_FREED = {
    # LayerNorm 1's output and statistics, the residual stream after attention (LayerNorm 2's input), LayerNorm 2's
    # output and statistics, GELU's output (4C); - the attention projection's and fc2's outputs
    "vit": 2 * _ln_stats(B * N) + (1 + 1 + 1 + 4 - 1 - 1) * B * N * C * F32,
    # RMSNorm's reciprocal root (one per token), its normalised input and output, SiLU's output and the gate's
    # product (hidden 96 each); - down's output
    "swiglu": B * N * F32 + 2 * B * N * C * F32 + 2 * B * N * 96 * F32 - B * N * C * F32,
    # LayerNorm's (channels last) output and statistics, GELU's output (4C); the depthwise convolution's output
    # (LayerNorm's input), fc1's (GELU's input) and fc2's (the layer scale's input) were saved already
    "convnext": _ln_stats(2 * 8 * 8) + (1 + 4) * 2 * 8 * 8 * 32 * F32,
    # the ReLUs' outputs after bn1 and bn2 (16 channels), the block's output (64), BatchNorm's batch statistics
    # (mean and inverse deviation per channel); the convolutions' outputs were saved already (BatchNorm's inputs)
    "bottleneck": (16 + 16 + 64) * 2 * 8 * 8 * F32 + 2 * (16 + 16 + 64) * F32,
}


@pytest.mark.parametrize("kind", KINDS)
def test_saved_bytes_fall_by_the_tensors_the_shapes_say(kind):
    module, x = block(kind)
    ticks = iter(range(10))
    [cost] = measure_pointwise(module, x, clock=lambda: float(next(ticks)))
    assert cost == PointwiseCost("", EXPECTED_FREED[kind], 1000.0)
    assert not isinstance(module, PointwiseRecomputed)


def test_measure_per_link_restores_the_model_and_reads_the_clock_per_recomputation():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(C, C), vit_block(), vit_block(), nn.Linear(C, 1))
    recompute_pointwise(model[2])  # applied already: measured against the plain step, and applied again after
    before = copy.deepcopy(model.state_dict())
    x = torch.randn(B, N, C)
    clock = iter([0.0, 0.002, 10.0, 10.005])
    costs = measure_pointwise(model, x, links=["1", "2"], clock=lambda: next(clock))
    assert [c.name for c in costs] == ["1", "2"]
    assert [c.extra_ms for c in costs] == [2.0, 5.0]
    # block 1's input is fc's output, held by its checkpoint as LayerNorm 1 held it; the rest as one block alone
    assert [c.freed_bytes for c in costs] == [EXPECTED_FREED["vit"]] * 2
    assert not isinstance(model[1], PointwiseRecomputed) and isinstance(model[2], PointwiseRecomputed)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_a_stem_of_several_modules_is_left_alone():
    model = torchvision.models.resnet18().train()
    stem = map_model(model, "auto").links[0]
    assert stem.stem
    assert measure_pointwise(model, torch.randn(2, 3, 32, 32), links=[stem]) == [PointwiseCost("stem", 0, 0.0)]


def test_it_pickles_and_comes_off():
    module, x = block("vit")
    keys = list(module.state_dict())
    recompute_pointwise(module)
    again = pickle.loads(pickle.dumps(module))
    assert type(again) is type(module) and list(again.state_dict()) == keys
    assert_same(step(again, x), step(module, x))
    assert remove_pointwise(module) == 1 and type(module) is timm.models.vision_transformer.Block
    assert "memguard_pointwise_name" not in module.__dict__ and remove_pointwise(module) == 0


def test_without_gradients_it_runs_as_the_block():
    module, x = block("swiglu")
    plain = module(x)
    with torch.no_grad():
        assert torch.equal(recompute_pointwise(module)(x), plain)


def test_refusals_name_the_block_and_the_fix():
    model = nn.Sequential(vit_block(), vit_block())
    checkpoint_blocks(model, units=["0"])
    with pytest.raises(ValueError, match=r"block '0' is already checkpointed whole.*remove_checkpointing"):
        recompute_pointwise(model, units=["0"])
    remove_checkpointing(model)
    with pytest.raises(ValueError, match=r"no blocks to checkpoint found in Sequential with units='auto'"):
        recompute_pointwise(nn.Sequential(nn.Linear(C, C), nn.GELU()), units="auto")
    with pytest.raises(ValueError, match=r"the model has no module named 'nine'"):
        measure_pointwise(model, torch.randn(B, N, C), links=["nine"])


class ChangesItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu_(x))


def test_a_block_that_changes_its_input_in_place_is_refused_plainly():
    module = recompute_pointwise(ChangesItsInput())
    with pytest.raises(RuntimeError, match=r"changes its input in place.*out of place"):
        module(torch.randn(2, 8, requires_grad=True) * 1)


def test_a_block_that_changes_a_kept_product_in_place_is_refused_in_its_forward():
    # timm's squeeze-excite: a convolution's output through ReLU(inplace=True). Torch's selective checkpoint refuses
    # it only in backward; the block says so at the end of its forward, by its class, and with the fix
    se = timm.create_model("regnety_002", num_classes=10).s1.b1
    module = recompute_pointwise(se)
    with pytest.raises(RuntimeError, match=r"^PointwiseRecomputedBottleneck changes in place a product it keeps.*out"):
        module(torch.randn(2, 32, 16, 16, requires_grad=True))
    module.eval()  # without gradients it runs as its class does
    with torch.no_grad():
        assert module(torch.randn(2, 32, 16, 16)).shape == (2, 24, 8, 8)


def test_the_kept_products_are_checked_at_a_blocks_first_training_forward_not_on_every_step(monkeypatch):
    from lightning_memguard import _autograd

    calls = []
    changed = _autograd.selectively_saved_changed
    monkeypatch.setattr(_autograd, "selectively_saved_changed", lambda mode: calls.append(1) or changed(mode))
    module, x = block("vit")
    recompute_pointwise(module)
    for _ in range(3):
        step(module, x)
    assert len(calls) == 1  # one selective checkpoint, asked at its first forward only (measured: at every one)


def test_a_compiled_block_is_changed_in_the_module_it_wraps():
    module, _ = block("vit")
    compiled = torch.compile(module, backend="aot_eager")
    assert recompute_pointwise(compiled) is compiled and isinstance(module, PointwiseRecomputed)
    assert remove_pointwise(compiled) == 1


def test_compiled_with_aot_eager_it_matches_the_compiled_plain_block():
    for kind in ("vit", "bottleneck"):
        module, x = block(kind)
        plain = step(torch.compile(copy.deepcopy(module), backend="aot_eager"), x)
        eager = step(copy.deepcopy(module), x)
        assert_same(step(torch.compile(recompute_pointwise(module), backend="aot_eager"), x), plain)
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(plain[0], eager[0], strict=True))


@pytest.mark.parametrize(
    "name",
    [
        "vit_tiny_patch16_224",  # every transformer layer
        "convnext_atto",  # every ConvNeXt block
        "swin_tiny_patch4_window7_224",  # shifted windows (a roll, a mask, a gathered position bias), drop path
    ],
)
def test_every_block_of_a_timm_model_bit_for_bit(name):
    torch.manual_seed(0)
    kwargs, size = {
        "vit_tiny_patch16_224": ({"img_size": 32, "depth": 2}, 32),
        "convnext_atto": ({"depths": (1, 1, 1, 1)}, 32),
        "swin_tiny_patch4_window7_224": (
            {"img_size": 56, "embed_dim": 24, "depths": (2, 2), "num_heads": (2, 4), "drop_path_rate": 0.1},
            56,
        ),
    }[name]
    model = timm.create_model(name, pretrained=False, num_classes=10, **kwargs).train()
    x = torch.randn(2, 3, size, size, requires_grad=True)
    plain = step(copy.deepcopy(model), x)
    recompute_pointwise(model, units="auto")
    blocks = [m for m in model.modules() if isinstance(m, PointwiseRecomputed)]
    assert len(blocks) == (2 if name.startswith("vit") else 4)
    assert_same(step(model, x), plain)
    assert remove_pointwise(model) == len(blocks)


def _logits_step(model: nn.Module, tokens: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    model(tokens).logits.float().sum().backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_every_layer_of_a_hugging_face_model_bit_for_bit(family):
    """Llama (RMSNorm, SwiGLU, rotary positions by keyword) and GPT-2 (dropout in attention and after it, its cache
    given by position): each layer called without its cache, as Hugging Face's own checkpointing calls it."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if family == "llama":
        config = LlamaConfig(
            vocab_size=100, hidden_size=C, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2,
        )  # fmt: skip
        model = LlamaForCausalLM(config).train()
    else:
        model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=C, n_head=4, vocab_size=100, n_positions=N)).train()
    tokens = torch.randint(0, 100, (B, N))
    plain = _logits_step(model, tokens)
    recompute_pointwise(model, units="auto")
    assert sum(isinstance(m, PointwiseRecomputed) for m in model.modules()) == 2
    assert all(torch.equal(a, b) for a, b in zip(plain, _logits_step(model, tokens), strict=True))
