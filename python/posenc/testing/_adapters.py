"""Adapters to the canonical calling conventions: hf_rope (a Hugging Face rotary-embedding
module), from_bhld ([batch, heads, seq, head_dim] functions), t5_bias (a T5 bucket function and
a table), alibi_bias (BLOOM-style slopes times key index builders)."""

import numpy as np

from ._frameworks import _is_tensor, _to_numpy, _torch


def _canonical(fn, name):
    fn._posenc_canonical = True
    fn.__name__ = name
    return fn


def hf_rope(rotary_emb, apply_rotary_pos_emb=None):
    """Adapts a Hugging Face rotary-embedding module to check_rope's fn(x, positions).

    rotary_emb: a module (or function) called as rotary_emb(x, position_ids) -> (cos, sin), x of
    layout [batch, heads, seq, head_dim] and position_ids [batch, seq] (LlamaRotaryEmbedding and
    the classes copied from it; transformers' convention), or a pair (cos_table, sin_table) of
    [max_positions, R] tensors indexed by position (a cos/sin cache). apply_rotary_pos_emb: the
    model's
    function (q, k, cos, sin) -> (q_embed, k_embed) on [batch, heads, seq, head_dim] tensors;
    default: rotate_half. Either way only the first cos.shape[-1] dims are rotated and the rest
    pass through (the partial rotary of the Phi / GPT-NeoX modeling code). Returns the canonical
    fn (torch).
    """
    import torch

    def fn(x, positions):
        xb = x.transpose(1, 2)
        pid = positions if positions.dim() == 2 else positions[None].expand(x.shape[0], -1)
        if isinstance(rotary_emb, (tuple, list)):
            cos, sin = (t[pid].to(x.dtype) for t in rotary_emb)
        else:
            cos, sin = rotary_emb(xb, pid)
        r = cos.shape[-1]
        xr, xp = xb[..., :r], xb[..., r:]  # partial rotary: the model rotates the first r dims
        if apply_rotary_pos_emb is not None:
            yr = apply_rotary_pos_emb(xr, xr, cos, sin)[0]
        else:
            c, s = cos.unsqueeze(1), sin.unsqueeze(1)
            rot = torch.cat((-xr[..., r // 2:], xr[..., :r // 2]), dim=-1)
            yr = xr * c + rot * s
        yb = torch.cat((yr, xp), dim=-1) if xp.shape[-1] else yr
        return yb.transpose(1, 2)
    fn._posenc_framework = "torch"
    what = "cos/sin table" if isinstance(rotary_emb, (tuple, list)) else type(rotary_emb).__name__
    return _canonical(fn, f"hf_rope({what})")


def from_bhld(fn):
    """Adapts a function on PyTorch's [batch, heads, seq, head_dim] layout to the canonical
    [batch, seq, heads, head_dim] one: every 4-D array / tensor argument is transposed (axes 1
    and 2, a view) before the call, and a 4-D result (or the first element of a tuple) after.
    Works for RoPE functions fn(x, positions) and attention functions fn(q, k, v, ...)."""
    def t(a):
        if _is_tensor(a) and a.dim() == 4:
            return a.transpose(1, 2)
        if isinstance(a, np.ndarray) and a.ndim == 4:
            return a.transpose(0, 2, 1, 3)
        return a

    def wrapped(*args, **kwargs):
        y = fn(*[t(a) for a in args], **kwargs)
        if isinstance(y, tuple):
            return (t(y[0]),) + tuple(y[1:])
        return t(y)
    return _canonical(wrapped, f"from_bhld({getattr(fn, '__name__', type(fn).__name__)})")


def t5_bias(bucket_fn, table, *, bidirectional=True, num_buckets=None, max_distance=128):
    """Adapts a T5 bucket function to check_bias's fn(q_len, k_len, heads): bias[h, i, j] =
    table[bucket_fn(rel), h], rel = pos_k - pos_q with query i at k_len - q_len + i.

    bucket_fn(relative_position, bidirectional=..., num_buckets=..., max_distance=...) (the
    signature of transformers' T5Attention._relative_position_bucket) on an int64 tensor (torch
    installed) or array. table: [num_buckets, heads]; pass the same table to check_bias as
    params={'relative_attention_bias': table}."""
    tab = table.detach().cpu().numpy() if _is_tensor(table) else np.asarray(table)
    nb = int(num_buckets or tab.shape[0])

    def fn(q_len, k_len, heads):
        qp = np.arange(q_len) + (k_len - q_len)
        rel = np.arange(k_len)[None, :] - qp[:, None]
        t = _torch()
        r = t.from_numpy(rel.astype(np.int64)) if t is not None else rel
        b = bucket_fn(r, bidirectional=bidirectional, num_buckets=nb, max_distance=max_distance)
        b = _to_numpy(b).astype(np.int64)
        return np.moveaxis(tab[b], -1, 0)
    return _canonical(fn, f"t5_bias({getattr(bucket_fn, '__name__', 'bucket_fn')})")


def alibi_bias(builder):
    """Adapts a BLOOM-style ALiBi builder, builder(attention_mask [batch, k_len], heads) ->
    [batch·heads, 1, k_len] (slopes times key index, relying on softmax's invariance to a
    per-row constant), to check_bias's fn(q_len, k_len, heads). Check it with causal=True,
    softmax_invariant=True (the form equals ALiBi only on the visible keys, up to a per-row
    constant)."""
    def fn(q_len, k_len, heads):
        t = _torch()
        mask = t.ones((1, k_len), dtype=t.long) if t is not None else np.ones((1, k_len), np.int64)
        a = builder(mask, heads)
        if _is_tensor(a):  # keep the builder's dtype: the tolerance follows it
            return a.reshape(heads, 1, k_len).expand(heads, q_len, k_len)
        return np.broadcast_to(np.asarray(a).reshape(heads, 1, k_len), (heads, q_len, k_len))
    return _canonical(fn, f"alibi_bias({getattr(builder, '__name__', 'builder')})")
