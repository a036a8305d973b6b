"""Model families: one adapter per family in one registry (``checkpointing/families``). Every adapter's
models, built from small configurations (no downloads), are found as their family's own switch sees them, train,
keep gradients and BatchNorm buffers bit-identical to the plain model's, keep their ``state_dict`` keys, pickle,
and train compiled (``aot_eager``) as well as eager. timm's ResNet family is rebuilt, BatchNorm-exact; a Hugging
Face model trains without its key/value cache while checkpointed. A plan's summary says a budget it did not meet,
with the floor reached, in a unit that fits the model. timm and transformers are optional: their cases are skipped
where they are not installed."""

from __future__ import annotations

import copy
import inspect
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
import torch
import torchvision
from conftest import trainer_kwargs
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_memguard.checkpointing import (
    checkpoint_blocks,
    families,
    find_units,
    is_checkpointed,
    rebuild_bn_relu,
    remove_checkpointing,
    remove_rebuild,
)
from lightning_memguard.checkpointing.measure import StepMeter, default_loss
from lightning_memguard.checkpointing.result import CheckpointPlan
from lightning_memguard.checkpointing.wrap import TrainingKeywords, keyword_positions, swap_chain


@dataclass(frozen=True)
class Case:
    """One model of one family at a small size."""

    id: str
    family: str  # the adapter that claims it ("" for none: structure)
    build: Callable[[], nn.Module]
    example: Callable[[], torch.Tensor]
    blocks: dict[str, int]  # block class -> how many
    needs: str = ""  # the optional library it needs
    plain: dict[str, Any] = field(default_factory=dict)  # keyword arguments of the plain model's reference call


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models gain nothing from a second thread; on a busy machine, threads waiting on each other cost seconds a
    step (a forward and backward of a tiny MobileNet: 6 s with two threads under load, 0.15 s with one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _image(size: int = 32) -> Callable[[], torch.Tensor]:
    return lambda: torch.randn(2, 3, size, size)


def _tokens() -> torch.Tensor:
    return torch.randint(0, 64, (2, 8))


def _timm(name: str, **kwargs: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import timm

        return timm.create_model(name, pretrained=False, num_classes=10, **kwargs)

    return build


TINY_RESNET = {"layers": (2, 1, 1, 1), "channels": (8, 16, 32, 64), "stem_width": 8}


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(
        GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0)
    )


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=64, max_position_embeddings=16, bos_token_id=0, eos_token_id=0, attention_dropout=0.1,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def _bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2, vocab_size=64,
        max_position_embeddings=16,
    )  # fmt: skip
    return BertForSequenceClassification(config)


NO_CACHE = {"use_cache": False}  # how Hugging Face's own switch calls the model: the reference for bit-identity

CASES = [
    Case("tv_resnet18", "torchvision ResNet", lambda: torchvision.models.resnet18(num_classes=10), _image(),
         {"BasicBlock": 8}),
    Case("tv_mobilenet_v3", "", lambda: torchvision.models.mobilenet_v3_small(num_classes=10), _image(),
         {"InvertedResidual": 11}),
    Case("timm_resnet50d", "timm ResNet", _timm("resnet50d", **TINY_RESNET), _image(), {"Bottleneck": 5}, "timm"),
    Case("timm_seresnext26d", "timm ResNet",
         _timm("seresnext26d_32x4d", **{**TINY_RESNET, "channels": (16, 32, 64, 128), "cardinality": 4,
                                        "base_width": 16}),
         _image(), {"Bottleneck": 5}, "timm"),
    Case("timm_resnet18", "timm ResNet", _timm("resnet18", **TINY_RESNET), _image(), {"BasicBlock": 5}, "timm"),
    Case("timm_convnext", "timm ConvNeXt", _timm("test_convnext", drop_path_rate=0.1), _image(),
         {"ConvNeXtBlock": 9}, "timm"),
    Case("timm_vit", "timm ViT / DeiT / EVA", _timm("test_vit", img_size=32, drop_path_rate=0.1), _image(),
         {"Block": 6}, "timm"),
    Case("timm_deit", "timm ViT / DeiT / EVA",
         _timm("deit_tiny_distilled_patch16_224", img_size=32, patch_size=8, depth=2, embed_dim=24, num_heads=2),
         _image(), {"Block": 2}, "timm"),
    Case("timm_eva", "timm ViT / DeiT / EVA",
         _timm("eva02_tiny_patch14_224", img_size=28, patch_size=7, depth=2, embed_dim=24, num_heads=2),
         _image(28), {"EvaBlock": 2}, "timm"),
    Case("timm_swin", "timm Swin Transformer",
         _timm("swin_tiny_patch4_window7_224", img_size=32, window_size=2, depths=(1, 1, 2, 1), embed_dim=8,
               num_heads=(1, 1, 2, 2), drop_path_rate=0.1),
         _image(), {"SwinTransformerBlock": 5}, "timm"),
    Case("timm_efficientnet", "timm EfficientNet / MobileNet", _timm("test_efficientnet"), _image(),
         {"ConvBnAct": 1, "EdgeResidual": 2, "InvertedResidual": 2}, "timm"),
    Case("timm_mobilenetv3", "timm EfficientNet / MobileNet", _timm("mobilenetv3_small_050"), _image(),
         {"DepthwiseSeparableConv": 1, "InvertedResidual": 10, "ConvBnAct": 1}, "timm"),
    Case("hf_gpt2", "Hugging Face transformers", _gpt2, _tokens, {"GPT2Block": 2}, "transformers", NO_CACHE),
    Case("hf_llama", "Hugging Face transformers", _llama, _tokens, {"LlamaDecoderLayer": 2}, "transformers",
         NO_CACHE),
    Case("hf_bert", "Hugging Face transformers", _bert, _tokens, {"BertLayer": 2}, "transformers"),
]  # fmt: skip
BY_ID = {case.id: case for case in CASES}
# one model of each adapter that names blocks, at its smallest: a compile costs seconds a model (torchvision's ResNet
# compiles in test_compile_checkpointing_budget and test_compile_graph_per_container)
COMPILED = {
    "timm_resnet50d": _timm("resnet50d", **{**TINY_RESNET, "layers": (1, 1, 1, 1)}),
    "timm_convnext": _timm("test_convnext", depths=(1, 1, 1, 1), drop_path_rate=0.1),
    "timm_vit": _timm("test_vit", img_size=32, depth=2, drop_path_rate=0.1),
    "timm_efficientnet": BY_ID["timm_efficientnet"].build,
    "timm_swin": _timm(
        "swin_tiny_patch4_window7_224",
        img_size=32,
        window_size=2,
        depths=(1, 1, 1, 1),
        embed_dim=8,
        num_heads=(1, 1, 2, 2),
    ),
    "hf_gpt2": _gpt2,
}


def _built(case: Case) -> nn.Module:
    if case.needs:
        pytest.importorskip(case.needs)
        if case.needs == "transformers":
            import transformers

            transformers.logging.set_verbosity_error()  # tiny configurations: no warnings about token ids
    torch.manual_seed(0)
    return case.build()


def _output(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.logits


def _step(model: nn.Module, x: torch.Tensor, **kwargs: Any) -> tuple[list[torch.Tensor | None], dict[str, Any]]:
    torch.manual_seed(1)  # dropout and stochastic depth draw the same numbers in every run
    model.train()
    _output(model(x, **kwargs)).float().square().mean().backward()
    grads = [p.grad.clone() if p.grad is not None else None for p in model.parameters()]
    state = getattr(model, "_orig_mod", model).state_dict()  # a compiled model's own keys
    return grads, {k: v.clone() for k, v in state.items() if "running" in k or "num_batches" in k}


def _same(a: tuple[list[Any], dict[str, Any]], b: tuple[list[Any], dict[str, Any]]) -> None:
    (grads_a, bufs_a), (grads_b, bufs_b) = a, b
    assert len(grads_a) == len(grads_b)
    for g, h in zip(grads_a, grads_b, strict=True):
        assert (g is None and h is None) or torch.equal(g, h)
    assert bufs_a.keys() == bufs_b.keys()
    for key in bufs_a:
        assert torch.equal(bufs_a[key], bufs_b[key]), key


def _nothing_left(model: nn.Module) -> None:
    assert not any(swap_chain(type(m))[0] for m in model.modules())
    assert not any(key.startswith("memguard") for m in model.modules() for key in vars(m))


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_every_family_is_found_trains_pickles_and_stays_bit_identical(case):
    plain = _built(case)
    x = case.example()
    found = find_units(plain)
    kinds: dict[str, int] = {}
    for _, block in found:
        kinds[type(block).__name__] = kinds.get(type(block).__name__, 0) + 1
    assert kinds == case.blocks
    assert [family.name for _, _, family in families.claimed(plain)] == ([case.family] if case.family else [])
    keys = list(plain.state_dict())
    expected = _step(copy.deepcopy(plain), x, **case.plain)

    ours = copy.deepcopy(plain)
    plan = checkpoint_blocks(ours)
    assert [name for name in plan.blocks if name != "stem"] == [name for name, _ in found]
    assert list(ours.state_dict()) == keys
    restored = pickle.loads(pickle.dumps(ours))  # ddp_spawn, Windows' spawn
    checkpointed = [n for n, m in ours.named_modules() if is_checkpointed(m)]
    assert checkpointed and [n for n, m in restored.named_modules() if is_checkpointed(m)] == checkpointed
    _same(expected, _step(ours, x))
    _same(expected, _step(restored, x))

    assert remove_checkpointing(ours) == len(plan.blocks)
    _nothing_left(ours)


@pytest.mark.parametrize("case_id", list(COMPILED))
def test_every_family_trains_compiled_bit_identical(case_id):
    case = replace(BY_ID[case_id], build=COMPILED[case_id])
    plain = _built(case)
    x = case.example()
    expected = _step(copy.deepcopy(plain), x, **case.plain)
    ours = copy.deepcopy(plain)
    assert checkpoint_blocks(ours).blocks
    torch._dynamo.reset()
    try:
        _same(expected, _step(torch.compile(ours, backend="aot_eager"), x))
    finally:
        torch._dynamo.reset()


# ----- timm's ResNet family: the rebuild -----

REBUILT = {"timm_resnet50d": 5, "timm_seresnext26d": 0, "timm_resnet18": 5}  # case -> blocks rebuilding their output


@pytest.mark.parametrize("case_id", list(REBUILT))
def test_the_rebuild_takes_timms_resnet_family_batchnorm_exact(case_id):
    case = BY_ID[case_id]
    plain = _built(case)
    x = case.example()
    expected = _step(copy.deepcopy(plain), x)
    ours = copy.deepcopy(plain)
    assert rebuild_bn_relu(ours) == 6  # 5 blocks and the (deep) stem
    # a block's own output is rebuilt where nothing sits between its last BatchNorm and the sum (not SE-ResNeXt's)
    assert sum("memguard_tail" in vars(m) for m in ours.modules()) == REBUILT[case_id]
    _same(expected, _step(ours, x))
    loss = lambda out: default_loss(out)  # noqa: E731
    assert StepMeter(ours, x, loss).peak() < StepMeter(plain, x, loss).peak()  # fewer bytes saved for backward
    assert remove_rebuild(ours) == 6
    _nothing_left(ours)


def test_a_budget_on_timms_resnet_rebuilds_first_and_stays_bit_identical():
    case = BY_ID["timm_resnet50d"]
    plain = _built(case)
    x = case.example()
    expected = _step(copy.deepcopy(plain), x)
    ours = copy.deepcopy(plain)
    torch.manual_seed(1)
    plan = checkpoint_blocks(ours, memory_budget=0.5, example_input=x, rebuild_bn_relu=True)
    assert plan.held, plan.summary()
    assert plan.rebuilt and plan.candidates == 6  # the stem and five blocks
    _same(expected, _step(ours, x))


# ----- Hugging Face -----


def _cache(output: Any) -> Any:
    return output.get("cache", output.get("past_key_values"))  # transformers 5 renamed it


def test_a_hugging_face_model_trains_without_its_cache_only_while_checkpointed():
    model = _built(BY_ID["hf_gpt2"])
    x = _tokens()
    assert _cache(model.train()(x)) is not None  # the plain model builds its key/value cache in training too
    checkpoint_blocks(model)
    base = model.transformer
    assert isinstance(base, TrainingKeywords) and type(base).__name__ == "GPT2Model"  # the name a saved config takes
    assert model.config.use_cache is True  # the configuration is not changed
    assert _cache(model.train()(x)) is None
    position = list(inspect.signature(swap_chain(type(base))[1].forward).parameters).index("use_cache") - 1  # self
    assert keyword_positions(base, {"use_cache": False}) == (("use_cache", position, False),)  # its place if given so
    with torch.no_grad():
        assert _cache(model(x)) is not None  # without gradients nothing is recomputed: the call is as given
        assert _cache(model.eval()(x)) is not None
    remove_checkpointing(model)
    assert type(model.transformer) is swap_chain(type(base))[1] and _cache(model.train()(x)) is not None
    _nothing_left(model)


def test_a_hugging_face_model_that_declares_no_gradient_checkpointing_is_refused():
    pytest.importorskip("transformers")
    from transformers import GPT2LMHeadModel

    class Declared(GPT2LMHeadModel):
        supports_gradient_checkpointing = False

    torch.manual_seed(0)
    model = Declared(_gpt2().config)
    with pytest.raises(ValueError, match="Declared declares supports_gradient_checkpointing = False"):
        checkpoint_blocks(model)
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    assert checkpoint_blocks(model, units={GPT2Block}).blocks == ["transformer.h.0", "transformer.h.1"]


@pytest.mark.filterwarnings("ignore:.*gradient_checkpointing_enable.*:FutureWarning")  # renamed in transformers 5
def test_layers_that_hugging_faces_own_switch_checkpoints_are_left_alone():
    model = _built(BY_ID["hf_gpt2"])
    model.gradient_checkpointing_enable()
    with pytest.warns(UserWarning, match=r"2 block\(s\) are already wrapped by other code"):
        plan = checkpoint_blocks(model)
    assert plan.blocks == [] and not any(is_checkpointed(m) for m in model.modules())


def test_layers_that_hugging_faces_every_n_layers_switch_leaves_are_ours_with_the_plain_gradients():
    """transformers' switch with ``every_n_layers=n`` (``gradient_checkpointing_enable``, renamed
    ``activation_checkpointing_enable`` in later releases) checkpoints every n-th layer and leaves the others keeping
    their activations: the layers it left are ours to take, the others its own, and the gradients are the plain
    model's, bit for bit."""
    model = _built(BY_ID["hf_gpt2"])
    switch = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    if "every_n_layers" not in inspect.signature(switch).parameters:
        pytest.skip("this transformers' switch has no every_n_layers")
    x = _tokens()
    expected = _step(copy.deepcopy(model), x, use_cache=False)  # as both switches call it while training
    switch(every_n_layers=2)
    own = [name for name, layer in find_units(model) if vars(layer).get("gradient_checkpointing")]
    assert own == ["transformer.h.0"]  # the first of every two
    with pytest.warns(UserWarning, match=r"1 block\(s\) are already wrapped by other code \(transformer.h.0"):
        plan = checkpoint_blocks(model)
    assert plan.blocks == ["transformer.h.1"] and is_checkpointed(model.transformer.h[1])
    assert not is_checkpointed(model.transformer.h[0])
    _same(expected, _step(model, x))


@pytest.mark.filterwarnings("ignore:.*gradient_checkpointing_enable.*:FutureWarning")  # renamed in transformers 5
def test_a_hugging_face_models_embeddings_module_is_a_stem_before_its_first_layer():
    """BERT's embeddings (summed, LayerNorm, dropout: one module) keep tensors for backward that no layer's
    checkpoint frees; a link of their own, before the first layer. GPT-2 sums its embeddings in its own forward: no
    module to take, no stem; a ViT's (patches, positions, no dropout) keep nothing: no stem either; nor ViLT's, text and
    image in one module, whose recomputation kept 4x the switch's bytes (docs/coverage.md)."""
    bert, x = _built(BY_ID["hf_bert"]), _tokens()
    expected = _step(copy.deepcopy(bert), x)
    layers = [name for name, _ in find_units(bert)]
    kept = {}
    for units in ("layers", "auto"):
        ours = copy.deepcopy(bert)
        plan = checkpoint_blocks(ours, units=layers if units == "layers" else "auto")
        kept[units] = StepMeter(ours, x, lambda out: _output(out).float().square().mean()).peak()
        _same(expected, _step(ours, x))
    assert plan.blocks == ["stem", *layers] and is_checkpointed(ours.bert.embeddings)
    assert kept["auto"] < kept["layers"]
    assert checkpoint_blocks(_built(BY_ID["hf_gpt2"])).blocks == ["transformer.h.0", "transformer.h.1"]
    from transformers import ViTConfig, ViTModel

    vit = ViTModel(ViTConfig(image_size=16, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2))
    assert checkpoint_blocks(vit).blocks == [name for name, _ in find_units(vit)] and len(find_units(vit)) == 2
    from transformers import ViltConfig, ViltModel  # text and image in one module: recomputed, it kept more

    vilt = ViltModel(ViltConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64))
    assert "stem" not in checkpoint_blocks(vilt).blocks and not is_checkpointed(vilt.embeddings)
    assert [name for name, _ in find_units(vilt)] and all(is_checkpointed(block) for _, block in find_units(vilt))
    bert.gradient_checkpointing_enable()  # its own switch takes the layers; the embeddings, which it leaves, are ours
    with pytest.warns(UserWarning, match=r"2 block\(s\) are already wrapped by other code"):
        assert checkpoint_blocks(bert).blocks == ["stem"]


@pytest.mark.parametrize("case_id", ["timm_resnet18", "timm_convnext"])
def test_blocks_that_timms_own_switch_checkpoints_are_left_alone(case_id):
    model = _built(BY_ID[case_id])
    model.set_grad_checkpointing(True)  # the model's flag (ResNet) or its stages' (ConvNeXt)
    with pytest.warns(UserWarning, match=r"block\(s\) are already wrapped by other code"):
        plan = checkpoint_blocks(model)
    assert plan.blocks in ([], ["stem"])  # a ResNet's stem, which timm's switch leaves, is still ours
    assert not any(is_checkpointed(block) for _, block in find_units(model))


def test_a_budget_on_a_hugging_face_decoder_stays_bit_identical():
    case = BY_ID["hf_llama"]
    plain = _built(case)
    x = case.example()
    expected = _step(copy.deepcopy(plain), x, **case.plain)
    ours = copy.deepcopy(plain)
    plan = checkpoint_blocks(ours, memory_budget=0.9, example_input=x)
    assert (plan.blocks or plan.parts) and plan.held, plan.summary()
    _same(expected, _step(ours, x))


class _LanguageModel(LightningModule):
    """A tiny GPT-2 trained by a Trainer: the callback finds its layers through the registry."""

    def __init__(self) -> None:
        super().__init__()
        self.model = _gpt2()
        self.caches: list[Any] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        output = self.model(batch[0], labels=batch[0])
        self.caches.append(_cache(output))
        return output.loss

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randint(0, 64, (8, 8))), batch_size=4)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_the_callback_checkpoints_a_hugging_face_model_inside_a_lightning_module(tmp_path):
    pytest.importorskip("transformers")
    from lightning_memguard import ActivationCheckpointing

    torch.manual_seed(0)
    module = _LanguageModel()
    callback = ActivationCheckpointing()
    Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=[callback])).fit(module)
    assert callback.blocks == ["model.transformer.h.0", "model.transformer.h.1"]
    assert isinstance(module.model.transformer, TrainingKeywords)
    assert module.caches == [None, None]  # trained without the key/value cache


# ----- the registry -----


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


def test_a_model_of_no_known_family_is_found_by_structure():
    model = nn.Sequential(_Block(), _Block(), _Block(), nn.Linear(8, 1))
    assert families.claimed(model) == [] and families.blocks(model) is None
    assert [name for name, _ in find_units(model)] == ["0", "1", "2"]


class _Toy(nn.Module):
    """A family of our own: blocks in ``trunk``, a stem, and a forward that takes ``fast`` (which must be off while
    blocks are checkpointed)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 8)
        self.trunk = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)])
        self.calls: list[bool] = []

    def forward(self, x: torch.Tensor, fast: bool = True) -> torch.Tensor:
        self.calls.append(fast)
        x = self.stem(x)
        for block in self.trunk:
            x = block(x)
        return x


class _ToyFamily(families.Family):
    name = "toy"

    def claims(self, module: nn.Module) -> bool:
        return isinstance(module, _Toy)

    def blocks(self, module: nn.Module) -> list[families.Named]:
        return [(f"trunk.{i}", block) for i, block in enumerate(module.trunk)]

    def stem(self, module: nn.Module) -> families.Stem:
        return families.Stem((("stem", module.stem),), before="trunk.0")

    def while_checkpointed(self, module: nn.Module) -> list[tuple[nn.Module, dict[str, Any]]]:
        return [(module, {"fast": False})]


def test_adding_a_family_is_one_adapter_and_one_registry_entry(monkeypatch):
    monkeypatch.setattr(families, "FAMILIES", (*families.FAMILIES, _ToyFamily()))
    model = nn.Sequential(_Toy())  # inside another module: the outermost claimed model
    assert [name for name, _ in find_units(model)] == ["0.trunk.0", "0.trunk.1", "0.trunk.2"]
    plan = checkpoint_blocks(model)
    assert plan.blocks == ["0.stem", "0.trunk.0", "0.trunk.1", "0.trunk.2"]
    toy = model[0]
    model(torch.randn(2, 4)).sum().backward()
    toy(torch.randn(2, 4), True).sum().backward()  # given by position: replaced there
    with torch.no_grad():
        model(torch.randn(2, 4))
    assert toy.calls == [False, False, True]  # off while training with blocks checkpointed, as given otherwise
    remove_checkpointing(model)
    _nothing_left(model)


# ----- the plan's summary -----


def test_the_summary_scales_its_unit_to_the_model():
    model = torchvision.models.resnet18(num_classes=10)
    plan = checkpoint_blocks(model, memory_budget=0.6, example_input=torch.randn(2, 3, 32, 32))
    assert plan.baseline_bytes is not None and plan.baseline_bytes < 10**9
    assert " kB" in plan.summary() and " GB" not in plan.summary()  # not "0.001 GB"
    big = CheckpointPlan(["a"], 1, [["a"]], baseline_bytes=12 * 10**9, budget_bytes=6 * 10**9, measured_bytes=5 * 10**9)
    assert big.summary().endswith("budget 6.000 GB of baseline 12.000 GB, measured 5.000 GB")


def test_a_budget_that_cannot_be_met_says_the_floor_reached_and_what_would_go_lower():
    model = torchvision.models.resnet18(num_classes=10)
    with pytest.warns(UserWarning, match="memory budget not met; the plan: .* the floor reached is"):
        plan = checkpoint_blocks(model, memory_budget=0.05, example_input=torch.randn(2, 3, 32, 32))
    assert plan.held is False
    summary = plan.summary()
    assert f"with {len(plan.blocks)} of {plan.candidates} blocks checkpointed" in summary
    assert "lower would take a smaller batch or rebuild_bn_relu=True" in summary
