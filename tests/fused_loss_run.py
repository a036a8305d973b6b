"""Two CPU processes (gloo): the fused loss trained under DDP and under ModelParallelStrategy (FSDP2's ``fully_shard``
and tensor parallelism), against the plain loss under the same strategy and against one process training the plain
model on the two ranks' batches together. Run by tests/levers/test_levers_fused_loss_distributed.py, through
``ddp_run.py``.

Every model is tiny (2 layers, 32 features, a vocabulary of 96) with dropout off, and every sequence has the same
number of counted tokens (a prompt of 2 ignored labels, then the causal shift), so the mean of the two ranks' mean
losses is the loss of the batches together. Each fit records, on each rank, every micro-batch's loss and, before each
optimizer step (after DDP's all-reduce or FSDP2's reduce-scatter), the largest difference of any parameter's gradient
(gathered whole) from the single process's, and from the plain loss's under the same strategy.

Scenarios (each rank writes SCENARIO-rankN.json into OUT_DIR, a key per fit):
  ddp:   GPT-2 (``wte`` and ``lm_head`` tied) under DDPStrategy: ``plain``; ``fused`` (``apply_fused_loss``);
         ``unused`` (``find_unused_parameters=True``); ``accumulate`` (``accumulate_grad_batches=2``: the first
         micro-batch under ``no_sync``); ``direct`` (a LightningModule calling ``fused_linear_cross_entropy`` on the
         transformer's hidden states and ``lm_head.weight``); ``compiled`` (the fused model compiled, ``aot_eager``)
  fsdp2: ModelParallelStrategy(data_parallel_size=2): GPT-2 ``plain`` and ``fused``, each block sharded and the root
         (the tied head in the root's group); Llama with an untied head sharded on its own (``llama_plain``,
         ``llama_fused``: gathered for the head's call only); a user's head module whose forward calls
         ``fused_linear_cross_entropy`` (``head_plain``, ``head_fused``); then what is refused, its message:
         ``direct`` (the user's call outside the head's forward, on the sharded weight) and ``tensor_parallel``
         (ModelParallelStrategy(tensor_parallel_size=2), the Llama head ``ColwiseParallel``)
"""

from __future__ import annotations

import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's package

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from lightning.pytorch import LightningModule, Trainer  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_memguard import apply_fused_loss, fused_linear_cross_entropy  # noqa: E402

RANK = int(os.environ.get("LOCAL_RANK", "0"))
VOCABULARY, SEQUENCES, LENGTH, BATCH = 96, 8, 12, 2
CHUNK = 7  # chunks that straddle the sequences


def data() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCABULARY, (SEQUENCES, LENGTH), generator=torch.Generator().manual_seed(1))
    labels = tokens.clone()
    labels[:, :2] = -100  # a prompt, in every sequence: every rank counts as many tokens
    return tokens, labels


def gpt2() -> torch.nn.Module:
    t = transformers
    config = t.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCABULARY, n_positions=LENGTH)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    return t.GPT2LMHeadModel(config)


def llama() -> torch.nn.Module:
    t = transformers
    config = t.LlamaConfig(
        hidden_size=32, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64, num_hidden_layers=2,
        vocab_size=VOCABULARY, tie_word_embeddings=False,
    )  # fmt: skip
    return t.LlamaForCausalLM(config)


class LossHead(torch.nn.Linear):
    """A user's head: its forward computes the fused loss, so FSDP2 gathers its weight for it."""

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        if labels is None:
            return super().forward(hidden)
        return fused_linear_cross_entropy(hidden, self.weight, labels, shift=True, chunk_tokens=CHUNK)


class CausalLM(LightningModule):
    """``loss``: ``plain`` (the model's own), ``fused`` (``apply_fused_loss``), ``direct`` (the transformer's hidden
    states and the head's weight handed to ``fused_linear_cross_entropy`` in ``training_step``), ``head`` (a user's
    ``LossHead`` called with the labels; ``head_plain``: the same model, ``F.cross_entropy`` on its logits)."""

    def __init__(self, family: str = "gpt2", loss: str = "plain", shard: str | None = None, compiled: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.family, self.loss, self.shard = family, loss, shard
        self.model = gpt2() if family == "gpt2" else llama()
        self.model.config.use_cache = False
        if loss.startswith("head"):  # a backbone of the user's and a head of the user's
            self.model, self.head = self.model.transformer, LossHead(32, VOCABULARY, bias=False)
        if loss == "fused":
            apply_fused_loss(self.model, chunk_tokens=CHUNK)
        # not a submodule: the compiled wrapper shares the model's parameters
        self.__dict__["forward_model"] = torch.compile(self.model, backend="aot_eager") if compiled else self.model
        self.losses: list[float] = []
        self.grads: list[dict[str, torch.Tensor]] = []

    def compute_loss(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.loss == "direct":
            hidden = self.model.transformer(tokens).last_hidden_state
            return fused_linear_cross_entropy(hidden, self.model.lm_head.weight, labels, shift=True, chunk_tokens=CHUNK)
        if self.loss == "head_fused":
            return self.head(self.model(tokens).last_hidden_state, labels)
        if self.loss == "head_plain":
            logits = self.head(self.model(tokens).last_hidden_state)[:, :-1]
            return F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten())
        return self.forward_model(tokens, labels=labels).loss  # type: ignore[no-any-return]

    def training_step(self, batch, batch_idx):
        loss = self.compute_loss(*batch)
        self.losses.append(loss.item())
        return loss

    def on_before_optimizer_step(self, optimizer) -> None:
        self.grads.append(whole_grads(self))

    def configure_model(self) -> None:
        if self.shard is None or self.device_mesh is None:
            return
        from torch.distributed.fsdp import FSDPModule, fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

        if self.shard == "tensor_parallel":
            parallelize_module(self.model.lm_head, self.device_mesh["tensor_parallel"], ColwiseParallel())
            return
        if isinstance(self.model, FSDPModule):
            return
        mesh = self.device_mesh["data_parallel"]
        if self.loss.startswith("head"):
            blocks = self.model.h
        else:
            blocks = self.model.transformer.h if self.family == "gpt2" else self.model.model.layers
        for block in blocks:
            fully_shard(block, mesh=mesh)
        if self.family == "llama":
            fully_shard(self.model.lm_head, mesh=mesh)  # its own group: gathered for the head's call only
        if self.loss.startswith("head"):
            fully_shard(self.head, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def train_dataloader(self):
        tokens, labels = data()  # this rank's sequences: rank r takes r, r + 2, ... (the sampler made here)
        rank, ranks = self.trainer.global_rank, self.trainer.world_size
        return DataLoader(TensorDataset(tokens[rank::ranks], labels[rank::ranks]), batch_size=BATCH)


def whole_grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, a sharded one gathered whole (on every rank, in the same order)."""
    return {
        name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
        for name, p in module.named_parameters()
        if p.grad is not None
    }


def reference(family: str, loss: str, steps: int, accumulate: int) -> tuple[list[float], list[dict]]:
    """One process, the plain model, each optimizer step on the sequences the two ranks' micro-batches hold together
    (rank r takes r, r + 2, ...: the step's sequences in another order, which the mean does not see)."""
    module = CausalLM(family, "head_plain" if loss.startswith("head") else "plain")
    optimizer = module.configure_optimizers()
    tokens, labels = data()
    together = 2 * BATCH * accumulate
    losses, grads = [], []
    for step in range(steps):
        start = step * together % SEQUENCES
        optimizer.zero_grad()
        value = module.compute_loss(tokens[start : start + together], labels[start : start + together])
        value.backward()
        losses.append(value.item())
        grads.append(whole_grads(module))
        optimizer.step()
    return losses, grads


def largest_difference(got: list[dict], want: list[dict]) -> list[float]:
    assert len(got) == len(want) and all(g.keys() == w.keys() for g, w in zip(got, want, strict=True))
    return [max((g[k] - w[k]).abs().max().item() for k in w) for g, w in zip(got, want, strict=True)]


def fit(module: CausalLM, strategy, steps: int = 3, accumulate: int = 1) -> Trainer:
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, accumulate_grad_batches=accumulate,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, default_root_dir=os.getcwd(), use_distributed_sampler=False,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module)
    return trainer


def compared(module: CausalLM, plain: CausalLM | None, steps: int = 3, accumulate: int = 1) -> dict:
    ref_losses, ref_grads = reference(module.family, module.loss, steps, accumulate)
    return {
        "losses": module.losses,
        "reference_losses": ref_losses,
        "grads_from_reference": largest_difference(module.grads, ref_grads),
        "grads_from_plain": None if plain is None else largest_difference(module.grads, plain.grads),
        "losses_from_plain": None
        if plain is None
        else max(abs(a - b) for a, b in zip(module.losses, plain.losses, strict=True)),
    }


def refused(module: CausalLM, strategy) -> str | None:
    try:
        fit(module, strategy, steps=1)
    except ValueError as err:
        return str(err)
    return None


def ddp() -> dict:
    def strategy(**kwargs):
        return DDPStrategy(process_group_backend="gloo", **kwargs)

    plain = CausalLM()
    fit(plain, strategy())
    result = {"plain": compared(plain, None)}
    for name, kwargs in [("fused", {}), ("unused", {"find_unused_parameters": True})]:
        module = CausalLM(loss="fused")
        fit(module, strategy(**kwargs))
        result[name] = compared(module, plain)
    module = CausalLM(loss="fused")
    fit(module, strategy(), steps=2, accumulate=2)
    result["accumulate"] = compared(module, None, steps=2, accumulate=2)
    module = CausalLM(loss="direct")
    fit(module, strategy())
    result["direct"] = compared(module, plain)
    from torch._dynamo.utils import counters

    counters.clear()
    module = CausalLM(loss="fused", compiled=True)
    fit(module, strategy())
    result["compiled"] = {**compared(module, plain), "frames_compiled": counters["frames"]["ok"]}
    return result


def fsdp2() -> dict:
    def strategy(data_parallel: int = 2):
        return ModelParallelStrategy(data_parallel_size=data_parallel, tensor_parallel_size=2 // data_parallel)

    result = {}
    for family, prefix in (("gpt2", ""), ("llama", "llama_")):
        plain = CausalLM(family, "plain", shard="fsdp2")
        fit(plain, strategy())
        result[f"{prefix}plain"] = compared(plain, None)
        fused = CausalLM(family, "fused", shard="fsdp2")
        fit(fused, strategy())
        result[f"{prefix}fused"] = compared(fused, plain)
    plain = CausalLM("gpt2", "head_plain", shard="fsdp2")
    fit(plain, strategy())
    result["head_plain"] = compared(plain, None)
    fused = CausalLM("gpt2", "head_fused", shard="fsdp2")
    fit(fused, strategy())
    result["head_fused"] = compared(fused, plain)
    direct = CausalLM("llama", "direct", shard="fsdp2")
    direct.compute_loss = lambda tokens, labels: fused_linear_cross_entropy(  # type: ignore[method-assign]
        direct.model(tokens, output_hidden_states=True).hidden_states[-1], direct.model.lm_head.weight, labels
    )  # the root's forward has run, the head's (its own group) has resharded its weight
    result["direct"] = {"refused": refused(direct, strategy())}
    result["tensor_parallel"] = {"refused": refused(CausalLM("llama", "fused", shard="tensor_parallel"), strategy(1))}
    return result


def run(out: str, scenario: str) -> None:
    """One scenario on this rank, its result in OUT/SCENARIO-rankN.json (``ddp_run.py`` calls it)."""
    result = {"ddp": ddp, "fsdp2": fsdp2}[scenario]()
    with open(os.path.join(out, f"{scenario}-rank{RANK}.json"), "w", encoding="utf-8") as f:
        json.dump(result, f)
