"""A linear layer and a cross-entropy in one: the loss of ``hidden @ weight.T`` without the whole logits.

A language model's logits (tokens x vocabulary, float32 for the softmax) are often the largest tensor of its step:
GPT-2's 16 x 1024 tokens times 50,257 words is 3.3 GB in float32, and the plain loss keeps a copy of that size for
backward. :func:`fused_linear_cross_entropy` walks the tokens in chunks; for each chunk it builds that chunk's
logits, adds its share of the loss and, in the same pass, the gradients of ``hidden``, ``weight`` and ``bias``; it
keeps only those gradients (the size of ``hidden`` and of ``weight``) and scales them in backward by the loss's
upstream gradient. Nothing is recomputed (``docs/levers.md``).

Two implementations, one semantics (``torch.nn.functional.cross_entropy``'s):

- ``"chunked"``: this module's own, on every torch this library supports: on CUDA each chunk's softmax and gradient
  is one launch of a Triton kernel (:mod:`._loss_kernel`: two passes over the chunk's logits in the autocast dtype,
  the gradient written in their place; measured on an H100 the head with it took 0.74x the plain head's time at
  GPT-2's vocabulary), elsewhere, under ``torch.compile`` and with a soft cap or logit scale PyTorch's operations in
  float32;
- ``"torch"``: ``torch.nn.functional.linear_cross_entropy`` with chunking options, where the installed torch has it
  (2.13 and later). It computes the gradients in the forward as well, but it has no label smoothing, soft cap or
  logit scale, and under autocast it returns the loss and the head's gradient in the autocast dtype.

``"chunked"`` takes the counted tokens' rows only through the head (:func:`counted_rows`): the ignored ones (a
masked language model's 85 %, a prompt's tokens) cost nothing but a gather; where they are few (under
:data:`LEFT_OUT_FROM` of the rows) they stay, masked. Knowing how many count costs one device sync per call;
``counted_only=False`` skips it (every row goes through the head, the ignored ones masked).

``"auto"`` picks ``"chunked"``: measured on the CPU with torch 2.14 (``tests/levers/test_levers_fused_loss.py`` holds
the probe), torch's keeps exactly as many bytes after the forward (the two gradients, in float32, or in bf16 under
bf16 autocast), but under autocast it rounds the loss to bf16 and, on CUDA, sums the head's gradient across chunks
in bf16, and where no token is counted (a micro-batch of prompt tokens only) its gradients are nan where
``F.cross_entropy``'s are zero; ``"torch"`` is used only when asked for.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_memguard import _compiler

DEFAULT_CHUNK_TOKENS = 2048
"""Tokens per chunk: each chunk's float32 logits take ``chunk_tokens x vocabulary x 4`` bytes (411 MB for GPT-2)."""

LEFT_OUT_FROM = 1 / 64
"""The share of ignored rows from which :func:`counted_rows` leaves them out of the head. Fewer (a causal model's last
position, 1 row in a sequence's 1,024) stay, masked in the chunks: copying the counted rows and scattering their
gradient back costs more than the head's work on them. On an H100, GPT-2's head alone at 16 x 1024 tokens, with the
count and the copy: 35.9 ms and 0.518 GB; with neither (``counted_only=False``): 35.5 ms and 0.467 GB; with this
rule (the count kept, the copy left out; and :data:`PAD_WORDS`): 10.84 ms and 0.468 GB, against 10.76 ms and 0.468 GB
with neither (``benchmarks/fused_loss.py``)."""

PAD_WORDS = 64
"""Where the Triton kernel computes the chunks, the head's rows are padded with zeros to a multiple of this many
words: a vocabulary that is not a multiple of 8 (GPT-2's 50,257, BERT's 30,522, Whisper's 51,865) gives every
chunk's matrix products a row stride that cuBLAS's fast kernels cannot take. The padded words' logits are zero, the
kernel leaves them out of the softmax, and their gradients are dropped: the result is the unpadded head's, to
rounding (``benchmarks/fused_loss.py``'s ``fused_unpadded`` row measures it without). 1: no padding."""

Implementation = Literal["auto", "chunked", "torch"]


def has_torch_linear_cross_entropy() -> bool:
    """Whether the installed torch has ``torch.nn.functional.linear_cross_entropy`` (2.13 and later)."""
    return hasattr(F, "linear_cross_entropy") and hasattr(torch.nn, "LinearCrossEntropyOptions")


def fused_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    bias: Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: Literal["mean", "sum"] = "mean",
    shift: bool = False,
    logit_scale: float | None = None,
    softcap: float | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    implementation: Implementation = "auto",
    counted_only: bool = True,
) -> Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias), labels)`` without building the logits whole.

    The loss and the gradients of ``hidden``, ``weight`` and ``bias`` are those of the plain computation: tokens
    labelled ``ignore_index`` count for nothing, ``"mean"`` divides by the tokens counted (a batch with none gives
    ``nan``, and zero gradients, as ``F.cross_entropy`` does), ``label_smoothing`` mixes in the uniform
    distribution. Under autocast the matmuls run in the autocast dtype, as ``F.linear`` would, and the softmax, the
    sums and the head's gradient in float32. A weight shared with the input embedding (GPT-2's ``wte``) receives
    both gradients, as autograd adds them.

    Args:
        hidden: the head's input, ``(..., features)``; ``(batch, sequence, features)`` when ``shift``.
        weight: the head's weight, ``(vocabulary, features)`` (``nn.Linear``'s layout).
        labels: class indices, the shape of ``hidden`` without its last dimension.
        bias: the head's bias, ``(vocabulary,)``, or None.
        ignore_index: the label of tokens that count for nothing.
        label_smoothing: in [0, 1], as ``F.cross_entropy``'s.
        reduction: ``"mean"`` over the tokens counted, or ``"sum"``.
        shift: a causal language model's rule: the token at position ``t`` predicts the label at ``t + 1`` (the
            last position predicts nothing), as Hugging Face's causal models shift their labels.
        logit_scale: multiplies the logits before the softmax (a family's ``logit_scale``), or None.
        softcap: ``softcap * tanh(logits / softcap)`` before the softmax (a family's final logit soft cap), or None.
        chunk_tokens: tokens per chunk; the transient memory is about four chunks of float32 logits.
        implementation: ``"chunked"`` (this library's), ``"torch"`` (``F.linear_cross_entropy``, torch 2.13 and
            later, without smoothing, scale or cap), or ``"auto"`` (``"chunked"``: see the module's notes).
        counted_only: ``"chunked"`` takes only the counted tokens' rows through the head, which costs one device
            sync to count them; False takes every row (the ignored ones masked in the chunks), with no sync: for a
            step that must not wait on the device, or rows the caller has already left out (:func:`counted_rows`).

    Returns:
        The loss, a float32 scalar.

    Raises:
        ValueError: for a shape, reduction, smoothing, scale, cap, chunk size or implementation it does not
            support, quoting the value; for a sharded ``weight``, ``hidden`` or ``bias`` (a ``DTensor``: FSDP2's
            ``fully_shard`` outside the head's forward, or tensor parallelism), naming what to do instead.

    Example:
        >>> import torch
        >>> from lightning_memguard import fused_linear_cross_entropy
        >>> hidden = torch.randn(2, 8, 16, requires_grad=True)
        >>> head = torch.nn.Linear(16, 100, bias=False)
        >>> labels = torch.randint(0, 100, (2, 8))
        >>> loss = fused_linear_cross_entropy(hidden, head.weight, labels, shift=True)
        >>> plain = torch.nn.functional.cross_entropy(head(hidden)[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        >>> torch.allclose(loss, plain)
        True
    """
    _refuse_sharded(weight=weight, hidden=hidden, bias=bias)
    _check(hidden, weight, labels, bias, label_smoothing, reduction, shift, logit_scale, softcap, chunk_tokens)
    if implementation not in ("auto", "chunked", "torch"):
        raise ValueError(f"`implementation` must be 'auto', 'chunked' or 'torch', got {implementation!r}")
    if not isinstance(counted_only, bool):
        raise ValueError(f"`counted_only` must be a bool, got {counted_only!r}")
    if shift:  # as Hugging Face's causal losses: pad the labels with ignore_index and move them one to the left
        labels = torch.cat([labels[..., 1:], labels.new_full((*labels.shape[:-1], 1), ignore_index)], dim=-1)
    features = hidden.shape[-1]
    flat_hidden, flat_labels = hidden.reshape(-1, features), labels.reshape(-1)
    device_type = hidden.device.type
    autocast_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
    if implementation == "torch":
        if not has_torch_linear_cross_entropy():
            raise ValueError(
                f"`implementation='torch'` needs torch.nn.functional.linear_cross_entropy (torch 2.13 and later); "
                f"torch {torch.__version__} has none"
            )
        unsupported = {"label_smoothing": label_smoothing, "logit_scale": logit_scale, "softcap": softcap}
        for name, value in unsupported.items():
            if value not in (None, 0.0):
                raise ValueError(f"`implementation='torch'` has no {name}; got `{name}={value!r}`")
        return _torch_loss(
            flat_hidden, weight, flat_labels, bias, ignore_index, reduction, chunk_tokens, autocast_dtype
        )
    if counted_only:
        flat_hidden, flat_labels = counted_rows(flat_hidden, flat_labels, ignore_index)
    compute_dtype = autocast_dtype or torch.promote_types(hidden.dtype, weight.dtype)
    settings = _Settings(ignore_index, label_smoothing, reduction, logit_scale, softcap, chunk_tokens, compute_dtype)
    settings.kernel = _kernel_runs(hidden, settings)
    if not torch.is_grad_enabled():  # no graph: the loss alone, no gradients computed
        with torch.no_grad():
            return _chunks(flat_hidden, weight, bias, flat_labels, settings, (False, False, False))[0]
    loss: Tensor = _ChunkedLoss.apply(flat_hidden, weight, bias, flat_labels, settings)
    return loss


def counted_rows(hidden: Tensor, labels: Tensor, ignore_index: int = -100) -> tuple[Tensor, Tensor]:
    """The rows of the counted tokens alone, ``(counted, features)`` and ``(counted,)``, where at least
    :data:`LEFT_OUT_FROM` of them are ignored: the head's matmuls and softmax are then done for those only (a masked
    language model counts about 15 % of its tokens, instruction tuning its answers only); fewer ignored rows come back
    with the rest, for the chunks to mask. ``hidden`` is ``(..., features)``, ``labels`` its shape without the last
    dimension; they come back flattened. Autograd scatters the rows' gradient back into ``hidden``'s shape, zero on
    the ignored rows, as the plain loss gives.

    It costs one device sync (to know how many tokens count); not done while ``torch.compile`` traces or a CUDA
    graph is captured, where no shape may depend on the data: the rows then come back all, flattened, and the chunks
    mask the ignored tokens instead."""
    hidden, labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    if _compiler.compiling() or (hidden.is_cuda and torch.cuda.is_current_stream_capturing()):
        return hidden, labels
    rows = (labels != ignore_index).nonzero().squeeze(1)
    if len(labels) - len(rows) < len(labels) * LEFT_OUT_FROM:
        return hidden, labels
    return hidden.index_select(0, rows), labels.index_select(0, rows)


def _refuse_sharded(**tensors: Tensor | None) -> None:
    """Refuse a ``DTensor`` (a sharded parameter, a tensor-parallel input) by name: the chunks need the whole head
    on every rank, and the gradients they compute in the forward would bypass the sharded parameter's reduction.

    FSDP2's ``fully_shard`` (Lightning's ``ModelParallelStrategy``) leaves a parameter sharded outside the forward of
    the module that owns it, and gathers it, as a plain tensor, for that forward; a tensor-parallel head
    (``ColwiseParallel``) stays sharded inside its forward too."""
    for name, tensor in tensors.items():
        if isinstance(tensor, DTensor):
            raise ValueError(
                f"fused_linear_cross_entropy: `{name}` is a DTensor (placements {tuple(tensor.placements)} on a mesh "
                f"of {tensor.device_mesh.size()} ranks), as FSDP2's fully_shard or tensor parallelism (Lightning's "
                "ModelParallelStrategy) leave a sharded parameter; the fused loss needs the whole head on every rank. "
                "Under fully_shard, call it inside the forward of the module that holds the head, where the weight is "
                "gathered (apply_fused_loss does so for a Hugging Face model; or call the head through a module of "
                "yours whose forward computes the loss); a tensor-parallel head is not supported: leave it out of "
                "the tensor-parallel plan, or use the plain loss"
            )


def _check(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    bias: Tensor | None,
    label_smoothing: float,
    reduction: str,
    shift: bool,
    logit_scale: float | None,
    softcap: float | None,
    chunk_tokens: int,
) -> None:
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"`weight` must be (vocabulary, {hidden.shape[-1]}) for `hidden` of shape {tuple(hidden.shape)}, "
            f"got {tuple(weight.shape)}"
        )
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"`labels` must have the shape of `hidden` without its last dimension, {tuple(hidden.shape[:-1])}, "
            f"got {tuple(labels.shape)}"
        )
    if labels.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"`labels` must hold class indices (int64), got {labels.dtype}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"`bias` must be ({weight.shape[0]},), got {tuple(bias.shape)}")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"`reduction` must be 'mean' or 'sum', got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"`label_smoothing` must be in [0, 1], got {label_smoothing!r}")
    if shift and hidden.dim() < 3:
        raise ValueError(f"`shift=True` needs `hidden` of shape (batch, sequence, features), got {tuple(hidden.shape)}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"`softcap` must be positive or None, got {softcap!r}")
    if logit_scale is not None and not isinstance(logit_scale, int | float):
        raise ValueError(f"`logit_scale` must be a number or None, got {logit_scale!r}")
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"`chunk_tokens` must be a positive int, got {chunk_tokens!r}")


class _Settings:
    """What a chunked loss computes besides its tensors (one object, so autograd sees a single non-tensor input)."""

    __slots__ = (
        "chunk_tokens",
        "compute_dtype",
        "kernel",
        "ignore_index",
        "label_smoothing",
        "logit_scale",
        "reduction",
        "softcap",
    )

    def __init__(
        self,
        ignore_index: int,
        label_smoothing: float,
        reduction: str,
        logit_scale: float | None,
        softcap: float | None,
        chunk_tokens: int,
        compute_dtype: torch.dtype,
    ) -> None:
        self.ignore_index = ignore_index
        self.label_smoothing = float(label_smoothing)
        self.reduction = reduction
        self.logit_scale = logit_scale
        self.softcap = softcap
        self.chunk_tokens = chunk_tokens
        self.compute_dtype = compute_dtype
        self.kernel = False  # the chunks' softmax and gradient by the Triton kernel (:func:`_kernel_runs`)


def _chunks(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    labels: Tensor,
    settings: _Settings,
    needs: tuple[bool, bool, bool],
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """The loss and the gradients ``needs`` asks for (of hidden, weight, bias), for an upstream gradient of 1."""
    dtype, smoothing, vocabulary = settings.compute_dtype, settings.label_smoothing, weight.shape[0]
    with torch.autocast(hidden.device.type, enabled=False):
        counted = labels != settings.ignore_index
        count = counted.sum()
        # mean: each token's gradient is divided by the tokens counted; none counted: zero gradients (and a nan loss)
        per_token = (
            1.0 / count.clamp(min=1).float() if settings.reduction == "mean" else torch.ones((), device=count.device)
        )
        words = -(-vocabulary // PAD_WORDS) * PAD_WORDS if settings.kernel else vocabulary  # the head's rows
        w = _rows(weight, dtype, words)
        b = None if bias is None else _rows(bias, dtype, words)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        # kept in the compute dtype, as the plain head's backward makes them: under autocast half the bytes
        grad_hidden = torch.empty(hidden.shape, dtype=dtype, device=hidden.device) if needs[0] else None
        grad_weight = torch.zeros(w.shape, dtype=torch.float32, device=weight.device) if needs[1] else None
        grad_bias = torch.zeros(words, dtype=torch.float32, device=weight.device) if needs[2] else None
        for start in range(0, hidden.shape[0], settings.chunk_tokens):
            end = min(start + settings.chunk_tokens, hidden.shape[0])
            h = hidden[start:end].to(dtype)
            mask = counted[start:end]
            target = torch.where(mask, labels[start:end], 0).unsqueeze(1)
            logits = F.linear(h, w, b)  # the same op and dtype as the plain head's under autocast
            terms = None
            if settings.kernel and any(needs):
                terms = _softmax_gradient(logits, target, mask.float() * per_token, smoothing, vocabulary)
            if terms is not None:  # the kernel: the loss's terms, and the gradient in the logits' place
                lse, picked, row_sum = terms
                loss = _smoothed(lse - picked, lse, row_sum / vocabulary, smoothing)
                total = total + torch.where(mask, loss, 0.0).sum()
                if grad_bias is not None:
                    grad_bias += logits.sum(dim=0, dtype=torch.float32)
                low = logits
            else:  # PyTorch's operations, in float32, on the words alone (a kernel that failed left the padding)
                logits = logits[:, :vocabulary].float()
                if settings.logit_scale is not None:
                    logits = logits * settings.logit_scale
                capped = None
                if settings.softcap is not None:
                    capped = torch.tanh(logits / settings.softcap)
                    logits = capped * settings.softcap
                lse = torch.logsumexp(logits, dim=1)
                loss = _smoothed(lse - logits.gather(1, target).squeeze(1), lse, logits.mean(dim=1), smoothing)
                total = total + torch.where(mask, loss, 0.0).sum()
                if not any(needs):
                    continue
                grad = torch.exp(logits.sub_(lse.unsqueeze(1)))  # the softmax, in the logits' memory
                grad.scatter_add_(1, target, torch.full_like(target, -(1.0 - smoothing), dtype=grad.dtype))
                if smoothing:
                    grad.sub_(smoothing / vocabulary)
                grad.mul_((mask.float() * per_token).unsqueeze(1))
                if capped is not None:
                    grad.mul_(1.0 - capped * capped)
                if settings.logit_scale is not None:
                    grad.mul_(settings.logit_scale)
                if grad_bias is not None:
                    grad_bias[:vocabulary] += grad.sum(dim=0)
                low = grad.to(dtype)
            used = low.shape[1]  # the head's rows this chunk's gradient has: padded or the words alone
            if grad_hidden is not None:
                grad_hidden[start:end] = low @ w[:used]
            if grad_weight is not None:
                rows = grad_weight[:used]
                if low.is_cuda and low.dtype != rows.dtype and not _compiler.compiling():
                    torch.addmm(rows, low.t(), h, out_dtype=rows.dtype, out=rows)  # float32 sum
                else:
                    rows += (low.t() @ h).float()
        loss_value = total / count.float() if settings.reduction == "mean" else total
    return (
        loss_value,
        grad_hidden,
        None if grad_weight is None else grad_weight[:vocabulary].to(dtype),
        None if grad_bias is None or bias is None else grad_bias[:vocabulary].to(dtype),
    )


def _rows(tensor: Tensor, dtype: torch.dtype, rows: int) -> Tensor:
    """``tensor`` in ``dtype``, padded with zero rows to ``rows`` (the head's weight or bias, :data:`PAD_WORDS`)."""
    if rows == tensor.shape[0]:
        return tensor.to(dtype)
    padded = tensor.new_zeros((rows, *tensor.shape[1:]), dtype=dtype)
    padded[: tensor.shape[0]] = tensor
    return padded


def _smoothed(loss: Tensor, lse: Tensor, mean: Tensor, smoothing: float) -> Tensor:
    """Each token's loss with label smoothing: ``(1 - s) * loss + s * (lse - mean of its logits)``."""
    return (1.0 - smoothing) * loss + smoothing * (lse - mean) if smoothing else loss


_BLOCK = 4096
"""Words per step of the kernel's loop over a row."""

_failed: list[str] = []  # why the kernel could not run here, once it has failed: from then on, PyTorch's kernels


def _kernel_runs(tensor: Tensor, settings: _Settings) -> bool:
    """Whether the Triton kernel computes the chunks' softmax and gradient: on CUDA with Triton (or in Triton's CPU
    interpreter), not where ``torch.compile`` traces the loss (it compiles PyTorch's operations itself), without a
    soft cap or logit scale (which PyTorch's operations apply), until it has once failed."""
    if _compiler.compiling() or _failed or settings.softcap is not None or settings.logit_scale is not None:
        return False
    return _compiler.triton_runs_on(tensor)


@functools.cache
def _kernel() -> Any:
    """The Triton kernel, defined when first needed (under Triton's interpreter if ``TRITON_INTERPRET=1`` then)."""
    return _compiler.triton_module("lightning_memguard.levers._loss_kernel").softmax_gradient


def _softmax_gradient(
    logits: Tensor, target: Tensor, scale: Tensor, smoothing: float, vocabulary: int
) -> tuple[Tensor, Tensor, Tensor] | None:
    """A chunk's log-sum-exp, target logit and (with smoothing) sum of logits per token, in float32, by the Triton
    kernel in one launch, ``logits`` overwritten with the loss's gradient, row by row
    ``(softmax - (1 - smoothing) * onehot(target) - smoothing / vocabulary) * scale``, in the logits' dtype. Only the
    first ``vocabulary`` columns are words (the rest are :data:`PAD_WORDS`' padding, left as they are).

    None, ``logits`` untouched, once the kernel has failed to build or run (with one warning): PyTorch's operations
    then compute the chunk."""
    if _failed:
        return None
    rows = logits.shape[0]
    picked = logits.gather(1, target).squeeze(1).float()  # before the kernel writes over it
    lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    row_sum = torch.empty_like(lse) if smoothing else lse  # not written without smoothing
    keep, share = 1.0 - smoothing, smoothing / vocabulary
    try:
        _kernel()[(rows,)](
            logits, logits.stride(0), target.squeeze(1), scale, lse, row_sum, vocabulary, keep, share,
            SMOOTHING=bool(smoothing), BLOCK=_BLOCK,
        )  # fmt: skip
    except Exception as err:  # Triton cannot build or run it for this GPU: PyTorch's operations, and say so once
        _failed.append(f"{type(err).__name__}: {err}")
        warnings.warn(
            f"lightning-memguard: the fused loss's kernel cannot run here ({_failed[0][:200]}); computing its"
            " chunks with PyTorch's own operations instead (same result, slower)",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    return lse, picked, row_sum


class _ChunkedLoss(torch.autograd.Function):
    """The loss in the forward, with its gradients; backward scales them by the upstream gradient. Only the
    gradients are saved (through ``save_for_backward``, so saved-tensor hooks see them), never the logits."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, settings: _Settings
    ) -> Tensor:
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])
        loss, grad_hidden, grad_weight, grad_bias = _chunks(hidden, weight, bias, labels, settings, needs)
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        grads = (grad_hidden, grad_weight, grad_bias)
        scaled = [None if g is None else (g * grad_output).to(d) for g, d in zip(grads, ctx.dtypes, strict=True)]
        return scaled[0], scaled[1], scaled[2], None, None


def _torch_loss(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    bias: Tensor | None,
    ignore_index: int,
    reduction: str,
    chunk_tokens: int,
    autocast_dtype: torch.dtype | None,
) -> Tensor:
    """``F.linear_cross_entropy`` with chunks of ``chunk_tokens``; under autocast on inputs cast as ``F.linear``'s."""
    options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=chunk_tokens, chunking_method=None)
    with torch.autocast(hidden.device.type, enabled=False):
        if autocast_dtype is not None:
            hidden, weight = hidden.to(autocast_dtype), weight.to(autocast_dtype)
            bias = None if bias is None else bias.to(autocast_dtype)
        loss: Tensor = F.linear_cross_entropy(
            hidden, weight, labels, linear_bias=bias, reduction=reduction, ignore_index=ignore_index, options=options
        )
    return loss.float()
