"""The Triton kernel behind :mod:`._fused`; imported only where Triton is installed (so not collected by pytest)."""

import triton
import triton.language as tl


@triton.jit
def batch_norm(x_ptr, mean_ptr, invstd_ptr, weight_ptr, bias_ptr, offsets, channel, inside):
    """What training-mode BatchNorm made of x: float32 math, rounded to x's dtype."""
    x = tl.load(x_ptr + offsets, mask=inside, other=0.0)
    mean = tl.load(mean_ptr + channel, mask=inside, other=0.0).to(tl.float32)
    invstd = tl.load(invstd_ptr + channel, mask=inside, other=0.0).to(tl.float32)
    weight = tl.load(weight_ptr + channel, mask=inside, other=0.0).to(tl.float32)
    bias = tl.load(bias_ptr + channel, mask=inside, other=0.0).to(tl.float32)
    return (weight * (x.to(tl.float32) - mean) * invstd + bias).to(x.dtype)


@triton.jit
def bn_relu(
    x_ptr,
    mean_ptr,
    invstd_ptr,
    weight_ptr,
    bias_ptr,
    r_ptr,
    r_mean_ptr,
    r_invstd_ptr,
    r_weight_ptr,
    r_bias_ptr,
    out_ptr,
    n,
    C: tl.constexpr,
    INNER: tl.constexpr,
    IDENTITY: tl.constexpr,  # 0: none, 1: a tensor, 2: BatchNorm of a second tensor
    RELU: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    channel = (offsets // INNER) % C
    y = batch_norm(x_ptr, mean_ptr, invstd_ptr, weight_ptr, bias_ptr, offsets, channel, inside)
    if IDENTITY == 1:
        r = tl.load(r_ptr + offsets, mask=inside, other=0.0)
        y = (y.to(tl.float32) + r.to(tl.float32)).to(y.dtype)
    if IDENTITY == 2:
        z = batch_norm(r_ptr, r_mean_ptr, r_invstd_ptr, r_weight_ptr, r_bias_ptr, offsets, channel, inside)
        y = (y.to(tl.float32) + z.to(tl.float32)).to(y.dtype)
    if RELU:
        y = tl.maximum(y, 0.0).to(y.dtype)
    tl.store(out_ptr + offsets, y, mask=inside)
