"""The fix a memory report names, as rules on the measured figures: each rule a small function, pure (no torch).

A rule looks at the step's split and its top modules and answers a sentence, or None where it does not apply. The
report lists every rule that applies, the one whose target holds most of the peak first: checkpoint the blocks
holding the activations; a large vocabulary's loss without its logits (``apply_fused_loss``,
``fused_linear_cross_entropy``); a lighter optimizer state or sharding; then a smaller micro-batch (always, last).

Where the card's capacity is known two causes come before them all, since no change to the batch or the activations
helps: other processes holding the memory the step would fit in without them (:func:`others_fix`), and weights,
gradients and optimizer state that alone, or beside other processes' memory, fill the card (:func:`resting_fix`:
then it is the only fix with :func:`others_fix`, never checkpointing or a smaller micro-batch).
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_memguard.core.units import size_formatter

OPTIMIZER_SHARE = 1 / 3  # optimizer state above this share of the peak is the thing to shrink
OUTSIDE = ""  # the name of code outside every module (the loss, functional code in training_step)


def enclosing_blocks(modules: Sequence[str], blocks: Sequence[str]) -> list[str]:
    """The blocks (in ``blocks``' order) that are, or hold, one of ``modules``.

    Example:
        >>> enclosing_blocks(["layer1.0.conv1", "fc", "layer2.1"], ["layer1.0", "layer1.1", "layer2.1"])
        ['layer1.0', 'layer2.1']
    """
    return [b for b in blocks if any(m == b or m.startswith(b + ".") for m in modules)]


def checkpoint_fix(top: Sequence[str], blocks: Sequence[str], plain: bool = False) -> str | None:
    """The top modules sit in blocks that ``checkpoint_blocks`` finds: checkpoint those, by the names the model
    gives them (``plain``: a plain ``nn.Module``'s names, checkpointed with ``checkpoint_blocks``; else a
    LightningModule's, with ``ActivationCheckpointing``).

    Example:
        >>> print(checkpoint_fix(["layer1.0.conv1"], ["layer1.0", "layer1.1"]))  # doctest: +NORMALIZE_WHITESPACE
        checkpoint the blocks holding them (layer1.0): ActivationCheckpointing(units=["layer1.0"]), or every block
        with ActivationCheckpointing()
        >>> checkpoint_fix(["head"], ["layer1.0"]) is None
        True
        >>> checkpoint_fix(["layer1.0.conv1"], ["layer1.0"], plain=True).endswith('units=["layer1.0"])')
        True
    """
    found = enclosing_blocks(top, blocks)
    if not found:
        return None
    quoted = ", ".join(f'"{b}"' for b in found)
    if plain:
        return f"checkpoint the blocks holding them ({', '.join(found)}): checkpoint_blocks(model, units=[{quoted}])"
    return (
        f"checkpoint the blocks holding them ({', '.join(found)}): ActivationCheckpointing(units=[{quoted}]), or"
        " every block with ActivationCheckpointing()"
    )


def vocabulary_fix(top: Sequence[str], vocabularies: Sequence[str]) -> str | None:
    """A Linear of a vocabulary's size (32k outputs or more) whose logits, kept by the loss outside the modules or
    by the layers after it, are among the largest: the fused loss, which computes the loss and its gradients chunk by
    chunk and never builds the logits whole (the calls that run it, for a Hugging Face model and for one's own
    training step), then the levers' planner for what holds the peak after it.

    Example:
        >>> print(vocabulary_fix(["", "blocks.0.mlp"], ["lm_head"]))  # doctest: +NORMALIZE_WHITESPACE
        the logits of lm_head and their loss: compute the loss without building the logits, apply_fused_loss(model)
        for a Hugging Face model (its own forward(labels=...), the same loss), or in a training_step
        fused_linear_cross_entropy(hidden, model.lm_head.weight, labels, shift=True) on the hidden states before
        lm_head; then plan_levers(model, batch, memory_budget=...) chooses among checkpointing and offload for what
        holds the peak after it
        >>> vocabulary_fix(["blocks.0.mlp"], ["lm_head"]) is None, vocabulary_fix([""], []) is None
        (True, True)
    """
    if not vocabularies or not any(m == OUTSIDE or m in vocabularies for m in top):
        return None
    head = vocabularies[0]
    return (
        f"the logits of {', '.join(vocabularies)} and their loss: compute the loss without building the logits,"
        " apply_fused_loss(model) for a Hugging Face model (its own forward(labels=...), the same loss), or in a"
        f" training_step fused_linear_cross_entropy(hidden, model.{head}.weight, labels, shift=True) on the hidden"
        f" states before {head}; then plan_levers(model, batch, memory_budget=...) chooses among checkpointing and"
        " offload for what holds the peak after it"
    )


def optimizer_fix(optimizer: int, peak: int) -> str | None:
    """Optimizer state above a third of the peak: a lighter state or sharding.

    Example:
        >>> optimizer_fix(40, 100) is not None, optimizer_fix(30, 100) is None
        (True, True)
    """
    if peak <= 0 or optimizer <= peak * OPTIMIZER_SHARE:
        return None
    return (
        f"the optimizer state holds {optimizer / peak:.0%} of the peak: a lighter state (8-bit Adam, SGD with"
        " momentum) or sharding it over the GPUs (FSDPStrategy, ModelParallelStrategy)"
    )


def resting_fix(resting: int, capacity: int | None, others: int = 0) -> str | None:
    """Weights, gradients and optimizer state (``resting``) that alone, or beside other processes' ``others``, fill
    the card: no micro-batch fits and checkpointing frees nothing they hold; a lighter state, a smaller model or
    sharding.

    Example:
        >>> print(resting_fix(134, 100))  # doctest: +NORMALIZE_WHITESPACE
        weights, gradients and optimizer state alone hold 134 B of the card's 100 B, before any activation: no
        micro-batch fits and checkpointing frees none of it. Shrink what holds it: a lighter optimizer state (SGD
        without momentum, 8-bit Adam: bitsandbytes), a smaller model or weights in lower precision, or sharding
        weights, gradients and optimizer state over several GPUs (FSDPStrategy, ModelParallelStrategy)
        >>> resting_fix(60, 100) is None, resting_fix(60, 100, others=40) is None, resting_fix(60, None) is None
        (True, False, True)
    """
    if capacity is None or resting + others < capacity:
        return None
    size = size_formatter(capacity, 2)
    beside = f", beside other processes' {size(others)}," if others and resting < capacity else ""
    return (
        f"weights, gradients and optimizer state alone hold {size(resting)}{beside} of the card's {size(capacity)},"
        " before any activation: no micro-batch fits and checkpointing frees none of it. Shrink what holds it: a"
        " lighter optimizer state (SGD without momentum, 8-bit Adam: bitsandbytes), a smaller model or weights in"
        " lower precision, or sharding weights, gradients and optimizer state over several GPUs (FSDPStrategy,"
        " ModelParallelStrategy)"
    )


def others_fix(own: int, others: int, capacity: int | None) -> str | None:
    """Other processes hold memory without which this process's peak (``own``) would fit the card: theirs is the
    cause.

    Example:
        >>> print(others_fix(40, 70, 100))  # doctest: +NORMALIZE_WHITESPACE
        other processes hold 70 B of the card's 100 B: this process's peak of 40 B would fit without them. Free
        that memory (end those processes, see nvidia-smi) or run on a GPU of its own (CUDA_VISIBLE_DEVICES)
        >>> others_fix(40, 50, 100) is None, others_fix(120, 70, 100) is None
        (True, True)
    """
    if capacity is None or others <= 0 or own + others <= capacity or own > capacity:
        return None
    size = size_formatter(capacity, 2)
    return (
        f"other processes hold {size(others)} of the card's {size(capacity)}: this process's peak of {size(own)}"
        " would fit without them. Free that memory (end those processes, see nvidia-smi) or run on a GPU of its"
        " own (CUDA_VISIBLE_DEVICES)"
    )


def micro_batch_fix(advice: str | None = None) -> str:
    """A smaller micro-batch, with MemGuard's own figures where a run gave them.

    Example:
        >>> micro_batch_fix().startswith("a smaller micro-batch")
        True
    """
    fix = "a smaller micro-batch with gradient accumulation for the same effective batch (AccumulationTuner)"
    return f"{fix}. {advice}" if advice else fix


def fixes(
    top: Sequence[str],
    blocks: Sequence[str],
    vocabularies: Sequence[str],
    optimizer: int,
    peak: int,
    advice: str | None = None,
    shares: Sequence[float] | None = None,
    cause: Sequence[str] = (),
    plain: bool = False,
) -> list[str]:
    """Every fix that applies, the one whose target holds the largest share of the peak first (``shares``: each top
    module's share, in ``top``'s order; without them, in the rules' order); the smaller micro-batch always last.
    ``cause``: :func:`others_fix` and :func:`resting_fix` where they apply, first; where the resting state fills the
    card, they are the only fixes. ``plain``: the names are a plain model's (:func:`checkpoint_fix`).

    Example:
        >>> fixes(["layer1.0.conv1"], ["layer1.0"], [], 0, 100)[0].startswith("checkpoint the blocks")
        True
        >>> len(fixes(["fc"], [], [], 0, 100))
        1
        >>> first = fixes(["", "h.0.mlp"], ["h.0"], ["lm_head"], 0, 100, shares=[0.6, 0.02])[0]
        >>> first.startswith("the logits of lm_head")  # the loss's 60 % before a block's 2 %
        True
    """
    if any(c.startswith("weights, gradients and optimizer state alone") for c in cause):
        return list(cause)
    weight = dict(zip(top, shares, strict=True)) if shares is not None else {}
    in_blocks = sum(weight.get(m, 0.0) for m in top if enclosing_blocks([m], blocks))
    at_vocabulary = sum(weight.get(m, 0.0) for m in top if m == OUTSIDE or m in vocabularies)
    found = [
        (in_blocks, checkpoint_fix(top, blocks, plain)),
        (at_vocabulary, vocabulary_fix(top, vocabularies)),
        (optimizer / peak if peak > 0 else 0.0, optimizer_fix(optimizer, peak)),
    ]
    ranked = sorted((f for f in found if f[1] is not None), key=lambda f: -f[0]) if shares is not None else found
    return [*cause, *(f for _, f in ranked if f is not None), micro_batch_fix(advice)]
