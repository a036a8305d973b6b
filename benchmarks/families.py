"""Checkpointing timm and Hugging Face models against each family's own switch, on a real GPU. Run on a CUDA machine:

    python benchmarks/families.py --out benchmarks/results/families.json
    python benchmarks/families.py --models resnet50,convnext_tiny --out part1.json   # a part of it

timm resnet50, convnext_tiny, vit_small_patch16_224, efficientnet_b0, swin_tiny_patch4_window7_224, regnety_032 and
densenet121 (the last two have no adapter: their blocks are timm's declared ones) at batch 128, 224 px, channels_last
for the CNNs; Hugging Face GPT-2 small (``GPT2Config()``), a Llama-style decoder of about its size (hidden 768, 12
layers, 12 heads, intermediate 2048, vocabulary 32000), BERT-base (``BertConfig()``, 16 x 512 tokens, masked-LM loss on
15 % of them) and T5-small's shape (6 + 6 layers, both stacks), 16 x 1024 tokens, and Whisper-base's shape (an audio
encoder and a text decoder, 16 x 30 s of 80 mel bins, a 64-token transcript), all built from their configs (no
downloads). One process, a plain PyTorch loop: AdamW, bf16 autocast, random data on the device, 5 warm-up and 15 timed
steps, median step time by CUDA events. Memory is the activation peak: ``torch.cuda.max_memory_allocated()`` over the
timed steps minus what was allocated just before the first timed forward (the resting model, AdamW's state and the
batches). Rows, each on a fresh model from the same seed: ``plain``; ``family_switch`` (timm's
``set_grad_checkpointing(True)``; Hugging Face's ``activation_checkpointing_enable``, or
``gradient_checkpointing_enable`` in a transformers without it, with ``use_reentrant=False`` and ``config.use_cache =
False``: ``_common.hugging_face_switch``); ``ours_every_block`` (``checkpoint_blocks(model)``);
``fused_loss_every_block`` for the language and speech models (``apply_fused_loss`` on the Hugging Face model, then
every block checkpointed: the loss without the logits, see docs/levers.md; not one of the ``ours_`` rows the goals below
weigh against the switch) and
``fused_loss_every_block_no_sync`` (the same with ``counted_only=False``: every token through the head, no device
sync to count them: what that sync costs a whole step);
``ours_at_switch_memory`` (a budget of the switch's measured activation peak, as a fraction of the plain row's: the
issue's goal there is at most 0.85x the switch's step time on CNNs and 0.95x on transformers, within 2 % of its memory);
``ours_below_switch`` (a budget of 0.8x the switch's peak: below what whole blocks reach where a block's recomputation
sets the peak); each of the two also as ``..._blocks``, the planner with whole blocks only (no finer links:
:func:`whole_blocks_only`), in the same run; ``ours_budget_0.6`` and ``ours_budget_0.4`` (``checkpoint_blocks(model,
memory_budget=..., example_input=<a batch>)``); ``levers_at_switch_memory`` and ``levers_half_switch``: ``plan_levers``
on the Hugging Face model (the fused loss, then per block the cheapest of checkpointing it whole, its parts or
recomputing its pointwise chains) or on the vision model (no fused loss: no vocabulary), offload not offered, for a
budget of the switch's measured activation peak and of half of it, in bytes
(goals, :data:`LEVERS_GOAL`: at the switch's memory at most 0.90x its step time on vision models, 0.85x on language and
speech models, 0.80x on GPT-2; every block + the fused loss at most 0.30x the switch's memory at 1.05x its time,
:data:`FUSED_GOAL`); and ``family_switch_every_2`` (Hugging Face's switch on every second layer, ``every_n_layers=2``,
where the installed transformers has it: what its users have between nothing and every layer) and
``levers_at_every_2_memory`` (``plan_levers`` for that row's peak, judged against it, no goal set);
``levers_at_switch_memory_offload`` and ``levers_half_switch_offload`` (the same two budgets, offload offered:
``plan_levers(..., offload=True)``, whose ``ActivationOffload`` is entered around the row's steps; not among the
default rows: name them in ``--rows``); ``ours_rebuild``
(``rebuild_bn_relu(model)``) for timm resnet50; torchvision resnet50 (``tv_resnet50``: no switch of its own) runs plain,
ours and the rebuild, so that the two rebuilds are compared on the same basis (``rebuild_goal``).
A language model is wrapped (:class:`CausalLM`) so that every row calls ``wrapper(input_ids)`` and gets the loss.
Per model the issue's goals are checked (``goals``): at the family's own
switch point, ours saves at least as much for at most 2 % more step time: every block, and the fastest of our rows
that saves as much (``at_switch_point``). Every row is then timed again, all alive at once, a turn of a few steps
of each in turn for ``--rounds`` rounds (:func:`interleaved`), and keeps that median (``step_ms``; ``step_ms_alone``
is its own row's): on this card a slow stretch of the host moved separate passes by up to 35 %.

``--rows`` picks a part of the rows (those set by the switch's memory need ``plain`` and ``family_switch``).
Results are written after every row (a run cut short keeps what it measured); a row that fails is recorded with its
error and the others go on. ``--smoke`` runs a tiny version on the CPU (timm resnet18 and timm's test_ models at
32 px, batch 2; language models of 2 layers, hidden 64, 32 tokens; 1 + 2 steps): every row's code path, not a
measurement (there the activation figure is the bytes a step saves for backward).
Each row's memory is the peak of its timed steps above the resting model (``activation_peak_gb``: the model, AdamW's
state and the batches at rest; the peak holds the parameters' gradients and AdamW's step, which on BERT-base alone
need 0.88 GB, 0.30x its switch's figure) and, from one more untimed forward and backward with the gradients already
allocated and no optimizer step, the activations alone (``activation_only_gb``,
:func:`activation_only_peak`); the goals are judged on the first, the second is given beside it
(``activation_only_vs_switch``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import math
import os
import sys
import time
import traceback
from typing import Any, NamedTuple

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import (  # noqa: E402
    environment,
    free_memory,
    hugging_face_switch,
    median,
    partial_switch_exists,
    write_json,
)

from lightning_memguard.checkpointing import checkpoint_blocks, rebuild_bn_relu  # noqa: E402
from lightning_memguard.levers import apply_fused_loss, plan_levers  # noqa: E402

VISION = {  # name: (timm model, smoke timm model, channels_last)
    "resnet50": ("resnet50", "resnet18", True),
    "convnext_tiny": ("convnext_tiny", "test_convnext", True),
    "vit_small": ("vit_small_patch16_224", "test_vit", False),
    "efficientnet_b0": ("efficientnet_b0", "test_efficientnet", True),
    "tv_resnet50": ("resnet50", "resnet18", True),  # torchvision's: the rebuild's reference, on the same basis
    "swin_tiny": ("swin_tiny_patch4_window7_224", "swin_tiny_patch4_window7_224", False),
    "regnety_032": ("regnety_032", "regnetx_002", True),  # no adapter of its own: timm's declared blocks
    "densenet121": ("densenet121", "densenet121", True),  # blocks take a list that grows after them
}
VISION_SMOKE_KWARGS: dict[str, dict[str, Any]] = {  # a tiny version where a model has no small sibling
    "vit_small": {"img_size": 32},
    "swin_tiny": {"img_size": 32, "window_size": 2, "embed_dim": 24, "depths": (1, 1, 2, 1), "num_heads": (1, 1, 2, 2)},
    "densenet121": {"growth_rate": 4, "block_config": (1, 2, 2, 1)},
}
TORCHVISION = {"tv_resnet50"}  # no switch of their own: plain, ours and the rebuild
LANGUAGE = ("gpt2", "llama", "bert", "t5")  # called as wrapper(input_ids), the loss on those tokens
SPEECH = ("whisper",)  # called as wrapper(input_features), the loss on a fixed transcript
MODELS = (*VISION, *LANGUAGE, *SPEECH)
ROWS = (
    "plain", "family_switch", "family_switch_every_2", "ours_every_block", "fused_loss_every_block",
    "fused_loss_every_block_no_sync", "ours_at_switch_memory",
    "ours_at_switch_memory_blocks",
    "ours_below_switch", "ours_below_switch_blocks", "ours_budget_0.6", "ours_budget_0.6_blocks", "ours_budget_0.4",
    "levers_at_switch_memory", "levers_half_switch", "levers_at_every_2_memory", "ours_rebuild",
    "levers_at_switch_memory_offload", "levers_half_switch_offload",
)  # fmt: skip
OFFLOADING = ("levers_at_switch_memory_offload", "levers_half_switch_offload")  # plan_levers(offload=True)
DEFAULT_ROWS = tuple(r for r in ROWS if r not in OFFLOADING)  # offload's rows only where asked for: it is off by
# default in plan_levers, and its copies need the card's link
AT_SWITCH = {"ours_at_switch_memory": 1.0, "ours_at_switch_memory_blocks": 1.0, "ours_below_switch": 0.8,
             "ours_below_switch_blocks": 0.8, "levers_at_switch_memory": 1.0, "levers_half_switch": 0.5,
             "levers_at_every_2_memory": 1.0, "levers_at_switch_memory_offload": 1.0,
             "levers_half_switch_offload": 0.5}  # rows set by a switch's peak (SWITCH_OF): this much  # fmt: skip
LEVERS = ("levers_at_switch_memory", "levers_half_switch", "levers_at_every_2_memory",
          *OFFLOADING)  # plan_levers: every lever  # fmt: skip
PARTIAL = ("family_switch_every_2",)  # Hugging Face's switch on every second layer (transformers' every_n_layers=2)
SWITCH_OF = {"levers_at_every_2_memory": "family_switch_every_2"}  # the switch row a budget row is set by
REBUILT = {"resnet50", "tv_resnet50"}  # the ResNet families: the rebuild applies
FUSED = {*LANGUAGE, *SPEECH}  # a vocabulary's logits: the fused loss applies
FUSED_ROWS = ("fused_loss_every_block", "fused_loss_every_block_no_sync")
LEVERS_GOAL = {
    "vision": 0.90,
    "language": 0.85,
    "gpt2": 0.80,
}  # levers at the switch's memory: at most this of its time
FUSED_GOAL = {"memory": 0.30, "time": 1.05}  # every block + the fused loss against the switch: at most these
TIME_SLACK = 0.02  # the goal: ours at most 2 % slower than the family's switch
SAVED_SLACK = 0.1  # points of saving: "as much" to within the allocator's rounding (a few MB of several GB)
STEPS_PER_TURN = 4  # interleaved: each row's turn is this many steps, the first untimed (the switch from another)
TRANSFORMERS = {"vit_small", "swin_tiny"}  # vision models judged as transformers
AT_SWITCH_GOAL = {"cnn": 0.85, "transformer": 0.95}  # ours at the switch's memory: at most this of its step time


class Setting(NamedTuple):
    """Where and at what size: the H200 run, or the CPU smoke run."""

    smoke: bool
    device: torch.device
    image: int
    vision_batch: int
    tokens: int
    text_batch: int
    warmup: int
    steps: int

    @classmethod
    def make(cls, smoke: bool) -> Setting:
        if smoke:
            return cls(True, torch.device("cpu"), image=32, vision_batch=2, tokens=32, text_batch=2, warmup=1, steps=2)
        return cls(
            False, torch.device("cuda"), image=224, vision_batch=128, tokens=1024, text_batch=16, warmup=5, steps=15
        )

    def autocast(self) -> Any:
        return torch.autocast(self.device.type, dtype=torch.bfloat16)


class CausalLM(nn.Module):
    """A Hugging Face language model called as ``wrapper(input_ids)``, returning its loss on those tokens: the same
    call for every row, and a scalar for the planner's backward. ``masked``: a masked language model's objective,
    3 of every 20 positions counted (the 15 % of Hugging Face's ``DataCollatorForLanguageModeling``), the others
    labelled -100; else every token counted."""

    def __init__(self, model: nn.Module, masked: bool = False) -> None:
        super().__init__()
        self.model = model
        self.masked = masked

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(**self.inputs(input_ids)).loss  # type: ignore[no-any-return]

    def inputs(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """The Hugging Face model's keywords: the tokens and their labels."""
        if not self.masked:
            return {"input_ids": input_ids, "labels": input_ids}
        counted = torch.arange(input_ids.shape[-1], device=input_ids.device) % 20 < 3
        return {"input_ids": input_ids, "labels": torch.where(counted, input_ids, -100)}


class SpeechSeq2Seq(nn.Module):
    """A Hugging Face speech-to-text model called as ``wrapper(input_features)``, returning its loss on a fixed
    transcript (the same for every row)."""

    def __init__(self, model: nn.Module, tokens: int = 64) -> None:
        super().__init__()
        self.model = model
        self.tokens = tokens

    def forward(self, input_features: torch.Tensor) -> torch.Tensor:
        return self.model(**self.inputs(input_features)).loss  # type: ignore[no-any-return]

    def inputs(self, input_features: torch.Tensor) -> dict[str, torch.Tensor]:
        """The Hugging Face model's keywords: the features and the fixed transcript."""
        vocab = self.model.config.vocab_size  # type: ignore[union-attr]
        labels = (torch.arange(self.tokens, device=input_features.device) * 7 % vocab).expand(len(input_features), -1)
        return {"input_features": input_features, "labels": labels}


def make_model(name: str, setting: Setting) -> nn.Module:
    """A fresh model (seed 0), on the device, channels_last for the CNNs."""
    torch.manual_seed(0)
    if name in VISION:
        import timm

        full, small, channels_last = VISION[name]
        if name in TORCHVISION:
            import torchvision

            model = torchvision.models.get_model(small if setting.smoke else full, weights=None, num_classes=1000)
        else:
            kwargs = VISION_SMOKE_KWARGS.get(name, {}) if setting.smoke else {}
            model = timm.create_model(small if setting.smoke else full, pretrained=False, num_classes=1000, **kwargs)
        model = model.to(setting.device)
        return model.to(memory_format=torch.channels_last) if channels_last else model
    import transformers

    tiny: dict[str, Any] = {"n_layer": 2, "n_embd": 64, "n_head": 4, "n_positions": setting.tokens, "vocab_size": 1000}
    tiny.update(bos_token_id=0, eos_token_id=0)  # inside the small vocabulary
    if name == "gpt2":
        config: Any = transformers.GPT2Config(**tiny) if setting.smoke else transformers.GPT2Config()
        lm: nn.Module = transformers.GPT2LMHeadModel(config)
    elif name == "bert":  # BERT-base, masked-language-model loss on 15 % of the tokens
        size = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}
        config = (
            transformers.BertConfig(vocab_size=1000, max_position_embeddings=max(setting.tokens, 512), **size)
            if (setting.smoke)
            else transformers.BertConfig(max_position_embeddings=max(setting.tokens, 512))
        )
        lm = transformers.BertForMaskedLM(config)
    elif name == "t5":  # T5-small's shape: 6 + 6 layers, both stacks checkpointed
        size = (
            {"d_model": 64, "d_kv": 16, "d_ff": 128, "num_layers": 2, "num_heads": 4, "vocab_size": 1000}
            if (setting.smoke)
            else {"d_model": 512, "d_kv": 64, "d_ff": 2048, "num_layers": 6, "num_heads": 8, "vocab_size": 32128}
        )
        lm = transformers.T5ForConditionalGeneration(transformers.T5Config(decoder_start_token_id=0, **size))
    elif name == "whisper":  # Whisper-base's shape: an audio encoder and a text decoder
        size = {"d_model": 64, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
                "decoder_attention_heads": 4, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "vocab_size": 1000,
                "max_source_positions": 50, "num_mel_bins": 16} if setting.smoke else {
                "d_model": 512, "encoder_layers": 6, "decoder_layers": 6, "encoder_attention_heads": 8,
                "decoder_attention_heads": 8, "encoder_ffn_dim": 2048, "decoder_ffn_dim": 2048}  # fmt: skip
        config = transformers.WhisperConfig(decoder_start_token_id=0, pad_token_id=0, **size)
        return SpeechSeq2Seq(transformers.WhisperForConditionalGeneration(config)).to(setting.device)
    else:
        size: dict[str, Any] = (
            {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}
            if setting.smoke
            else {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 2048}
        )
        vocab = 1000 if setting.smoke else 32000
        config = transformers.LlamaConfig(vocab_size=vocab, max_position_embeddings=max(setting.tokens, 2048), **size)
        lm = transformers.LlamaForCausalLM(config)
    return CausalLM(lm, masked=name == "bert").to(setting.device)


def make_batches(name: str, setting: Setting, count: int = 4) -> list[tuple[torch.Tensor, ...]]:
    """Random data on the device: (images, labels) for a vision model, (input_ids,) for a language model."""
    gen = torch.Generator(device=setting.device).manual_seed(0)
    if name in VISION:
        fmt = torch.channels_last if VISION[name][2] else torch.contiguous_format
        shape = (setting.vision_batch, 3, setting.image, setting.image)
        return [
            (
                torch.randn(shape, device=setting.device, generator=gen).contiguous(memory_format=fmt),
                torch.randint(0, 1000, (setting.vision_batch,), device=setting.device, generator=gen),
            )
            for _ in range(count)
        ]
    if name in SPEECH:  # 30 s of 80 mel bins (Whisper's input), or the smoke run's small one
        shape = (2, 16, 100) if setting.smoke else (setting.text_batch, 80, 3000)
        return [(torch.randn(shape, device=setting.device, generator=gen),) for _ in range(count)]
    vocab = 1000 if setting.smoke else {"gpt2": 50257, "bert": 30522, "t5": 32128}.get(name, 32000)
    tokens = (setting.text_batch, setting.tokens if name != "bert" else min(setting.tokens, 512))
    return [(torch.randint(0, vocab, tokens, device=setting.device, generator=gen),) for _ in range(count)]


def loss_of(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    if len(batch) == 2:
        return nn.functional.cross_entropy(model(batch[0]), batch[1])
    return model(batch[0])  # type: ignore[no-any-return]


def apply(
    name: str, row: str, model: nn.Module, example: torch.Tensor, setting: Setting, at_switch: float | None = None
) -> dict[str, Any]:
    """Change ``model`` as ``row`` says; what was done (and for a budget, what the plan found). ``at_switch``: for
    ``ours_at_switch_memory``, the switch's measured peak as a fraction of the plain model's."""
    if row == "plain":
        return {}
    if row == "family_switch":
        if name in VISION:
            model.set_grad_checkpointing(True)  # type: ignore[operator]
        else:
            hugging_face_switch(model.model)
        return {}
    if row in PARTIAL:
        hugging_face_switch(model.model, every_n_layers=2)
        return {}
    if row == "ours_every_block":
        plan = checkpoint_blocks(model)
        return {"blocks": len(plan.blocks), "candidates": plan.candidates}
    if row in FUSED_ROWS:  # the Hugging Face model inside the wrapper: its own forward, no logits
        apply_fused_loss(model.model, counted_only=row == "fused_loss_every_block")  # type: ignore[arg-type]
        plan = checkpoint_blocks(model)
        return {"blocks": len(plan.blocks), "candidates": plan.candidates, "fused_loss": True}
    if row == "ours_rebuild":
        return {"rebuilt_units": rebuild_bn_relu(model)}
    if row in LEVERS:
        assert at_switch is not None
        return apply_levers(model, example, setting, at_switch, offload=row in OFFLOADING)
    budget = float(row.removesuffix("_blocks").rsplit("_", 1)[1]) if at_switch is None else at_switch
    with setting.autocast(), whole_blocks_only() if row.endswith("_blocks") else contextlib.nullcontext():
        plan = checkpoint_blocks(model, memory_budget=budget, example_input=example)
    return {
        "blocks": len(plan.blocks),
        "candidates": plan.candidates,
        "parts": plan.parts,
        "runs": plan.runs,
        "held": plan.held,
        **figures(plan),
        "lower": plan.lower,
    }


def figures(plan: Any) -> dict[str, Any]:
    """A plan's summary and its memory figures in GB: a checkpoint plan's or the levers' plan's."""
    return {
        "summary": plan.summary(),
        "budget_gb": _gb(plan.budget_bytes),
        "baseline_gb": _gb(plan.baseline_bytes),
        "predicted_gb": _gb(plan.predicted_bytes),
        "measured_gb": _gb(plan.measured_bytes),
    }


def apply_levers(
    model: nn.Module, example: torch.Tensor, setting: Setting, budget: float, offload: bool = False
) -> dict[str, Any]:
    """``plan_levers`` on the Hugging Face model inside the wrapper (the fused loss needs it), called with its
    labels as the wrapper calls it, or on the vision model with its images, for ``budget`` (bytes of activations);
    ``offload`` offered or not. Where the plan offloads, its ``ActivationOffload`` is kept on the model
    (:func:`step_context`) and entered around every training step this script times."""
    if isinstance(model, (CausalLM, SpeechSeq2Seq)):
        lm: nn.Module = model.model  # type: ignore[assignment]
        inputs = model.inputs(example)
    else:  # a vision model: no vocabulary head, so no fused loss; its images, the sum of its logits as the loss
        lm, inputs = model, example
    with setting.autocast():
        plan = plan_levers(lm, inputs, memory_budget=budget, offload=offload)
    if plan.offload is not None:
        model.memguard_bench_offload = plan.offload  # type: ignore[assignment]
    return {
        "fused_loss": plan.loss,
        "kinds": plan.kinds(),
        "calls": plan.calls(),
        "held": plan.held,
        **figures(plan),
        "extra_ms": plan.extra_ms,
        "host_gb": _gb(plan.host_bytes),
        "tried": [[what, _gb(peak)] for what, peak in plan.tried],  # every set measured, in order, and its peak
    }


@contextlib.contextmanager
def whole_blocks_only() -> Any:
    """The planner as it was before finer links: whole blocks only (the ``_blocks`` rows, beside the same budget
    with finer links, in the same run). It replaces the finder of parts the model's map is read with, for the call."""
    from lightning_memguard.checkpointing import model_map

    finder = model_map.link_parts
    model_map.link_parts = lambda links: []  # type: ignore[assignment]
    try:
        yield
    finally:
        model_map.link_parts = finder


def step_context(model: nn.Module) -> Any:
    """What a training step of ``model`` runs inside: the levers' offload where its plan chose one (entered around
    a row's steps, so that its host buffers are reused from step to step), else nothing."""
    offload = getattr(model, "memguard_bench_offload", None)
    return contextlib.nullcontext() if offload is None else offload


def _gb(n: int | None) -> float | None:
    return None if n is None else n / 1e9


def train_steps(model: nn.Module, batches: list, setting: Setting) -> dict[str, float | None]:
    """The plain loop: median step (CUDA events on the GPU) and the activation peak above the resting model."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model.train()
    cuda = setting.device.type == "cuda"
    held = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    saved: dict[int, int] = {}  # the CPU's figure: bytes saved for backward in one step

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in held:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    def hooks() -> Any:
        return contextlib.nullcontext() if cuda else torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    events, times, resting, cpu_peaks = [], [], 0, []
    with step_context(model):
        for i in range(setting.warmup + setting.steps):
            batch = batches[i % len(batches)]
            opt.zero_grad(set_to_none=True)
            if i == setting.warmup and cuda:
                torch.cuda.synchronize()
                resting = torch.cuda.memory_allocated()  # model, AdamW's state, the batches; no gradients
                torch.cuda.reset_peak_memory_stats()
            saved.clear()
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            else:
                began = time.perf_counter()
            with setting.autocast(), hooks():
                loss = loss_of(model, batch)
            loss.backward()
            opt.step()
            if cuda:
                end.record()
                if i >= setting.warmup:
                    events.append((start, end))
            elif i >= setting.warmup:
                times.append((time.perf_counter() - began) * 1e3)
                cpu_peaks.append(sum(saved.values()))
        if cuda:
            torch.cuda.synchronize()
            times = [s.elapsed_time(e) for s, e in events]
            peak, resting_gb = torch.cuda.max_memory_allocated() - resting, resting / 1e9
            activations = activation_only_peak(model, opt, batches[0], setting)
    if not cuda:
        peak, resting_gb = max(cpu_peaks), None
        activations = peak  # the bytes saved for backward: neither gradients nor the optimizer's step in them
    del opt
    return {
        "step_ms": median(times),
        "activation_peak_gb": peak / 1e9,
        "activation_only_gb": activations / 1e9,
        "resting_gb": resting_gb,
    }


def activation_only_peak(model: nn.Module, opt: torch.optim.Optimizer, batch: tuple, setting: Setting) -> int:
    """The peak of one more forward and backward (untimed) above what is allocated before it, the parameters'
    gradients already allocated (zeroed, not freed) and no optimizer step in it: the activations and what backward
    makes of them, without the gradients (``activation_peak_gb`` holds them, and AdamW's step, whose foreach update
    makes a temporary the size of the parameters: together twice the parameters' bytes, BERT-base's 0.88 GB)."""
    opt.zero_grad(set_to_none=False)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with setting.autocast():
        loss = loss_of(model, batch)
    loss.backward()
    peak = torch.cuda.max_memory_allocated() - before
    del loss
    opt.zero_grad(set_to_none=True)
    return peak


def rate(name: str, setting: Setting, step_ms: float) -> dict[str, float]:
    """Images per second for a vision model, tokens per second for a language model, at this step time."""
    if name in VISION:
        return {"samples_per_sec": setting.vision_batch / step_ms * 1e3}
    if name in SPEECH:
        return {"samples_per_sec": (2 if setting.smoke else setting.text_batch) / step_ms * 1e3}
    return {"tokens_per_sec": setting.text_batch * setting.tokens / step_ms * 1e3}


def measure(
    name: str, row: str, setting: Setting, at_switch: float | None = None, keep: dict[str, nn.Module] | None = None
) -> dict[str, Any]:
    """One row on a fresh model; an exception is recorded, not raised. ``keep``: the model, measured, is kept there
    under the row's name (for :func:`interleaved`)."""
    result: dict[str, Any] = {"model": name, "row": row}
    began = time.perf_counter()
    model: nn.Module | None = None
    batches: list = []
    try:
        model = make_model(name, setting)
        batches = make_batches(name, setting)
        result.update(apply(name, row, model, batches[0][0], setting, at_switch))
        result.update(train_steps(model, batches, setting))
        result.update(rate(name, setting, result["step_ms"]))
        if keep is not None:
            keep[row] = model
    except Exception as error:  # noqa: BLE001 - one row's failure (an OOM included) must not lose the others
        result["error"] = f"{type(error).__name__}: {error}"
        result["traceback"] = traceback.format_exc(limit=-6)
    finally:
        del model, batches
        gc.collect()
        free_memory()
    result["wall_s"] = time.perf_counter() - began  # building, planning and timing: to size a part of the run
    return result


def switch_budget(
    rows: dict[str, dict[str, Any]], row: str = "ours_at_switch_memory", smoke: bool = False
) -> float | None:
    """The budget of a row set by the switch (:data:`AT_SWITCH`): the family switch's measured activation peak, as a
    fraction of the plain model's, times the row's share of it, or for the levers' rows (:data:`LEVERS`) that share
    of the switch's peak in bytes, but for ``smoke`` (where the figure is the bytes a step saves, not a peak) (None
    where either was not measured, or for another row)."""
    plain, switch = rows.get("plain", {}), rows.get(SWITCH_OF.get(row, "family_switch"), {})
    if row not in AT_SWITCH or "activation_peak_gb" not in plain or "activation_peak_gb" not in switch:
        return None
    if (
        row in LEVERS and not smoke
    ):  # bytes: the Hugging Face model's own output holds its logits (the wrapper's frees them), which
        # the planner counts in its peak before any lever: a fraction of that peak is more than the switch's memory
        return int(AT_SWITCH[row] * switch["activation_peak_gb"] * 1e9)
    return min(1.0, AT_SWITCH[row] * switch["activation_peak_gb"] / plain["activation_peak_gb"])


def compare(rows: dict[str, dict[str, Any]]) -> None:
    """Each row's saving and time cost against plain, in place."""
    plain = rows.get("plain", {})
    if "step_ms" not in plain:
        return
    for row in rows.values():
        if "step_ms" in row and row is not plain:
            row["saved_pct"] = 100 * (1 - row["activation_peak_gb"] / plain["activation_peak_gb"])
            row["time_cost_pct"] = 100 * (row["step_ms"] / plain["step_ms"] - 1)


def goals(name: str, rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's goals on this model's rows: at the family's own switch point, ours saves at least as much (to
    within ``SAVED_SLACK`` points) for at most 2 % more step time, judged for every block and for the fastest of our
    rows that saves as much (``at_switch_point``: a budget may get there for less); every budget held or said (its
    summary says it was not met)."""
    out: dict[str, Any] = {}
    switch = rows.get("family_switch", {})
    floor = switch.get("saved_pct", math.inf) - SAVED_SLACK  # no switch measured: none of ours saves "as much"
    as_much = {r: row for r, row in rows.items() if r.startswith("ours_") and row.get("saved_pct", -math.inf) >= floor}
    ours = rows.get("ours_every_block", {})
    if "saved_pct" in ours and "saved_pct" in switch:
        out["saved_points_vs_switch"] = ours["saved_pct"] - switch["saved_pct"]
        out["step_time_vs_switch_pct"] = 100 * (ours["step_ms"] / switch["step_ms"] - 1)
        out["saves_at_least_as_much"] = "ours_every_block" in as_much
        out["within_2pct_step_time"] = ours["step_ms"] <= switch["step_ms"] * (1 + TIME_SLACK)
        out["met"] = out["saves_at_least_as_much"] and out["within_2pct_step_time"]
        if name == "convnext_tiny":
            out["within_2_points_of_switch_saving"] = out["saved_points_vs_switch"] >= -2
    if as_much:
        fastest = min(as_much, key=lambda r: as_much[r]["step_ms"])
        out["at_switch_point"] = {
            "row": fastest,
            "saved_points_vs_switch": as_much[fastest]["saved_pct"] - switch["saved_pct"],
            "step_time_vs_switch_pct": 100 * (as_much[fastest]["step_ms"] / switch["step_ms"] - 1),
            "met": as_much[fastest]["step_ms"] <= switch["step_ms"] * (1 + TIME_SLACK),
        }
    for key in ("ours_at_switch_memory", "ours_at_switch_memory_blocks"):
        at = rows.get(key, {})
        if "step_ms" in at and "step_ms" in switch:
            goal = AT_SWITCH_GOAL["cnn" if name in VISION and name not in TRANSFORMERS else "transformer"]
            memory = at["activation_peak_gb"] / switch["activation_peak_gb"]
            out[key.removeprefix("ours_")] = {
                "memory_vs_switch": memory,
                "step_time_vs_switch": at["step_ms"] / switch["step_ms"],
                "goal": goal,
                "met": memory <= 1 + TIME_SLACK and at["step_ms"] <= goal * switch["step_ms"],
            }
    for key in ("ours_below_switch", "ours_below_switch_blocks"):
        below = rows.get(key, {})
        if "activation_peak_gb" in below and "activation_peak_gb" in switch:
            out[key.removeprefix("ours_")] = {
                "memory_vs_switch": below["activation_peak_gb"] / switch["activation_peak_gb"],
                "held": below.get("held"),
                "parts": len(below.get("parts", [])),
            }
    for key in LEVERS:  # every lever, planned: at the switch's memory, at half of it, at the partial switch's
        levers = rows.get(key, {})
        against = rows.get(SWITCH_OF.get(key, "family_switch"), {})  # the switch whose memory set the budget
        if "step_ms" in levers and "step_ms" in against:
            memory, time_ratio = (
                levers["activation_peak_gb"] / against["activation_peak_gb"],
                levers["step_ms"] / against["step_ms"],
            )
            out[key] = {
                "memory_vs_switch": memory,
                "step_time_vs_switch": time_ratio,
                "held": levers.get("held"),
                "kinds": sorted(levers.get("kinds", {})),
            }
            if (only := _activations_vs_switch(levers, against)) is not None:
                out[key]["activation_only_vs_switch"] = only
            if AT_SWITCH[key] == 1.0 and key not in SWITCH_OF:  # the goal: the switch's memory, less time
                goal = LEVERS_GOAL.get(name, LEVERS_GOAL["vision" if name in VISION else "language"])
                out[key].update(goal=goal, met=memory <= 1 + TIME_SLACK and time_ratio <= goal)
    fused = rows.get("fused_loss_every_block", {})
    if "step_ms" in fused and "step_ms" in switch:
        memory, time_ratio = (
            fused["activation_peak_gb"] / switch["activation_peak_gb"],
            fused["step_ms"] / switch["step_ms"],
        )
        out["fused_loss_every_block"] = {
            "memory_vs_switch": memory,
            "step_time_vs_switch": time_ratio,
            "goal": FUSED_GOAL,
            "met": memory <= FUSED_GOAL["memory"] and time_ratio <= FUSED_GOAL["time"],
        }
        if (only := _activations_vs_switch(fused, switch)) is not None:
            # the same goal on the activations alone (the gradients and the optimizer's step left out of both)
            out["fused_loss_every_block"].update(
                activation_only_vs_switch=only,
                met_on_activation_only=only <= FUSED_GOAL["memory"] and time_ratio <= FUSED_GOAL["time"],
            )
    for key in ("ours_budget_0.6", "ours_at_switch_memory", "ours_below_switch"):  # finer links against whole ones
        fine, whole = rows.get(key, {}), rows.get(f"{key}_blocks", {})
        if "step_ms" in fine and "step_ms" in whole:
            out[f"{key.removeprefix('ours_')}_finer_vs_whole_blocks"] = {
                "step_time": fine["step_ms"] / whole["step_ms"],
                "memory": fine["activation_peak_gb"] / whole["activation_peak_gb"],
                "parts": len(fine.get("parts", [])),
            }
    budgets = {r: rows[r] for r in ROWS if "held" in rows.get(r, {})}
    out["budgets_held_or_said"] = {
        r: bool(row["held"]) or "budget not met" in row.get("summary", "") for r, row in budgets.items()
    }
    if "saved_pct" in rows.get("ours_rebuild", {}):
        # to hold against torchvision resnet50's figure (benchmarks/checkpointing.py): within 2 points
        out["rebuild_saved_pct"] = rows["ours_rebuild"]["saved_pct"]
    return out


def _allocator_calls() -> int | None:
    """The caching allocator's calls to the driver so far (``cudaMalloc`` and ``cudaFree``, and retries after a
    failed one), or None where this torch does not count them (no zero that means nothing)."""
    stats = torch.cuda.memory_stats()
    keys = ("num_device_alloc", "num_device_free", "num_alloc_retries")
    return sum(int(stats[key]) for key in keys) if all(key in stats for key in keys) else None


def interleaved(
    name: str,
    rows: dict[str, dict[str, Any]],
    setting: Setting,
    rounds: int,
    alive: dict[str, nn.Module],
    fresh_cache: bool = False,
) -> None:
    """Time every row again, all alive at once (``alive``: each row's model as it measured it): in every round each
    row takes a turn of :data:`STEPS_PER_TURN` training steps, the first untimed (another model ran just before), in
    turns (the order reversed every other round), so that a slow stretch of the host falls on all rows alike. Each
    row's ``step_ms`` becomes the median of its timed steps here (``step_ms_alone``: its own row's figure); memory
    stays its own row's. Beside each timed step: the row whose turn came before (``interleaved_after``), and per turn
    the allocator's calls to the driver in its timed steps (``driver_calls_per_turn``). ``fresh_cache``: each turn
    begins with the allocator's cache emptied, so that no row runs in memory laid out by the row before it."""
    models: dict[str, tuple[nn.Module, torch.optim.Optimizer]] = {}
    try:
        batches = make_batches(name, setting)
        for row, model in alive.items():
            model.train()
            models[row] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4))
        events: dict[str, list[Any]] = {row: [] for row in models}
        after: dict[str, list[str | None]] = {row: [] for row in models}
        driver_calls: dict[str, list[int | None]] = {row: [] for row in models}
        calls: int | None = None
        order = list(models)
        cuda = setting.device.type == "cuda"
        before: str | None = None
        for i in range(1 + rounds):  # a round of warm-up first
            for row in order if i % 2 else reversed(order):
                model, opt = models[row]
                if cuda and fresh_cache:
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
                with step_context(model):
                    for k in range(STEPS_PER_TURN):
                        if cuda and i and k == 1:  # the host makes the calls as it queues: no synchronize needed
                            calls = _allocator_calls()
                        batch = batches[k % len(batches)]
                        opt.zero_grad(set_to_none=True)
                        start = torch.cuda.Event(enable_timing=True) if cuda else time.perf_counter()
                        if cuda:
                            start.record()  # type: ignore[union-attr]
                        with setting.autocast():
                            loss = loss_of(model, batch)
                        loss.backward()
                        opt.step()
                        end = torch.cuda.Event(enable_timing=True) if cuda else None
                        if end is not None:
                            end.record()
                        if i and k:
                            events[row].append((start, end if cuda else time.perf_counter()))
                            after[row].append(before)
                if cuda and i:
                    now = _allocator_calls()
                    driver_calls[row].append(None if now is None or calls is None else now - calls)
                before = row
        if cuda:
            torch.cuda.synchronize()
        for row, pairs in events.items():
            times = [s.elapsed_time(e) if cuda else (e - s) * 1e3 for s, e in pairs]
            rows[row]["step_ms_alone"] = rows[row]["step_ms"]
            rows[row]["step_ms_interleaved"] = times
            rows[row]["interleaved_after"] = after[row]
            rows[row]["driver_calls_per_turn"] = driver_calls[row]
            rows[row]["fresh_cache"] = fresh_cache
            rows[row]["step_ms"] = median(times)
            rows[row].update(rate(name, setting, rows[row]["step_ms"]))
    except Exception as error:  # noqa: BLE001 - the rows keep their own figures
        for row in models:
            rows[row]["interleaved_error"] = f"{type(error).__name__}: {error}"
    finally:
        models.clear()
        alive.clear()
        gc.collect()
        free_memory()


def by_predecessor(row: dict[str, Any]) -> str:
    """A row's interleaved median step by the row whose turn came before it: where they differ, a row's time
    depends on what ran before it."""
    steps: dict[str, list[float]] = {}
    for ms, before in zip(row["step_ms_interleaved"], row["interleaved_after"], strict=True):
        steps.setdefault(str(before), []).append(ms)
    return ", ".join(f"after {before} {median(v):.1f} ms ({len(v)})" for before, v in steps.items())


def _activations_vs_switch(row: dict[str, Any], switch: dict[str, Any]) -> float | None:
    """A row's activations alone against the switch's (:func:`activation_only_peak`), where both were measured."""
    if not row.get("activation_only_gb") or not switch.get("activation_only_gb"):
        return None
    return float(row["activation_only_gb"] / switch["activation_only_gb"])


def rebuild_goal(models: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """timm resnet50's rebuild against torchvision resnet50's, measured alike in the same run: within 2 points of
    saving (None unless both were measured)."""
    timm_row = models.get("resnet50", {}).get("rows", {}).get("ours_rebuild", {})
    tv_row = models.get("tv_resnet50", {}).get("rows", {}).get("ours_rebuild", {})
    if "saved_pct" not in timm_row or "saved_pct" not in tv_row:
        return None
    points = timm_row["saved_pct"] - tv_row["saved_pct"]
    return {
        "timm_saved_pct": timm_row["saved_pct"],
        "torchvision_saved_pct": tv_row["saved_pct"],
        "points": points,
        "within_2_points": abs(points) <= 2,
    }


def _size(gb: float) -> str:
    return f"{gb:8.3f} GB" if gb >= 0.1 else f"{gb * 1e3:8.3f} MB"  # the smoke run's figures are small


def line(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"{row['model']:<16} {row['row']:<17} ERROR {row['error'][:150]}"
    rate = row.get("samples_per_sec", row.get("tokens_per_sec", float("nan")))
    unit = "img/s" if "samples_per_sec" in row else "tok/s"
    text = f"{row['model']:<16} {row['row']:<17} {row['step_ms']:9.1f} ms {rate:11.0f} {unit} "
    text += f"{_size(row['activation_peak_gb'])} (activations {_size(row['activation_only_gb'])})"
    if "saved_pct" in row:
        text += f"  saved {row['saved_pct']:6.1f} %  time {row['time_cost_pct']:+7.1f} %"
    if "held" in row:
        text += f"  held {row['held']}  [{row['summary']}]"
    text += f"  ({row['wall_s']:.0f} s)"
    return text


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/families.json")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated, from: " + ", ".join(MODELS))
    parser.add_argument("--smoke", action="store_true", help="a tiny CPU version: every row runs, nothing measured")
    parser.add_argument(
        "--rounds", type=int, default=5, help="turns of every row, all alive, one after another (median kept); 0: none"
    )
    parser.add_argument(
        "--rows",
        default=",".join(DEFAULT_ROWS),
        help="comma-separated, from: " + ", ".join(ROWS) + " (default: all but " + ", ".join(OFFLOADING) + ")",
    )
    parser.add_argument(
        "--fresh-cache",
        action="store_true",
        help="each interleaved turn begins with the allocator's cache emptied: no row runs in memory the row before"
        " it laid out",
    )
    args = parser.parse_args()
    chosen = [r for r in args.rows.split(",") if r]
    if unknown_rows := [r for r in chosen if r not in ROWS]:
        parser.error(f"unknown row: {unknown_rows}")
    if any(r in AT_SWITCH for r in chosen) and not {"plain", "family_switch"} <= set(chosen):
        parser.error("the rows set by the switch's memory need the plain and family_switch rows")
    if any(r in SWITCH_OF for r in chosen) and not set(SWITCH_OF.values()) <= set(chosen):
        parser.error("levers_at_every_2_memory needs the family_switch_every_2 row")
    if args.rounds < 0:
        parser.error(f"--rounds must be at least 0, got {args.rounds}")
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"unknown model: {unknown}")
    setting = Setting.make(args.smoke)
    if args.smoke:
        torch.set_num_threads(1)  # tiny models: threads only wait on each other, and on a shared machine far longer
    else:
        if not torch.cuda.is_available():
            parser.error("needs a CUDA device (or --smoke)")
        torch.backends.cudnn.benchmark = True
    result: dict[str, Any] = {"environment": environment(), "config": vars(args), "setting": _plain(setting)}
    result["models"] = models_out = {}  # type: ignore[var-annotated]
    for name in models:
        rows: dict[str, dict[str, Any]] = {}
        alive: dict[str, nn.Module] = {}  # each row's model, kept for the interleaved timing
        entry: dict[str, Any] = {"rows": rows}
        if name not in REBUILT:
            entry["notes"] = ["ours_rebuild skipped: the rebuild applies to the ResNet families only here"]
        if name in TORCHVISION:
            entry["notes"] = ["family_switch skipped: torchvision has no switch of its own"]
        if name not in FUSED:
            entry.setdefault("notes", []).append("fused_loss_every_block skipped: no vocabulary's logits")
        if name in VISION or not partial_switch_exists():
            entry.setdefault("notes", []).append(
                "family_switch_every_2 skipped: a Hugging Face model's, in a transformers with every_n_layers"
            )
        models_out[name] = entry
        for row in (r for r in ROWS if r in chosen):
            if (row == "ours_rebuild" and name not in REBUILT) or (row == "family_switch" and name in TORCHVISION):
                continue
            if row in FUSED_ROWS and name not in FUSED:
                continue
            if (row in PARTIAL or row in SWITCH_OF) and (name in VISION or not partial_switch_exists()):
                continue
            at_switch = switch_budget(rows, row, args.smoke)
            if row in AT_SWITCH and at_switch is None:
                continue
            rows[row] = measure(name, row, setting, at_switch, alive if args.rounds else None)
            compare(rows)
            entry["goals"] = goals(name, rows)
            print(line(rows[row]), flush=True)
            with contextlib.redirect_stdout(io.StringIO()):  # after every row: a run cut short keeps what it measured
                write_json(args.out, result)
        if args.rounds:
            interleaved(name, rows, setting, args.rounds, alive, args.fresh_cache)
            compare(rows)
            entry["goals"] = goals(name, rows)
            for row in rows.values():
                if "step_ms_alone" in row:
                    print(line(row), "interleaved; alone", row["step_ms_alone"], flush=True)
                    calls = row["driver_calls_per_turn"]
                    print(f"  {row['row']}: {by_predecessor(row)}; the allocator's driver calls per turn {calls}")
            with contextlib.redirect_stdout(io.StringIO()):
                write_json(args.out, result)
        print(f"{name:<16} goals {entry['goals']}", flush=True)
    if (goal := rebuild_goal(models_out)) is not None:
        result["rebuild_goal"] = goal
        print(f"rebuild, timm resnet50 against torchvision resnet50: {goal}", flush=True)
    write_json(args.out, result)


def _plain(setting: Setting) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, torch.device) else v) for k, v in setting._asdict().items()}


if __name__ == "__main__":
    main()
