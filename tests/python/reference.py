"""An independent, materialized attention for every scheme in plain PyTorch, written from the formulas of docs/.

It shares no code with posenc: full [seq_q, seq_k] score matrices, torch ops only, so autograd
gives its gradients. Used as the oracle of the Python tests (in float64) and as the naive float32
yardstick of their tolerance (the same code in float32).
"""

import math

import torch


def alibi_slopes(heads, max_bias=8.0):
    """docs/alibi.md."""
    def pow2(n):
        return [2.0 ** (-max_bias * h / n) for h in range(1, n + 1)]
    if heads & (heads - 1) == 0:
        return pow2(heads)
    n = 2 ** int(math.floor(math.log2(heads)))
    return pow2(n) + pow2(2 * n)[0::2][: heads - n]


def t5_bucket(rel, num_buckets, max_distance, bidirectional):
    """docs/t5.md as Hugging Face's T5Attention._relative_position_bucket (log in float32)."""
    rel = rel.to(torch.int64)
    ret = torch.zeros_like(rel)
    if bidirectional:
        num_buckets //= 2
        ret += (rel > 0).to(torch.int64) * num_buckets
        n = rel.abs()
    else:
        n = torch.clamp(-rel, min=0)
    exact = num_buckets // 2
    small = n < exact
    large = exact + (torch.log(n.float() / exact) / math.log(max_distance / exact)
                     * (num_buckets - exact)).to(torch.int64)
    large = torch.clamp(large, max=num_buckets - 1)
    return ret + torch.where(small, n, large)


def deberta_bucket(rho, max_relative_positions, position_buckets, float64_log=False):
    """docs/deberta.md as Hugging Face's make_log_bucket_position (float32 log by default)."""
    if position_buckets <= 0:
        return rho
    mid = position_buckets // 2
    sign = torch.sign(rho)
    absr = torch.where((rho < mid) & (rho > -mid), torch.full_like(rho, mid - 1), rho.abs())
    dt = torch.float64 if float64_log else torch.float32
    log_pos = torch.ceil(torch.log(absr.to(dt) / mid) /
                         torch.log(torch.tensor((max_relative_positions - 1) / mid, dtype=dt))
                         * (mid - 1)) + mid
    return torch.where(absr <= mid, rho, (log_pos * sign).to(torch.int64))


def positions(spec, batch, seq, default_start):
    """[batch, seq] int64 positions from None / int offset / ids [seq] / [batch, seq]."""
    if spec is None:
        spec = default_start
    if isinstance(spec, int):
        return (torch.arange(seq) + spec).expand(batch, seq)
    p = torch.as_tensor(spec, dtype=torch.int64)
    return p.expand(batch, seq) if p.dim() == 1 else p


def rope(x, pos, inv_freq, style="half", attention_factor=1.0):
    """x [B, L, H, D], pos [B, L]: docs/rope.md with angles and rotation in float64."""
    r2 = inv_freq.numel()
    ang = pos.to(torch.float64)[..., None] * inv_freq.to(torch.float64)  # [B, L, R/2]
    c = (torch.cos(ang) * attention_factor)[:, :, None, :].to(x.dtype)
    s = (torch.sin(ang) * attention_factor)[:, :, None, :].to(x.dtype)
    if style == "half":
        x1, x2 = x[..., :r2], x[..., r2:2 * r2]
        rot = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    else:
        x1, x2 = x[..., 0:2 * r2:2], x[..., 1:2 * r2:2]
        rot = torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)
    return torch.cat([rot, x[..., 2 * r2:]], dim=-1)


def xl_sinusoid(delta, d_model, base=1e4):
    """R(delta) [..., d_model], concat layout, float64."""
    i = torch.arange(d_model // 2, dtype=torch.float64)
    w = base ** (-2.0 * i / d_model)
    a = delta.to(torch.float64)[..., None] * w
    return torch.cat([torch.sin(a), torch.cos(a)], dim=-1)


def attention(q, k, v, scheme="none", params=None, *, causal=False, scale=None, window=None,
              query_positions=None, key_positions=None, rope_inv_freq=None, rope_style="half",
              rope_attention_factor=1.0, slopes=None, max_bias=8.0, max_distance=128,
              bidirectional=None, xl_base=1e4, max_relative_positions=512, position_buckets=0,
              deberta_p2c="model", deberta_float64_log=False, allow_fully_masked=False,
              chunk=None, softcap=None, mask=None):
    """q [B, Lq, Hq, D], k and v [B, Lk, Hkv, D] -> out [B, Lq, Hq, D] (differentiable).

    params["sinks"] [Hq] (any scheme): attention sinks, an extra softmax entry per row whose value
    is zero. chunk: key visible only when floor(pos_k / chunk) == floor(pos_q / chunk).
    softcap: scores s (scale and bias included) become softcap * tanh(s / softcap). mask: a
    boolean [B, Lq, Lk] (True: may attend) ANDed with the other masks."""
    params = params or {}
    b, lq, hq, d = q.shape
    lk, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    pq = positions(query_positions, b, lq, lk - lq)
    pk = positions(key_positions, b, lk, 0)
    rel = pk[:, None, :] - pq[:, :, None]  # [B, Lq, Lk] key minus query
    if scale is None:
        scale = 1.0 / math.sqrt((3 if scheme == "deberta" else 1) * d)
    if scheme == "rope":
        q = rope(q, pq, rope_inv_freq, rope_style, rope_attention_factor)
        k = rope(k, pk, rope_inv_freq, rope_style, rope_attention_factor)
    kx = k.repeat_interleave(group, dim=2)  # [B, Lk, Hq, D]
    vx = v.repeat_interleave(group, dim=2)
    content = torch.einsum("bihc,bjhc->bhij", q, kx)
    bias = torch.zeros_like(content)
    value_term = None
    if scheme == "alibi":
        m = params.get("slopes")
        if m is None:
            m = torch.tensor(alibi_slopes(hq, max_bias), dtype=q.dtype)
        bias = -m.to(q.dtype)[None, :, None, None] * rel.abs()[:, None].to(q.dtype)
    elif scheme == "t5":
        table = params["relative_attention_bias"]
        bidir = (not causal) if bidirectional is None else bidirectional
        bucket = t5_bucket(rel, table.shape[0], max_distance, bidir)  # [B, Lq, Lk]
        bias = table[bucket].permute(0, 3, 1, 2)  # [B, H, Lq, Lk]
    elif scheme == "shaw":
        rk, rv = params["rel_k"], params.get("rel_v")
        kk = (rk.shape[0] - 1) // 2
        idx = torch.clamp(rel, -kk, kk) + kk
        rk3 = rk[:, None, :].expand(-1, hq, -1) if rk.dim() == 2 else rk  # [2K+1, H, D]
        content = content + torch.einsum("bihc,bijhc->bhij", q, rk3[idx])
        if rv is not None:
            rv3 = rv[:, None, :].expand(-1, hq, -1) if rv.dim() == 2 else rv
            value_term = rv3[idx]  # [B, Lq, Lk, H, D]
    elif scheme == "xl":
        u, vb, rnet = params["r_w_bias"], params["r_r_bias"], params["r_net"]
        delta = pq[:, :, None] - pk[:, None, :]
        rr = xl_sinusoid(delta, rnet.shape[1], xl_base).to(q.dtype)  # [B, Lq, Lk, Dm]
        r = torch.einsum("om,bijm->bijo", rnet, rr).reshape(b, lq, lk, hq, d)
        content = (torch.einsum("bihc,bjhc->bhij", q + u[None, None], kx)
                   + torch.einsum("bihc,bijhc->bhij", q + vb[None, None], r))
    elif scheme == "deberta":
        pkey, pqry = params["pos_key"], params["pos_query"]
        span = position_buckets if position_buckets > 0 else max_relative_positions
        rho = deberta_bucket(pq[:, :, None] - pk[:, None, :], max_relative_positions,
                             position_buckets, deberta_float64_log)
        c2p = torch.clamp(rho + span, 0, 2 * span - 1)
        p2c = c2p if deberta_p2c == "model" else torch.clamp(-rho + span, 0, 2 * span - 1)
        content = (content + torch.einsum("bihc,bijhc->bhij", q, pkey[c2p])
                   + torch.einsum("bjhc,bijhc->bhij", kx, pqry[p2c]))
    s = scale * content + bias
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    extra = mask
    mask = torch.ones_like(rel, dtype=torch.bool)
    if extra is not None:
        mask &= torch.as_tensor(extra, dtype=torch.bool).expand_as(mask)
    if causal:
        mask &= rel <= 0
    if window is not None:
        mask &= rel.abs() < window
    if chunk is not None:
        mask &= torch.div(pk, chunk, rounding_mode="floor")[:, None, :] == \
            torch.div(pq, chunk, rounding_mode="floor")[:, :, None]
    s = s.masked_fill(~mask[:, None], float("-inf"))
    sinks = params.get("sinks")
    if sinks is not None:
        # The sink as one more column of every row; its probability multiplies no value.
        col = sinks.to(s.dtype)[None, :, None, None].expand(b, hq, lq, 1)
        p = torch.softmax(torch.cat([s, col], dim=-1), dim=-1)[..., :lk]
    else:
        full = ~mask.any(-1)  # [B, Lq]
        if full.any() and not allow_fully_masked:
            raise ValueError("fully masked row")
        s = s.masked_fill(full[:, None, :, None], 0.0)
        p = torch.softmax(s, dim=-1).masked_fill(full[:, None, :, None], 0.0)
    out = torch.einsum("bhij,bjhc->bihc", p, vx)
    if value_term is not None:
        out = out + torch.einsum("bhij,bijhc->bihc", p, value_term)
    return out
