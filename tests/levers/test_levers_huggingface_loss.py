"""A Hugging Face model's own ``forward(labels=...)`` with the fused loss: for every family (built from a tiny
config on the CPU) the loss and every parameter's gradient equal the plain model's, in float32 and under bf16
autocast, with ignored labels and a padded batch; the change is undone exactly, pickles, and what cannot be fused
is refused by name."""

from __future__ import annotations

import copy
import io
import pickle
import warnings

import pytest
import torch
from conftest import trainer_kwargs
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset

transformers = pytest.importorskip("transformers")

from lightning_memguard import apply_fused_loss, remove_fused_loss  # noqa: E402
from lightning_memguard.levers.huggingface_loss import FAMILIES, FusedLossRefused, is_fused, refusal  # noqa: E402

VOCABULARY = 96
SMALL = {"hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64, "vocab_size": VOCABULARY}
DECODERS = {"num_key_value_heads": 1, "num_hidden_layers": 2, **SMALL}
SEQ2SEQ = {"d_model": 32, "encoder_attention_heads": 2, "decoder_attention_heads": 2, "encoder_ffn_dim": 64}
SEQ2SEQ |= {"decoder_ffn_dim": 64, "encoder_layers": 1, "decoder_layers": 1, "vocab_size": VOCABULARY}


def _build(family: str) -> torch.nn.Module:
    t = transformers
    if family == "gpt2":
        config = t.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCABULARY, n_positions=32)
        return t.GPT2LMHeadModel(config)
    if family in ("llama", "mistral", "qwen2"):
        name = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}[family]
        return getattr(t, f"{name}ForCausalLM")(getattr(t, f"{name}Config")(**DECODERS))
    if family == "bert":
        return t.BertForMaskedLM(t.BertConfig(num_hidden_layers=2, **SMALL))
    if family == "roberta":
        return t.RobertaForMaskedLM(t.RobertaConfig(num_hidden_layers=2, **SMALL))
    if family == "t5":
        config = t.T5Config(num_layers=2, d_model=32, d_kv=8, num_heads=2, d_ff=64, vocab_size=VOCABULARY)
        config.decoder_start_token_id = config.pad_token_id = 0
        return t.T5ForConditionalGeneration(config)
    if family == "bart":
        model = t.BartForConditionalGeneration(t.BartConfig(**SEQ2SEQ))
        torch.nn.init.normal_(model.final_logits_bias)  # zeros as built: made visible, so it must be added
        return model
    assert family == "whisper"
    tokens = {"pad_token_id": 1, "decoder_start_token_id": 2, "bos_token_id": 2, "eos_token_id": 2}
    config = t.WhisperConfig(num_mel_bins=8, max_source_positions=16, max_target_positions=32, **SEQ2SEQ, **tokens)
    return t.WhisperForConditionalGeneration(config)


def _model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = _build(family)
    model.config.use_cache = False
    return model.train()


def _batch(family: str) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, VOCABULARY, (2, 10), generator=generator)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 7:] = 0  # a padded batch
    labels = tokens.clone()
    labels[1, 7:] = -100  # padding ignored
    labels[0, :2] = -100  # and a prompt
    if family == "whisper":
        return {"input_features": torch.randn(2, 8, 32, generator=generator), "labels": labels}
    return {"input_ids": tokens, "attention_mask": mask, "labels": labels}


def _run(model, batch, **kwargs):
    torch.manual_seed(2)
    return model(**batch, **kwargs)


def _step(model, batch, autocast=False):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(2)  # the same dropout masks for the plain and the fused forward (BART's is functional)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        output = model(**batch)
    output.loss.backward()
    named = getattr(model, "_orig_mod", model).named_parameters()  # a compiled model's, by the model's names
    grads = {name: p.grad.clone() for name, p in named if p.grad is not None}
    return output, output.loss.detach(), grads


def _assert_close(got, want, atol, rtol):
    loss, grads = got
    torch.testing.assert_close(loss, want[0], atol=atol, rtol=rtol)
    assert grads.keys() == want[1].keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want[1][name], atol=atol, rtol=rtol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_gets_the_plain_loss_and_gradients_without_logits(family):
    model, batch = _model(family), _batch(family)
    plain_output, *plain = _step(model, batch)
    assert plain_output.logits.shape[-1] == VOCABULARY
    apply_fused_loss(model, chunk_tokens=7)  # chunks that straddle the two sequences
    output, *fused = _step(model, batch)
    assert output.logits is None  # no logits built
    _assert_close(fused, plain, atol=1e-5, rtol=1e-4)
    assert type(output) is type(plain_output)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_under_bf16_autocast_it_stays_within_bf16_tolerance_of_the_float32_reference(family):
    model, batch = _model(family), _batch(family)
    _, *reference = _step(model, batch)
    apply_fused_loss(model, chunk_tokens=7)
    _, *fused = _step(model, batch, autocast=True)
    _assert_close(fused, reference, atol=3e-2, rtol=5e-2)


def test_the_change_is_undone_exactly_and_pickles():
    model = _model("gpt2")
    head = model.get_output_embeddings()
    classes, state = (type(model), type(head)), {k: v.clone() for k, v in model.state_dict().items()}
    attributes = (set(model.__dict__), set(head.__dict__))
    apply_fused_loss(model)
    assert is_fused(model) and set(head.__dict__) == attributes[1] | {"memguard_fused"}
    copied = pickle.loads(pickle.dumps(model))  # ddp_spawn, torch.save: the classes are made again
    deep = copy.deepcopy(model)
    batch = _batch("gpt2")
    for other in (copied, deep):
        assert is_fused(other)
        torch.testing.assert_close(_run(other, batch).loss, _run(model, batch).loss)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    assert remove_fused_loss(model) and not remove_fused_loss(model)
    assert (type(model), type(head)) == classes
    assert (set(model.__dict__), set(head.__dict__)) == attributes
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert model(**batch).logits is not None  # the model's own forward again


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_a_masked_models_head_module_takes_only_the_counted_tokens(family):
    """BERT's and RoBERTa's head transform (a dense layer, GELU, a LayerNorm before the output embedding) runs on the
    counted tokens' rows alone, with the plain loss and gradients (the family test above); with ``counted_only=False``
    or the logits asked for, on every token; undone exactly, the head module's class included."""
    from lightning_memguard.levers.huggingface_loss import token_head

    model, batch = _model(family), _batch(family)
    rows = token_head(model)
    assert rows is not None and rows is not model.get_output_embeddings()
    head_class = type(rows)
    dense = next(m for m in rows.modules() if isinstance(m, torch.nn.Linear) and m is not model.get_output_embeddings())
    seen = []
    hook = dense.register_forward_hook(lambda module, args, out: seen.append(args[0].shape[:-1].numel()))
    counted = int((batch["labels"] != -100).sum())
    tokens = batch["labels"].numel()
    _step(model, batch)
    apply_fused_loss(model)
    assert type(rows) is not head_class
    _step(model, batch)
    apply_fused_loss(model, counted_only=False)
    _step(model, batch)
    with pytest.warns(UserWarning, match="builds its logits"):
        apply_fused_loss(model, logits=True)
    _run(model, batch)
    assert seen == [tokens, counted, tokens, tokens]
    hook.remove()
    remove_fused_loss(model)
    assert type(rows) is head_class and "memguard_fused" not in rows.__dict__
    copied = pickle.loads(pickle.dumps(apply_fused_loss(model)))  # the head and its module share one state
    assert copied.get_output_embeddings().memguard_fused is token_head(copied).memguard_fused
    torch.testing.assert_close(_run(copied, batch).loss, _run(model, batch).loss)


def test_a_masked_batch_with_no_counted_token_gives_the_plain_nan_loss_and_gradients():
    """A small last batch where the collator masked nothing: no row goes through the head module, and the loss is
    nan with the plain model's gradients, as ``F.cross_entropy`` gives."""
    model, batch = _model("bert"), _batch("bert")
    batch["labels"][:] = -100
    _, plain_loss, plain = _step(model, batch)
    apply_fused_loss(model)
    _, loss, fused = _step(model, batch)
    assert plain_loss.isnan() and loss.isnan() and fused.keys() == plain.keys()
    for name, grad in fused.items():
        torch.testing.assert_close(grad, plain[name], equal_nan=True, msg=name)


def test_without_labels_the_model_is_its_own():
    model = _model("llama")
    batch = _batch("llama")
    del batch["labels"]
    plain = model(**batch).logits
    apply_fused_loss(model)
    torch.testing.assert_close(model(**batch).logits, plain, atol=0, rtol=0)  # bit for bit


def test_logits_asked_for_are_returned_with_a_warning_that_the_saving_is_lost():
    model, batch = _model("bart"), _batch("bart")
    plain = _run(model, batch)
    with pytest.warns(UserWarning, match=r"builds its logits as well, so their memory .* is not saved"):
        apply_fused_loss(model, logits=True)
    output = _run(model, batch)
    torch.testing.assert_close(output.logits, plain.logits)
    torch.testing.assert_close(output.loss, plain.loss)


def test_a_tuple_output_keeps_the_places_of_loss_and_logits():
    model, batch = _model("bert"), _batch("bert")
    plain = _run(model, batch, return_dict=False)
    apply_fused_loss(model)
    output = _run(model, batch, return_dict=False)
    assert len(output) == len(plain) and output[1] is None
    torch.testing.assert_close(output[0], plain[0])


def test_num_items_in_batch_divides_a_causal_models_summed_loss_as_its_own_does():
    model, batch = _model("qwen2"), _batch("qwen2")
    plain = _run(model, batch, num_items_in_batch=torch.tensor(40)).loss
    apply_fused_loss(model)
    torch.testing.assert_close(_run(model, batch, num_items_in_batch=torch.tensor(40)).loss, plain)


@pytest.mark.parametrize("family", ["gpt2", "bert"])  # bert: its head module's rows, all kept while compiling
def test_torch_compile_gives_the_same_loss_and_gradients(family):
    model, batch = _model(family), _batch(family)
    _, *plain = _step(model, batch)
    apply_fused_loss(model, chunk_tokens=8)
    compiled = torch.compile(model, backend="aot_eager")
    _, *fused = _step(compiled, batch)
    _assert_close(fused, plain, atol=1e-5, rtol=1e-4)


class _CausalLM(LightningModule):
    """GPT-2 (dropout off) in a LightningModule whose ``training_step`` calls its ``forward``: what
    ``Trainer.fit(torch.compile(module))`` compiles. Records every step's loss and gradients."""

    def __init__(self, fused: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCABULARY, n_positions=32)
        config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
        self.model = transformers.GPT2LMHeadModel(config)
        if fused:
            apply_fused_loss(self.model, chunk_tokens=7)
        self.losses: list[torch.Tensor] = []
        self.grads: list[dict[str, torch.Tensor]] = []

    def forward(self, tokens, labels):
        return self.model(tokens, labels=labels).loss

    def training_step(self, batch, batch_idx):
        loss = self(*batch)
        self.losses.append(loss.detach())
        return loss

    def on_before_optimizer_step(self, optimizer):
        self.grads.append({n: p.grad.clone() for n, p in self.named_parameters()})

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def train_dataloader(self):
        batch = _batch("gpt2")
        data = TensorDataset(batch["input_ids"].repeat(2, 1), batch["labels"].repeat(2, 1))
        return DataLoader(data, batch_size=2)


def test_a_compiled_lightning_fit_trains_as_the_plain_eager_fit(tmp_path):
    """``Trainer.fit(torch.compile(module, backend="aot_eager"))`` with the fused loss: every step's loss and gradients
    are the plain model's, uncompiled (DDP with the model compiled inside: test_levers_fused_loss_distributed.py)."""
    from torch._dynamo.utils import counters

    plain, fused = _CausalLM(fused=False), _CausalLM(fused=True)
    Trainer(**trainer_kwargs(tmp_path, max_steps=3)).fit(plain)
    counters.clear()
    Trainer(**trainer_kwargs(tmp_path, max_steps=3)).fit(torch.compile(fused, backend="aot_eager"))
    assert counters["frames"]["ok"] > 0  # compiled, not run eagerly
    assert len(fused.grads) == len(plain.grads) == 3
    for got, want in zip(fused.losses, plain.losses, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for got, want in zip(fused.grads, plain.grads, strict=True):
        _assert_close((torch.zeros(()), got), (torch.zeros(()), want), atol=1e-5, rtol=1e-4)


def test_what_cannot_be_fused_is_refused_by_name():
    t = transformers
    gemma = t.Gemma2ForCausalLM(t.Gemma2Config(final_logit_softcapping=30.0, head_dim=16, **DECODERS))
    with pytest.raises(FusedLossRefused, match=r"gemma2: its logits are changed after the head .*final_logit_soft"):
        apply_fused_loss(gemma)
    neo = t.GPTNeoForCausalLM(
        t.GPTNeoConfig(
            num_layers=1, attention_types=[[["global"], 1]], hidden_size=32, num_heads=2, vocab_size=VOCABULARY
        )
    )
    with pytest.raises(FusedLossRefused, match=r"gpt_neo: not verified"):
        apply_fused_loss(neo)
    classifier = t.BertForSequenceClassification(t.BertConfig(num_hidden_layers=1, **SMALL))
    with pytest.raises(FusedLossRefused, match=r"BertForSequenceClassification: no language-model head"):
        apply_fused_loss(classifier)
    assert refusal(torch.nn.Linear(2, 2)) == "Linear is not a Hugging Face model (no config.model_type)"
    with pytest.raises(ValueError, match=r"`chunk_tokens` must be a positive int, got 0"):
        apply_fused_loss(_model("gpt2"), chunk_tokens=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a refused model is left as it was, and warns nothing
        assert not is_fused(neo)
