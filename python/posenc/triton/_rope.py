"""RoPE of a [batch, seq, heads, head_dim] tensor in one Triton kernel: each element read once
and written once, what the CUDA forms of ``posenc::rope`` and ``rope_half`` run.

The rotation is posenc's (docs/rope.md): pairs (i, i + R/2) (half style) or (2i, 2i + 1)
(interleaved) of the first R dims are rotated by each token's angles, the other dims are copied.
The caller gives the cos and sin tables of the tokens' angles, [1 or batch, seq, R/2] with the
attention factor included (and sin negated for the inverse rotation), in the computing dtype:
float64 for accurate angles, float32 for the frameworks' float32 recipe. The kernel rotates in
that dtype, ``x_i cos - x_j sin`` and ``x_j cos + x_i sin``, and rounds the result once to the
output's dtype (half dtypes from float64 through float32, as PyTorch's conversion does), so it
gives the numbers of the PyTorch form of the same recipe (``posenc._device``). The output may be
x itself (in place): a program reads its rows whole before it writes them.
"""

import torch
import triton
import triton.language as tl

from ._forward import EMULATE_BF16, rotary_pairs, rounded


@triton.jit
def rope_kernel(X, Y, x_stride_b, x_stride_l, x_stride_h, y_stride_b, y_stride_l, y_stride_h,
                heads, seq, head_dim, Cos, Sin, cos_stride_b, ROTARY: tl.constexpr,
                INTERLEAVED: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
                EMULATE_BF16: tl.constexpr):
    """Y = X rotated; grid (row blocks, batch * heads)."""
    b = (tl.program_id(1) // heads).to(tl.int64)  # 64-bit offsets for large tensors
    head = tl.program_id(1) % heads
    rows = tl.program_id(0) * BLOCK_L + tl.arange(0, BLOCK_L)
    row_ok = rows < seq
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < head_dim
    compute = Cos.dtype.element_ty
    x_base = X + b * x_stride_b + head * x_stride_h + rows[:, None].to(tl.int64) * x_stride_l
    ok = row_ok[:, None] & col_ok[None, :]
    x = tl.load(x_base + cols[None, :], mask=ok, other=0.0).to(compute)
    pair, partner, first, rotated = rotary_pairs(cols, ROTARY, INTERLEAVED)
    inside = row_ok[:, None] & rotated[None, :]
    other = tl.load(x_base + partner[None, :], mask=inside, other=0.0).to(compute)
    table = b * cos_stride_b + rows[:, None].to(tl.int64) * (ROTARY // 2) + pair[None, :]
    c = tl.load(Cos + table, mask=inside, other=1.0)
    s = tl.load(Sin + table, mask=inside, other=0.0)
    # x_i cos - x_j sin for the first of a pair, x_j cos + x_i sin for the second: the partner's
    # product negated exactly, then one addition, as the PyTorch form computes them.
    signed = tl.where(first[None, :], -other, other)
    y = tl.where(rotated[None, :], x * c + signed * s, x)
    out = Y.dtype.element_ty
    y_ptr = (Y + b * y_stride_b + head * y_stride_h + rows[:, None].to(tl.int64) * y_stride_l
             + cols[None, :])
    if out == tl.float64:
        tl.store(y_ptr, y.to(tl.float64), mask=ok)
    else:
        tl.store(y_ptr, rounded(y.to(tl.float32), out, EMULATE_BF16), mask=ok)


def rotate(x, cos, sin, rotary_dim, interleaved, out=None, block_l=32):
    """x [batch, seq, heads, head_dim] (unit stride in head_dim) rotated into out (default a new
    tensor like x; may be x). cos, sin: [1 or batch, seq, rotary_dim / 2] on x's device, of the
    computing dtype (float64 or float32), contiguous."""
    if out is None:
        out = torch.empty_like(x)
    if x.numel() == 0:
        return out
    batch, seq, heads, dim = x.shape
    block_d = max(16, triton.next_power_of_2(dim))
    grid = (triton.cdiv(seq, block_l), batch * heads)
    rope_kernel[grid](x, out, *x.stride()[:3], *out.stride()[:3], heads, seq, dim, cos, sin,
                      cos.stride(0) if cos.shape[0] > 1 else 0, ROTARY=rotary_dim,
                      INTERLEAVED=interleaved, BLOCK_L=block_l, BLOCK_D=block_d,
                      EMULATE_BF16=EMULATE_BF16, num_warps=4)
    return out
