"""Which models the library checkpoints, and whether they train exactly as before: one small model of every timm
architecture family and every Hugging Face architecture the installed transformers builds from a tiny config, on the
CPU. Run:

    python benchmarks/coverage.py                       # everything: benchmarks/results/coverage.json
    python benchmarks/coverage.py --fast                # the subset that `make test` runs (under a minute)
    python benchmarks/coverage.py --only timm --models resnet18,dla34 --out part.json
    python benchmarks/coverage.py --table               # the markdown table of docs/coverage.md, from the JSON

A timm family is a module of ``timm.models`` that registers models (``timm.list_modules()``); its model is the
module's ``test_`` model where it has one, else the one with the fewest parameters (every candidate is built on the
meta device and counted), built ``pretrained=False`` with 10 classes and stochastic depth 0.1 where the constructor
takes it, at 64 px (``img_size=64`` where the constructor takes it) or else the size its pretrained config names, batch
2. A Hugging Face architecture is a ``model_type`` of transformers' auto mappings; its model is the base model (or
the first task model where the type has none), from its config class with every size shrunk (2 layers, hidden 64, 4
heads, intermediate 64, at most 4 experts; nested text, vision and audio configs too), fed what its ``forward`` takes
(``input_ids``, ``pixel_values``, ``input_features``, ``input_values``, ``decoder_input_ids``: all of them, else the
text alone, else the rest alone), ``config.use_cache = False``. A model that cannot be built or fed in
``--seconds`` says why.

Per model (a row): ``blocks`` (``find_units(model)``), ``checkpointed`` (``checkpoint_blocks(copy).blocks``, every
block), ``same_gradients`` / ``same_buffers`` (one forward and backward in train mode on the same input, the same
seed before each, every parameter's gradient and every buffer compared bit for bit with the plain model's, and the
largest absolute and relative difference where they differ), ``same_state_dict_keys``, ``switch`` (the family can
checkpoint itself: timm's ``set_grad_checkpointing(True)`` runs and lowers the bytes kept; Hugging Face's
``supports_gradient_checkpointing`` and its switch runs with ``use_reentrant=False``:
``activation_checkpointing_enable``, or ``gradient_checkpointing_enable`` in a transformers without it), and
``kept_bytes`` for ``plain``, ``ours`` and ``switch``: the bytes of every tensor made during the forward that is still
alive when it returns, each storage once, parameters and buffers left out (what backward keeps: unlike counting saved
tensors, this also sees the inputs a non-reentrant checkpoint holds for its recomputation).
``ratio_vs_switch`` is ours over the switch's. A Hugging Face row has ``loss`` too: ``fused`` where
``apply_fused_loss`` on the type's language-model task model (causal, masked, sequence-to-sequence or speech; the same
tiny config, labels = its token inputs with the first two ignored, chunks of 5 tokens) returns no logits and the loss
and every gradient of the plain model within 1e-5 + 1e-4 relative, else why not (a family refused by name, no such
head, or the difference). A row is ``covered`` when blocks are found and checkpointed, gradients,
buffers and keys are the same, and ours keeps fewer bytes than the plain model; otherwise ``reason`` says why.

Results are written after every model (a run cut short keeps its rows), with a summary: how many models are covered,
and every one that is not, with its reason.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import inspect
import os
import platform
import random
import re
import signal
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import environment, hugging_face_switch, write_json  # noqa: E402

from lightning_memguard.checkpointing import checkpoint_blocks  # noqa: E402
from lightning_memguard.checkpointing.families import find_units  # noqa: E402
from lightning_memguard.levers.huggingface_loss import FAMILIES, apply_fused_loss, config_refusal  # noqa: E402

MORE_THAN_SWITCH = 1.05  # ours over the switch's bytes kept: above this, listed
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "coverage.json")
FAST = (  # one of each kind: (library, model)
    ("timm", "test_resnet"),  # a ResNet
    ("timm", "test_vit"),  # a ViT
    ("timm", "test_efficientnet"),  # an EfficientNet
    ("timm", "regnetx_002"),  # a RegNet (blocks declared by timm's group_matcher)
    ("timm", "hrnet_w18_small"),  # blocks that take and return lists
    ("timm", "dla46_c"),  # a tree
    ("hf", "gpt2"),
    ("hf", "t5"),
)
IMAGE = 64  # pixels, where the model takes it
BATCH = 2
TOKENS = 16
CLASSES = 10
SECONDS = 60.0  # per model, building and all three passes
LARGE = 50_000_000  # parameters: a timm model above this is built with 2 blocks where its constructor takes `depth`;
# a Hugging Face model whose tiny config fails is built with its own widths (only its layers cut) up to this


class TimedOut(Exception):
    """A model took longer than its share of time."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`TimedOut` after ``seconds`` (where the platform has ``SIGALRM``; elsewhere no limit)."""
    if not hasattr(signal, "SIGALRM") or seconds <= 0:
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise TimedOut(f"took longer than {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class KeptBytes(TorchDispatchMode):
    """Remembers every storage an operation makes; :meth:`kept` counts those still alive (each once)."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[StorageWeakRef, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                self.made.append((StorageWeakRef(storage), storage.nbytes()))
        return out

    def kept(self, model: nn.Module, loss: torch.Tensor) -> int:
        """Bytes alive now that an operation made, but the model's parameters and buffers and the loss."""
        held = {StorageWeakRef(t.untyped_storage()).cdata for t in [*model.parameters(), *model.buffers(), loss]}
        alive = {ref.cdata: size for ref, size in self.made if not ref.expired() and ref.cdata not in held}
        return sum(alive.values())


def loss_of(output: Any) -> torch.Tensor:
    """A scalar from everything the model returns that has a gradient: the sum of each such tensor's mean."""
    if isinstance(output, dict):  # a Hugging Face ModelOutput is one
        output = list(output.values())
    leaves = [
        t
        for t in tree_leaves(output)
        if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point() and t.numel()
    ]
    if not leaves:
        raise RuntimeError("the model returned no tensor with a gradient")
    return sum((t.float().mean() for t in leaves), torch.zeros(()))


def call(model: nn.Module, inputs: dict[str, Any]) -> Any:
    """The model on its inputs: one tensor positionally (timm), keywords otherwise (Hugging Face)."""
    if set(inputs) == {"x"}:
        return model(inputs["x"])
    return model(**inputs)


def step(model: nn.Module, inputs: dict[str, Any], seed: int = 0) -> int:
    """One forward and backward in train mode from ``seed``; the bytes the forward kept for backward."""
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    random.seed(seed)
    numpy.random.seed(seed)  # some models mask their inputs with NumPy's generator (wav2vec2's SpecAugment)
    meter = KeptBytes()
    with meter:
        loss = loss_of(call(model, inputs))
    kept = meter.kept(model, loss)
    del meter
    loss.backward()
    return kept


def differences(a: dict[str, torch.Tensor | None], b: dict[str, torch.Tensor | None]) -> dict[str, Any]:
    """Whether two sets of named tensors are bit-identical; else the largest absolute and relative differences and
    the first name that differs."""
    worst_abs, worst_rel, first = 0.0, 0.0, None
    for name in a:
        x, y = a[name], b.get(name)
        if x is None or y is None:
            if (x is None) != (y is None):
                first = first or name
                worst_abs = worst_rel = float("inf")
            continue
        if x.shape != y.shape:
            first, worst_abs, worst_rel = first or name, float("inf"), float("inf")
            continue
        if torch.equal(x, y):
            continue
        first = first or name
        if not x.is_floating_point():
            worst_abs = max(worst_abs, float((x.double() - y.double()).abs().max()))
            continue
        diff = (x.double() - y.double()).abs()
        worst_abs = max(worst_abs, float(diff.max()))
        worst_rel = max(worst_rel, float((diff / x.double().abs().clamp_min(1e-12)).max()))
    same = first is None and set(a) == set(b)
    return {"same": same, "max_abs": worst_abs, "max_rel": worst_rel, "first": first}


def gradients(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}


def buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in model.named_buffers()}


# ---- timm ------------------------------------------------------------------------------------------------------


def timm_parameters(name: str) -> int | None:
    """The model's parameter count, built on the meta device (None where it cannot be)."""
    import timm

    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = timm.create_model(name, pretrained=False)
        return sum(p.numel() for p in model.parameters())
    except Exception:
        return None


def timm_choices() -> dict[str, str]:
    """One model per module of ``timm.models`` that registers models: its ``test_`` model, else its smallest."""
    import timm

    chosen = {}
    for module in timm.list_modules():
        names = timm.list_models(module=module)
        tests = [n for n in names if n.startswith("test_")]
        if tests:
            chosen[module] = tests[0]
            continue
        counted = [(count, name) for name in names if (count := timm_parameters(name)) is not None]
        chosen[module] = min(counted)[1] if counted else names[0]
    return chosen


def timm_module(name: str) -> str:
    import timm

    return next((m for m in timm.list_modules() if name in timm.list_models(module=m)), "?")


def build_timm(name: str) -> tuple[nn.Module, dict[str, Any]]:
    """The model (seed 0), and an input at 64 px where it runs there, else at its pretrained config's size."""
    import timm

    cfg = timm.get_pretrained_cfg(name)
    native = tuple(cfg.input_size) if cfg is not None and cfg.input_size else (3, 224, 224)
    attempts: list[tuple[dict[str, Any], tuple[int, ...]]] = [
        ({"img_size": IMAGE}, (native[0], IMAGE, IMAGE)),
        ({}, (native[0], IMAGE, IMAGE)),
        ({}, native),
    ]
    count = timm_parameters(name)
    shallow = {"depth": 2} if count is not None and count > LARGE else {}  # a large ViT-like model: 2 blocks
    error: Exception | None = None
    for size_kwargs, shape in attempts:
        for extra in ({"drop_path_rate": 0.1, **shallow}, {"drop_path_rate": 0.1}, shallow, {}):
            torch.manual_seed(0)
            try:
                model = timm.create_model(name, pretrained=False, num_classes=CLASSES, **size_kwargs, **extra)
            except TypeError as e:  # the constructor takes no such argument
                error = e
                continue
            x = torch.randn(BATCH, *shape, generator=torch.Generator().manual_seed(1))
            try:
                with torch.no_grad():
                    model.eval()(x)
            except Exception as e:
                error = e
                break  # this size does not run; the next
            return model.train(), {"x": x}
    raise RuntimeError(f"could not build or feed: {first_line(error)}")


def timm_switch(model: nn.Module) -> None:
    model.set_grad_checkpointing(True)  # type: ignore[operator]


# ---- Hugging Face ----------------------------------------------------------------------------------------------

LAYERS = {
    "num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers", "decoder_layers",
    "num_decoder_layers", "num_encoder_layers", "num_text_layers", "num_vision_layers", "depth",
    "num_hidden_groups", "text_layers", "vision_layers",
}  # fmt: skip
HIDDEN = {"hidden_size", "d_model", "n_embd", "embed_dim", "dim", "hidden_dim", "projection_dim", "word_embed_proj_dim"}
HEADS = {"num_attention_heads", "n_head", "encoder_attention_heads", "decoder_attention_heads", "num_heads", "n_heads"}
INTERMEDIATE = {
    "intermediate_size", "d_ff", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "n_inner", "moe_intermediate_size",
    "shared_expert_intermediate_size", "mlp_dim", "hidden_dim_ffn",
}  # fmt: skip
EXPERTS = {"num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"}
TEXT = ("input_ids",)
OTHER = ("pixel_values", "input_features", "input_values")
PREFERRED_TASKS = (
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
)  # fmt: skip


def hf_choices() -> dict[str, str]:
    """``model_type``: the model class to build, the base model where the type has one, else a task model."""
    from transformers.models.auto import modeling_auto as auto

    chosen = {t: c if isinstance(c, str) else c[0] for t, c in auto.MODEL_MAPPING_NAMES.items()}
    tasks = sorted(n for n in dir(auto) if n.startswith("MODEL_FOR_") and n.endswith("_MAPPING_NAMES"))
    for mapping in (*PREFERRED_TASKS, *tasks):
        for model_type, names in getattr(auto, mapping, {}).items():
            chosen.setdefault(model_type, names if isinstance(names, str) else names[0])
    return dict(sorted(chosen.items()))


def shrink(values: dict[str, Any], widths: bool = True) -> dict[str, Any]:
    """A config's values with every size small (``widths=False``: only the number of layers, stages and experts);
    nested configs (dicts) shrunk the same way."""
    out = dict(values)
    heads = None
    for key, value in values.items():
        if key == "per_layer_config" and isinstance(value, dict):  # by layer index: the layers left
            out[key] = {k: v for k, v in value.items() if str(k).isdigit() and int(k) < 2}
        elif isinstance(value, dict) and ("model_type" in value or key.endswith("_config")):
            out[key] = shrink(value, widths)
        elif isinstance(value, bool) or not isinstance(value, int | list | tuple):
            continue
        elif key in LAYERS and isinstance(value, int):
            out[key] = min(value, 2)
        elif key in EXPERTS and isinstance(value, int):
            out[key] = min(value, 4)
        elif key in ("num_experts_per_tok", "top_k", "moe_topk") and isinstance(value, int):
            out[key] = min(value, 2)
        elif key in ("depths", "num_layers_per_block") and isinstance(value, list | tuple):
            out[key] = [min(int(v), 1) for v in value]
        elif key in ("out_features", "out_indices", "stage_names"):
            out.pop(key)  # a backbone's stages: its defaults, for the stages left
        elif not widths:
            continue
        elif key in HIDDEN and isinstance(value, int):
            out[key] = min(value, 64)
        elif key in HEADS and isinstance(value, int):
            heads = out[key] = min(value, 4)
        elif key in HEADS and isinstance(value, list | tuple):  # per stage (Swin)
            out[key] = [min(int(v), 2) for v in value]
        elif key in ("hidden_sizes", "embed_dims") and isinstance(value, list | tuple):
            out[key] = [min(int(v), 32 * 2**i) for i, v in enumerate(value)]
        elif key in INTERMEDIATE and isinstance(value, int):
            out[key] = min(value, 64)
        elif key in ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim") and isinstance(value, int):
            out[key] = min(value, 16)
        elif key in ("kv_lora_rank", "q_lora_rank") and isinstance(value, int):
            out[key] = min(value, 32)
    layers = next((values[k] for k in LAYERS if isinstance(values.get(k), int) and values[k] > 2), None)
    for key, value in values.items():  # one entry per layer (layer types, per-layer limits): the first two
        if layers and key in out and isinstance(value, list | tuple) and len(value) == layers:
            out[key] = list(value[:2])
    if not widths:
        return out
    heads = heads or 4
    if isinstance(values.get("num_key_value_heads"), int):
        original = values.get("num_attention_heads") or values["num_key_value_heads"]
        out["num_key_value_heads"] = heads if values["num_key_value_heads"] >= original else min(2, heads)
    hidden = next((out[k] for k in HIDDEN if isinstance(out.get(k), int)), 64)
    head_dim = max(hidden // heads, 8)
    if isinstance(values.get("head_dim"), int):
        out["head_dim"] = head_dim
    if isinstance(values.get("rotary_dim"), int):  # GPT-J, CodeGen: rotary embedding on part of each head
        out["rotary_dim"] = min(values["rotary_dim"], head_dim)
    for key in ("rope_parameters", "rope_scaling"):  # multimodal rotary sections: they sum to half a head
        rope = values.get(key)
        if isinstance(rope, dict) and isinstance(rope.get("mrope_section"), list | tuple) and rope["mrope_section"]:
            sections, half = [int(v) for v in rope["mrope_section"]], head_dim // 2
            scaled = [v * half // max(sum(sections), 1) for v in sections]
            scaled[-1] += half - sum(scaled)
            out[key] = {**rope, "mrope_section": scaled}
    return out


def hf_config(model_type: str, widths: bool = True) -> Any:
    """The type's config with its sizes shrunk (:func:`shrink`), ``use_cache`` off."""
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    values = shrink(config_class().to_dict(), widths)
    for key in ("transformers_version", "architectures", "model_type", "_name_or_path"):
        values.pop(key, None)
    config = config_class(**values)
    config.use_cache = False
    return config


def hf_inputs(model: nn.Module, config: Any) -> dict[str, torch.Tensor]:
    """Every input the model's ``forward`` names that this benchmark can make."""
    names = set(inspect.signature(model.forward).parameters)
    gen = torch.Generator().manual_seed(1)
    text = getattr(config, "text_config", None) or config
    vision = getattr(config, "vision_config", None) or config
    audio = getattr(config, "audio_config", None) or config
    vocab = getattr(text, "vocab_size", None) or getattr(config, "vocab_size", None) or 100
    inputs: dict[str, torch.Tensor] = {}
    if "input_ids" in names:
        inputs["input_ids"] = torch.randint(3, max(4, min(int(vocab), 100)), (BATCH, TOKENS), generator=gen)
    if "decoder_input_ids" in names and getattr(config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = torch.randint(3, max(4, min(int(vocab), 100)), (BATCH, 8), generator=gen)
    if "pixel_values" in names:
        size = getattr(vision, "image_size", None) or IMAGE
        size = tuple(size) if isinstance(size, list | tuple) else (int(size), int(size))
        channels = getattr(vision, "num_channels", None) or 3
        inputs["pixel_values"] = torch.randn(BATCH, int(channels), *size[-2:], generator=gen)
    if "input_features" in names:
        bins = getattr(audio, "num_mel_bins", None) or getattr(audio, "feature_size", None) or 80
        positions = getattr(audio, "max_source_positions", None)
        frames = 2 * positions if positions else 64
        inputs["input_features"] = torch.randn(BATCH, int(bins), int(frames), generator=gen)
    if "input_values" in names:
        inputs["input_values"] = torch.randn(BATCH, 4000, generator=gen)
    return inputs


def build_hf(model_type: str) -> tuple[nn.Module, dict[str, Any]]:
    """The architecture's model from a tiny config (seed 0), and the inputs it runs on. Where the tiny config cannot
    be built or fed, one with only its layers cut to two, if that has at most ``LARGE`` parameters; the tiny
    config's error where neither runs."""
    error: Exception | None = None
    for widths in (True, False):
        try:
            return _build_hf(model_type, widths)
        except TimedOut:
            raise
        except Exception as e:
            error = error or e
    raise error  # type: ignore[misc]


def _build_hf(model_type: str, widths: bool) -> tuple[nn.Module, dict[str, Any]]:
    import transformers

    model_class = getattr(transformers, hf_choices()[model_type])
    try:
        config = hf_config(model_type, widths)
        if not widths:
            with torch.device("meta"):
                count = sum(p.numel() for p in model_class(config).parameters())
            if count > LARGE:
                raise RuntimeError(f"{count / 1e6:.0f}M parameters with its own widths")
        torch.manual_seed(0)
        model = model_class(config)
    except Exception as e:
        raise RuntimeError(f"could not build from a tiny config: {first_line(e)}") from e
    every = hf_inputs(model, config)
    if not every:
        raise RuntimeError(f"its forward takes none of {', '.join((*TEXT, *OTHER))}")
    text = {k: v for k, v in every.items() if k not in OTHER}
    other = {k: v for k, v in every.items() if k not in TEXT}
    error: Exception | None = None
    for inputs in (every, text, other):
        if not inputs:
            continue
        try:
            with torch.no_grad():
                call(model.eval(), inputs)
            return model.train(), inputs
        except Exception as e:
            error = error or e
    raise RuntimeError(f"could not feed {', '.join(every)}: {first_line(error)}")


LOSS_TASKS = (
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
)  # fmt: skip


def hf_loss_class(model_type: str) -> str | None:
    """The type's language-model task class (for a family of ``FAMILIES``, of its kind; else the first of
    :data:`LOSS_TASKS` that has one), or None."""
    from transformers.models.auto import modeling_auto as auto

    kinds = {"causal": LOSS_TASKS[:1], "masked": LOSS_TASKS[1:2], "seq2seq": LOSS_TASKS[2:]}
    for mapping in kinds.get(FAMILIES.get(model_type, ""), LOSS_TASKS):
        names = getattr(auto, mapping, {}).get(model_type)
        if names:
            return names if isinstance(names, str) else names[0]
    return None


def hf_loss(model_type: str) -> str:
    """``fused`` where the fused loss gives the type's task model the plain loss and gradients, else why not."""
    import transformers

    config = hf_config(model_type)
    name = hf_loss_class(model_type)
    refused = config_refusal(config, name)
    if refused is not None:
        return refused
    torch.manual_seed(0)
    model = getattr(transformers, name)(config).train()  # type: ignore[arg-type]
    inputs = hf_inputs(model, config)
    # an encoder-decoder's labels: its decoder inputs, given as well (how each family makes them from its labels is
    # tested in tests/levers/test_levers_huggingface_loss.py; a tiny T5Config has no decoder_start_token_id to make
    # them)
    labels = inputs.get("decoder_input_ids", inputs.get("input_ids"))
    if labels is None:
        return "check failed: no token inputs to use as labels"
    labels = labels.clone()
    labels[:, :2] = -100
    fused = apply_fused_loss(copy.deepcopy(model), chunk_tokens=5)
    results = []
    for candidate in (model, fused):
        torch.manual_seed(0)
        output = candidate(**inputs, labels=labels)
        output.loss.backward()
        results.append((output, {n: p.grad for n, p in candidate.named_parameters() if p.grad is not None}))
    (plain, plain_grads), (ours, our_grads) = results
    if ours.logits is not None:
        return "the fused model built its logits"
    if plain_grads.keys() != our_grads.keys():
        return "differs: not the same parameters have gradients"
    pairs = [("loss", plain.loss, ours.loss), *((n, g, our_grads[n]) for n, g in plain_grads.items())]
    for what, want, got in pairs:
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
            return f"differs: {what} by {(got - want).abs().max().item():.3g}"
    return "fused"


def hf_switch(model: nn.Module) -> None:
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise RuntimeError("supports_gradient_checkpointing is False")
    hugging_face_switch(model)


# ---- one row ---------------------------------------------------------------------------------------------------


def first_line(error: BaseException | None) -> str:
    if error is None:
        return "unknown error"
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    text = " ".join(lines[:2]) if lines and lines[0].endswith(":") else (lines[0] if lines else "")
    text = re.sub(r" at 0x[0-9a-fA-F]+", "", text)  # an object's address: the same text every run
    return f"{type(error).__name__}: {text}"[:300]


def examine(library: str, name: str, seconds: float = SECONDS) -> dict[str, Any]:
    """One model's row: blocks found, the same training as the plain model, and the bytes each version keeps."""
    row: dict[str, Any] = {"library": library, "model": name}
    began = time.perf_counter()
    try:
        with time_limit(seconds), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _examine(row, library, name)
    except Exception as e:
        row["error"] = first_line(e)
        if not isinstance(e, TimedOut | RuntimeError):
            row["traceback"] = traceback.format_exc(limit=-3)
    row["seconds"] = round(time.perf_counter() - began, 2)
    row["covered"] = covered(row)
    row["reason"] = reason(row)
    gc.collect()
    return row


def _examine(row: dict[str, Any], library: str, name: str) -> None:
    if library == "timm":
        row["family"] = timm_module(name)
        model, inputs = build_timm(name)
        switch_on: Callable[[nn.Module], None] = timm_switch
        row["input"] = list(inputs["x"].shape)
    else:
        row["family"] = name
        model, inputs = build_hf(name)
        row["class"] = type(model).__name__
        switch_on = hf_switch
        row["input"] = {k: list(v.shape) for k, v in inputs.items()}
    row["parameters"] = sum(p.numel() for p in model.parameters())
    ours, switched = copy.deepcopy(model), copy.deepcopy(model)
    keys = list(model.state_dict())
    try:
        row["blocks"] = len(find_units(copy.deepcopy(model)))
    except TimedOut:
        raise
    except Exception as e:
        row["blocks"] = None
        row["blocks_error"] = first_line(e)
    try:
        row["checkpointed"] = len(checkpoint_blocks(ours).blocks)
    except TimedOut:
        raise
    except Exception as e:
        row["checkpointed"] = None
        row["checkpoint_error"] = first_line(e)
    row["same_state_dict_keys"] = list(ours.state_dict()) == keys
    row["kept_bytes"] = {"plain": step(model, inputs)}
    try:
        row["kept_bytes"]["ours"] = step(ours, inputs)
        grads, bufs = differences(gradients(model), gradients(ours)), differences(buffers(model), buffers(ours))
        row["same_gradients"], row["same_buffers"] = grads["same"], bufs["same"]
        if not grads["same"]:
            row["gradient_difference"] = grads
        if not bufs["same"]:
            row["buffer_difference"] = bufs
    except TimedOut:
        raise
    except Exception as e:
        row["same_gradients"] = row["same_buffers"] = None
        row["train_error"] = first_line(e)
    try:
        switch_on(switched)
        row["kept_bytes"]["switch"] = step(switched, inputs)
        # a switch that keeps as much as the plain model checkpoints nothing (a Hugging Face model declaring
        # support whose layers are not GradientCheckpointingLayers): the family cannot checkpoint it itself
        row["switch"] = row["kept_bytes"]["switch"] < row["kept_bytes"]["plain"]
    except TimedOut:
        raise
    except Exception as e:
        row["switch"] = False
        row["switch_error"] = first_line(e)
    if library == "hf":
        try:
            row["loss"] = hf_loss(name)
        except TimedOut:
            raise
        except Exception as e:
            row["loss"] = f"check failed: {first_line(e)}"
    kept = row["kept_bytes"]
    if kept.get("ours") is not None and kept.get("switch"):
        row["ratio_vs_switch"] = round(kept["ours"] / kept["switch"], 4)


def covered(row: dict[str, Any]) -> bool:
    kept = row.get("kept_bytes", {})
    return bool(
        "error" not in row
        and row.get("blocks")
        and row.get("checkpointed")
        and row.get("same_gradients")
        and row.get("same_buffers")
        and row.get("same_state_dict_keys")
        and kept.get("ours") is not None
        and kept["ours"] < kept["plain"]
    )


def reason(row: dict[str, Any]) -> str | None:
    """Why a row is not covered, in a few words (None where it is)."""
    if row["covered"]:
        return None
    if "error" in row:
        return row["error"]
    if not row.get("blocks"):
        return f"no blocks found ({row['blocks_error']})" if "blocks_error" in row else "no blocks found"
    if not row.get("checkpointed"):
        return f"checkpointing failed: {row.get('checkpoint_error', 'no block checkpointed')}"
    if "train_error" in row:
        return f"training checkpointed failed: {row['train_error']}"
    parts = []
    for what in ("gradient", "buffer"):
        diff = row.get(f"{what}_difference")
        if diff:
            parts.append(f"{what}s differ (max abs {diff['max_abs']:.3g}, rel {diff['max_rel']:.3g}, {diff['first']})")
    if not row.get("same_state_dict_keys"):
        parts.append("state_dict keys changed")
    kept = row.get("kept_bytes", {})
    if kept.get("ours") is not None and kept["ours"] >= kept["plain"]:
        parts.append("no memory saved")
    return "; ".join(parts) or "not covered"


# ---- the run ---------------------------------------------------------------------------------------------------


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per library: how many models were built and fed, covered, have a switch of their own (and of those, how many
    are covered: the goal), every model not covered with its reason, and where ours keeps more than the switch."""
    out: dict[str, Any] = {}
    for library in ("timm", "hf"):
        mine = [r for r in rows if r["library"] == library]
        built = [r for r in mine if "error" not in r]
        switched = [r for r in built if r.get("switch")]
        out[library] = {
            "models": len(mine),
            "built": len(built),
            "covered": sum(r["covered"] for r in mine),
            "with_switch": len(switched),
            "with_switch_covered": sum(r["covered"] for r in switched),
            "with_switch_not_covered": {r["model"]: r["reason"] for r in switched if not r["covered"]},
            "keeps_more_than_switch": {
                r["model"]: r["ratio_vs_switch"] for r in built if (r.get("ratio_vs_switch") or 0) > MORE_THAN_SWITCH
            },
            "not_covered": {r["model"]: r["reason"] for r in mine if not r["covered"]},
        }
    return out


def selection(only: str | None, models: list[str] | None, fast: bool) -> list[tuple[str, str]]:
    """(library, model) pairs: the fast subset, the named models (a Hugging Face model type where transformers
    has one of that name and ``only`` allows it, else a timm model), or every family."""
    if fast:
        return [(lib, n) for lib, n in FAST if only in (None, lib) and (not models or n in models)]
    if models:
        types = hf_choices() if only != "timm" else {}
        return [("hf" if name in types or only == "hf" else "timm", name) for name in models]
    chosen = []
    if only in (None, "timm"):
        chosen += [("timm", n) for n in timm_choices().values()]
    if only in (None, "hf"):
        chosen += [("hf", t) for t in hf_choices()]
    return chosen


INTRO = """\
# Which models are checkpointed, and train exactly as before

[Back to the README](../README.md) · [measured](measured.md)

One small model of every timm architecture family (each module of `timm.models` that registers models: its `test_`
model, else its smallest) and of every Hugging Face architecture in transformers' auto mappings that builds from a
tiny config (2 layers, hidden 64, 4 heads) without downloads, each with every block checkpointed
(`checkpoint_blocks(model)`) and trained one step on the CPU beside the plain model, from the same seed, dropout and
stochastic depth on. A model is **covered** when blocks are found, every gradient and buffer is bit-identical to the
plain model's, the `state_dict` keys are unchanged, and it keeps fewer bytes for backward. "kept MB" is what the
forward leaves alive for backward (every tensor it made, parameters and buffers aside), plain / ours / the family's
own switch (timm's `set_grad_checkpointing(True)`, Hugging Face's `activation_checkpointing_enable`); "switch" says
whether the family has one that checkpoints something (it runs and keeps less than the plain model). The goal: every
model with a switch covered. A model that this benchmark could not build or feed says why; it is a limit of the
benchmark's generic configs and inputs, not of the library. `benchmarks/coverage.py` says how each figure is made;
the rows are in `benchmarks/results/coverage.json`; `python benchmarks/coverage.py --table` prints this page from
them. The Hugging Face table's "loss" column says whether `apply_fused_loss` ([levers](levers.md)) gives the
family's language-model task model the plain loss and gradients without building its logits ("fused"), or why not.
"""


def table(result: dict[str, Any]) -> str:
    """docs/coverage.md: what the table is, the command, machine and date, each library's counts, and one line per
    model, those not covered first."""

    def mb(n: int | None) -> str:
        return "-" if n is None else f"{n / 2**20:.2f}"

    env = result["environment"]
    versions = ", ".join(f"{k} {env[k]}" for k in ("torch", "timm", "transformers") if env.get(k))
    lines = [
        INTRO,
        f"Made by `{result['command']}` on {env.get('machine', 'the CPU')}, {versions}, {env['date']}.",
        *(f"Since then: {note}." for note in result.get("notes", [])),
        "",
    ]
    for library, title in (("timm", "timm"), ("hf", "Hugging Face transformers")):
        rows = [r for r in result["rows"] if r["library"] == library]
        if not rows:
            continue
        s = result["summary"][library]
        more = ", ".join(f"{m} ({ratio})" for m, ratio in s["keeps_more_than_switch"].items()) or "none"
        lines += [
            f"## {title}",
            "",
            f"{s['models']} models, {s['built']} built and fed; {s['covered']} covered. Of the {s['with_switch']} "
            f"with a switch of their own, {s['with_switch_covered']} covered. Ours keeps more than "
            f"{MORE_THAN_SWITCH}x the switch's bytes on: {more}.",
            "",
            "| family | model | switch | blocks | same gradients | same buffers | kept MB plain / ours / switch "
            "| ours / switch | covered, or why not |" + (" loss |" if library == "hf" else ""),
            "|---|---|---|---|---|---|---|---|---|" + ("---|" if library == "hf" else ""),
        ]
        for r in sorted(rows, key=lambda r: ("error" in r, r["covered"], r.get("family") or "", r["model"])):
            kept = r.get("kept_bytes", {})
            figures = " / ".join(mb(kept.get(k)) for k in ("plain", "ours", "switch")) if kept else ""
            status = "yes" if r["covered"] else (r["reason"] or "").replace("|", "/").replace("`", "'")
            lines.append(
                f"| {r.get('family', '')} | {r['model']} | {yes(r.get('switch'))} | {r.get('blocks', '')} "
                f"| {yes(r.get('same_gradients'))} | {yes(r.get('same_buffers'))} | {figures} "
                f"| {r.get('ratio_vs_switch', '')} | {status} |"
                + (f" {(r.get('loss') or '').replace('|', '/')} |" if library == "hf" else "")
            )
        lines.append("")
    return "\n".join(lines)


def yes(value: Any) -> str:
    return "" if value is None else ("yes" if value else "no")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=("timm", "hf"))
    parser.add_argument("--models", help="comma-separated names: timm models, Hugging Face model types")
    parser.add_argument("--fast", action="store_true", help="the subset that make test runs")
    parser.add_argument("--out", default=OUT)
    parser.add_argument("--seconds", type=float, default=SECONDS, help="the most one model may take")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: as torch chooses)")
    parser.add_argument("--table", action="store_true", help="print docs/coverage.md from --out and stop")
    args = parser.parse_args()
    if args.table:
        import json

        with open(args.out, encoding="utf-8") as f:
            print(table(json.load(f)), end="")
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    with contextlib.suppress(ImportError):
        import transformers

        transformers.logging.set_verbosity_error()
    chosen = selection(args.only, args.models.split(",") if args.models else None, args.fast)
    result: dict[str, Any] = {"environment": environment(), "command": " ".join(["python", *sys.argv]), "rows": []}
    result["environment"]["machine"] = f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPU cores"
    for i, (library, name) in enumerate(chosen):
        row = examine(library, name, args.seconds)
        result["rows"].append(row)
        result["summary"] = summarize(result["rows"])
        write_json(args.out, result)
        print(f"[{i + 1}/{len(chosen)}] {library} {name}: {'covered' if row['covered'] else row['reason']}", flush=True)


if __name__ == "__main__":
    main()
