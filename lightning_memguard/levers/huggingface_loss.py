"""A Hugging Face model's own ``forward(..., labels=...)``, with its loss fused: the logits are never built.

:func:`apply_fused_loss` changes two classes (three for a masked model), and nothing else: the model's (a forward
that hands the labels to its head) and its output embedding's (``get_output_embeddings()``, an ``nn.Linear``: when
it gets labels it returns :func:`.fused_loss.fused_linear_cross_entropy` of its input, the hidden states after
everything the family does before its head, instead of the logits). The model's own forward runs unchanged around
them, so BERT's transform before its decoder and T5's scaling of the decoder's output stay the family's own; BART's
``final_logits_bias`` is added to the head's bias. A masked language model's head module (:func:`token_head`: the
model's child that holds the output embedding, BERT's ``cls``, RoBERTa's ``lm_head``, whose layers before the output
embedding act on each token alone) takes only the counted tokens' rows (about 15 %) through its transform and the
loss. The loss is computed inside the head's call, so a strategy that gathers the head's weight
for that call (FSDP2's ``fully_shard``) gathers it for the loss too.

The public hooks of transformers it uses: ``get_output_embeddings()``, ``config.model_type`` and
``config.is_encoder_decoder``, ``prepare_decoder_input_ids_from_labels`` (T5, BART; DataCollatorForSeq2Seq's hook)
or else ``config.pad_token_id`` and ``config.decoder_start_token_id`` (Whisper), and the ``ModelOutput`` classes; no
private name.

Only the families whose forward was read and tested (:data:`FAMILIES`) are changed: another family's forward may
change the logits after its head (Gemma's soft cap, Granite's ``logits_scaling``), which a fused loss would silently
drop, so it is refused by name. The classes are made once per class and pickle as their original class with this
library's mixin (:class:`~lightning_memguard.checkpointing.wrap.SwappedModule`); :func:`remove_fused_loss` puts them
back.
"""

from __future__ import annotations

import warnings
from typing import Any

from torch import Tensor, nn

from lightning_memguard.checkpointing.wrap import SwappedModule, swap_chain, swap_in, swapped_class
from lightning_memguard.levers.fused_loss import DEFAULT_CHUNK_TOKENS, counted_rows, fused_linear_cross_entropy

FAMILIES: dict[str, str] = {
    "gpt2": "causal",
    "llama": "causal",
    "mistral": "causal",
    "qwen2": "causal",
    "bert": "masked",
    "roberta": "masked",
    "t5": "seq2seq",
    "bart": "seq2seq",
    "whisper": "seq2seq",
}
"""The ``model_type`` of every family whose loss is fused, and its kind: ``causal`` (labels shifted left, as
Hugging Face's causal losses do), ``masked`` or ``seq2seq`` (labels as given; decoder inputs made from them)."""

_HEAD_CLASSES = {"causal": ("ForCausalLM", "LMHeadModel"), "masked": ("ForMaskedLM",)}
_HEAD_CLASSES["seq2seq"] = ("ForConditionalGeneration",)
_LOGIT_CHANGES = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")
"""Config attributes of families whose logits are changed after the head (refused by name)."""


class FusedLossRefused(ValueError):
    """A model whose loss cannot be fused; the message names why."""


def refusal(model: nn.Module) -> str | None:
    """Why :func:`apply_fused_loss` refuses ``model``, or None."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) is None:
        return f"{type(model).__name__} is not a Hugging Face model (no config.model_type)"
    name = swap_chain(type(model))[1].__name__
    reason = config_refusal(config, name)
    if reason is not None:
        return reason
    head = model.get_output_embeddings()  # type: ignore[operator]
    if not isinstance(head, nn.Linear):
        return f"{name}: its output embeddings are a {type(head).__name__}, not an nn.Linear"
    return None


def config_refusal(config: Any, class_name: str | None) -> str | None:
    """Why a model of this config and class (None: the type has no language-model head) cannot have its loss
    fused, or None; what a coverage table prints without building the model."""
    model_type = config.model_type
    if class_name is None:
        return f"{model_type}: no language-model head"
    changed = [name for name in _LOGIT_CHANGES if getattr(config, name, None) not in (None, 1, 1.0)]
    if changed:
        return f"{model_type}: its logits are changed after the head ({', '.join(f'config.{c}' for c in changed)})"
    kind = FAMILIES.get(model_type)
    if kind is None:
        return f"{model_type}: not verified (its forward may change the logits after the head)"
    if not class_name.endswith(_HEAD_CLASSES[kind]):
        return (
            f"{class_name}: no language-model head (a {kind} {model_type} has one in {'/'.join(_HEAD_CLASSES[kind])})"
        )
    return None


class _HeadState:
    """What a fused head knows: its settings, and for one call of its model the labels and the loss. Copies and
    pickles keep the settings and start with no call."""

    def __init__(self, kind: str, label_smoothing: float, chunk_tokens: int, logits: bool, counted_only: bool) -> None:
        self.kind = kind
        self.label_smoothing = label_smoothing
        self.chunk_tokens = chunk_tokens
        self.logits = logits
        self.counted_only = counted_only
        self.labels: Tensor | None = None
        self.rows_taken = False  # this call's labels and the head's input are the counted rows already
        self.extra_bias: Tensor | None = None
        self.reduction = "mean"
        self.loss: Tensor | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "labels": None, "extra_bias": None, "loss": None, "rows_taken": False}


class FusedLossHead(SwappedModule):
    """Put in front of the output embedding's class (an ``nn.Linear``): given labels by its model, returns the fused
    loss (a scalar) in place of the logits, or with them when the logits were asked for."""

    memguard_prefix = "FusedLoss"
    memguard_unit = False
    memguard_fused: _HeadState

    def forward(self, hidden: Tensor) -> Tensor:
        state = self.memguard_fused
        if state.labels is None:
            return super().forward(hidden)  # type: ignore[no-any-return]
        weight: Tensor = self.weight  # type: ignore[assignment]
        bias: Tensor | None = self.bias  # type: ignore[assignment]
        if state.extra_bias is not None:
            bias = state.extra_bias if bias is None else bias + state.extra_bias
        state.loss = fused_linear_cross_entropy(
            hidden,
            weight,
            state.labels.to(hidden.device),
            bias=bias,
            label_smoothing=state.label_smoothing,
            reduction=state.reduction,  # type: ignore[arg-type]
            shift=state.kind == "causal",
            chunk_tokens=state.chunk_tokens,
            counted_only=state.counted_only and not state.rows_taken,
        )
        if state.logits:
            return super().forward(hidden)  # type: ignore[no-any-return]
        return state.loss


class FusedLossRows(SwappedModule):
    """Put in front of a masked language model's head module (:func:`token_head`): given labels by its model, it
    takes the counted tokens' rows of its input alone (:func:`.fused_loss.counted_rows`) through its layers, which
    act on each token alone, to the fused head. Without labels, or with the logits asked for, it is its own."""

    memguard_prefix = "FusedLoss"
    memguard_unit = False
    memguard_fused: _HeadState

    def forward(self, hidden: Tensor, *args: Any, **kwargs: Any) -> Any:
        state = self.memguard_fused
        if state.labels is not None and state.counted_only and not state.logits:
            hidden, state.labels = counted_rows(hidden, state.labels.to(hidden.device))
            state.rows_taken = True
        return super().forward(hidden, *args, **kwargs)


class FusedLossModel(SwappedModule):
    """Put in front of a Hugging Face model's class: a ``forward`` given ``labels`` (by keyword) hands them to its
    fused head and returns the model's own output with the fused loss, and ``logits`` None unless asked for."""

    memguard_prefix = "FusedLoss"
    memguard_unit = False

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        labels = kwargs.pop("labels", None)
        if labels is None:
            return super().forward(*args, **kwargs)
        head: FusedLossHead = self.get_output_embeddings()  # type: ignore[operator]
        state = head.memguard_fused
        given = kwargs.get("decoder_input_ids") is not None or kwargs.get("decoder_inputs_embeds") is not None
        if state.kind == "seq2seq" and not given:
            kwargs["decoder_input_ids"] = decoder_inputs(self, labels)
        items = kwargs.pop("num_items_in_batch", None) if state.kind == "causal" else None
        return_dict = kwargs.pop("return_dict", None)
        state.labels, state.reduction = labels, "mean" if items is None else "sum"
        state.extra_bias = _final_logits_bias(self)
        try:
            output = super().forward(*args, return_dict=True, **kwargs)
            loss = state.loss
        finally:
            state.labels = state.extra_bias = state.loss = None
            state.rows_taken = False
        if loss is None:
            raise RuntimeError(f"{type(self).__name__}: its head was not called with the labels; no loss was made")
        if items is not None:
            loss = loss / (items.to(loss.device) if isinstance(items, Tensor) else items)
        fields = {key: value for key, value in output.items() if key not in ("loss", "logits")}
        output = type(output)(loss=loss, logits=output["logits"] if state.logits else None, **fields)
        if return_dict is False:
            return (loss, output.logits, *(value for key, value in output.items() if key not in ("loss", "logits")))
        return output


def decoder_inputs(model: nn.Module, labels: Tensor) -> Tensor:
    """An encoder-decoder's decoder inputs from its labels, as its own forward makes them: its public
    ``prepare_decoder_input_ids_from_labels`` where it has one, else the labels shifted right after
    ``config.decoder_start_token_id``, ignored labels (-100) read as ``config.pad_token_id``."""
    prepare = getattr(model, "prepare_decoder_input_ids_from_labels", None)
    if prepare is not None:
        return prepare(labels=labels)  # type: ignore[no-any-return]
    config: Any = model.config
    start, pad = config.decoder_start_token_id, config.pad_token_id
    if start is None or pad is None:
        raise FusedLossRefused(
            f"{type(model).__name__}: decoder inputs cannot be made from the labels without "
            f"config.decoder_start_token_id and config.pad_token_id (got {start!r}, {pad!r}); pass decoder_input_ids"
        )
    shifted = labels.new_full(labels.shape, start)
    shifted[:, 1:] = labels[:, :-1]
    return shifted.masked_fill(shifted == -100, pad)


def token_head(model: nn.Module) -> nn.Module | None:
    """A masked language model's head module: the model's child that holds its output embedding (BERT's ``cls``,
    RoBERTa's ``lm_head``), or None for another kind, or where the output embedding is a child of the model itself."""
    config: Any = getattr(model, "config", None)
    if FAMILIES.get(getattr(config, "model_type", None) or "") != "masked":
        return None
    head = model.get_output_embeddings()  # type: ignore[operator]
    for child in model.children():
        if child is not head and any(module is head for module in child.modules()):
            return child
    return None


def _final_logits_bias(model: nn.Module) -> Tensor | None:
    bias = getattr(model, "final_logits_bias", None)  # BART's buffer, (1, vocabulary), added to the logits
    return bias.reshape(-1) if isinstance(bias, Tensor) else None


def apply_fused_loss(
    model: nn.Module,
    *,
    label_smoothing: float = 0.0,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    logits: bool = False,
    counted_only: bool = True,
) -> nn.Module:
    """Make a Hugging Face model's ``forward(..., labels=...)`` compute its loss without building the logits.

    The loss and every gradient are the plain model's (within float tolerance; under bf16 autocast within bf16
    tolerance of the float32 reference), with ignored labels (-100) and padding as the family's own loss treats
    them; ``num_items_in_batch`` (Hugging Face's Trainer) divides a causal model's summed loss as its own loss does.
    A call without ``labels`` (``generate``, inference) is the model's own. With labels, the output's ``logits`` is
    None unless ``logits=True``.

    Args:
        model: a task model of a family in :data:`FAMILIES`: ``GPT2LMHeadModel``, ``LlamaForCausalLM``,
            ``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``BertForMaskedLM``, ``RobertaForMaskedLM``,
            ``T5ForConditionalGeneration``, ``BartForConditionalGeneration``, ``WhisperForConditionalGeneration``.
        label_smoothing: as ``F.cross_entropy``'s (the families' own losses use none: leave it 0 to keep theirs).
        chunk_tokens: tokens per chunk of the fused loss.
        logits: also build and return the logits (a warning says the memory of the logits is then not saved).
        counted_only: take only the counted tokens' rows through the head (and a masked model's head module), at
            one device sync per call to count them; False takes every row, the ignored ones masked, with no sync
            (:func:`.fused_loss.fused_linear_cross_entropy`'s ``counted_only``).

    Returns:
        The same model, changed in place.

    Raises:
        FusedLossRefused: for a model whose loss cannot be fused, naming why (:func:`refusal`).
        ValueError: for settings out of range, quoting them.

    Example:
        >>> import torch
        >>> from transformers import GPT2Config, GPT2LMHeadModel
        >>> from lightning_memguard import apply_fused_loss, remove_fused_loss
        >>> config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=16)
        >>> model = GPT2LMHeadModel(config).eval()  # dropout off: the same numbers twice
        >>> tokens = torch.randint(0, 100, (2, 8))
        >>> plain = model(tokens, labels=tokens).loss
        >>> output = apply_fused_loss(model)(tokens, labels=tokens)
        >>> torch.allclose(output.loss, plain), output.logits
        (True, None)
        >>> _ = remove_fused_loss(model)
    """
    reason = refusal(model)
    if reason is not None:
        raise FusedLossRefused(reason)
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"`label_smoothing` must be in [0, 1], got {label_smoothing!r}")
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"`chunk_tokens` must be a positive int, got {chunk_tokens!r}")
    if not isinstance(counted_only, bool):
        raise ValueError(f"`counted_only` must be a bool, got {counted_only!r}")
    remove_fused_loss(model)
    if logits:
        warnings.warn(
            f"apply_fused_loss(logits=True): {type(model).__name__} builds its logits as well, so their memory "
            "(tokens x vocabulary) is not saved; only the loss's own float32 copies are",
            UserWarning,
            stacklevel=2,
        )
    head = model.get_output_embeddings()  # type: ignore[operator]
    config: Any = model.config
    kind = FAMILIES[config.model_type]
    state = _HeadState(kind, label_smoothing, chunk_tokens, logits, counted_only)
    swaps: list[tuple[nn.Module, type[nn.Module], dict[str, Any]]] = [(head, FusedLossHead, {"memguard_fused": state})]
    rows = token_head(model)
    if rows is not None:
        swaps.append((rows, FusedLossRows, {"memguard_fused": state}))
    swap_in([*swaps, (model, FusedLossModel, {})])
    return model


def remove_fused_loss(model: nn.Module) -> bool:
    """Put back what :func:`apply_fused_loss` changed: the classes of the model, its head and a masked model's head
    module, and their ``memguard_fused`` (their one attribute). Returns whether there was anything to put back."""
    found = False
    modules: list[nn.Module | None] = [model]
    if hasattr(model, "get_output_embeddings"):
        modules += [model.get_output_embeddings(), token_head(model)]  # type: ignore[operator]
    ours = FusedLossModel | FusedLossHead | FusedLossRows
    for module in modules:
        if module is None:
            continue
        mixins, original = swap_chain(type(module))
        if not any(issubclass(m, ours) for m in mixins):
            continue
        cls = original
        for mixin in mixins:
            if not issubclass(mixin, ours):
                cls = swapped_class(cls, mixin)
        module.__class__ = cls
        module.__dict__.pop("memguard_fused", None)
        found = True
    return found


def is_fused(model: nn.Module) -> bool:
    """Whether :func:`apply_fused_loss` changed ``model``."""
    return isinstance(model, FusedLossModel)
