"""The Triton kernel behind the fused loss's chunks (:mod:`.fused_loss`); imported only where Triton is installed
(so not collected by pytest)."""

import triton
import triton.language as tl


@triton.jit
def softmax_gradient(
    logits_ptr,
    row_stride,
    target_ptr,
    scale_ptr,
    lse_ptr,
    row_sum_ptr,
    vocabulary: tl.constexpr,  # one build per vocabulary; Triton 3.6's interpreter cannot loop to a scalar argument
    keep,  # 1 - label_smoothing: what the target's one-hot weighs
    share,  # label_smoothing / vocabulary: what every word's uniform share weighs
    SMOOTHING: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One row of logits (one token): its log-sum-exp (and, with smoothing, the sum of its logits) in float32, then
    the row overwritten with ``(softmax - keep * onehot(target) - share) * scale``, rounded to the logits' dtype.

    Two passes over the row: the first reads it for an online maximum and sum of exponentials, the second reads it
    again and writes the gradient in its place."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * row_stride
    top = float("-inf")
    exp_sum = 0.0
    row_sum = 0.0
    for start in range(0, vocabulary, BLOCK):
        columns = start + tl.arange(0, BLOCK)
        inside = columns < vocabulary
        x = tl.load(base + columns, mask=inside, other=float("-inf")).to(tl.float32)
        new_top = tl.maximum(top, tl.max(x, axis=0))
        exp_sum = exp_sum * tl.exp(top - new_top) + tl.sum(tl.exp(x - new_top), axis=0)
        top = new_top
        if SMOOTHING:
            row_sum += tl.sum(tl.where(inside, x, 0.0), axis=0)
    lse = top + tl.log(exp_sum)
    tl.store(lse_ptr + row, lse)
    if SMOOTHING:
        tl.store(row_sum_ptr + row, row_sum)
    target = tl.load(target_ptr + row)
    scale = tl.load(scale_ptr + row)
    for start in range(0, vocabulary, BLOCK):
        columns = start + tl.arange(0, BLOCK)
        inside = columns < vocabulary
        x = tl.load(base + columns, mask=inside, other=0.0)
        gradient = tl.exp(x.to(tl.float32) - lse) - tl.where(columns == target, keep, 0.0) - share
        tl.store(base + columns, (gradient * scale).to(x.dtype), mask=inside)
