"""strategy="all_to_all" (DeepSpeed-Ulysses): an all-to-all turns sequence shards into head
shards, each rank attends over the whole sequence with its heads (per-head tables sliced to
them), and another all-to-all turns the output back; the backward runs the same way."""

import torch

from ... import _ops, _posenc
from ..._tables import TABLE_HEAD_AXIS as _TABLE_HEAD_AXIS
from ._comm import _STATS, _TAG_A2A, _Timer, _agree, _all_to_all
from ._plan import _settings, _visible_pairs


def _head_ranges(p):
    """Per rank: (q heads lo, hi, kv heads lo, hi)."""
    hq = p.Hq // p.world
    group = p.Hq // p.Hkv
    out = []
    for r in range(p.world):
        lo, hi = r * hq, (r + 1) * hq
        out.append((lo, hi, lo // group, (hi - 1) // group + 1))
    return out


def _check_heads(p):
    n = p.world
    if p.Hq % n:
        raise ValueError(f"strategy all_to_all: heads_q ({p.Hq}) must be divisible by the world "
                         f"size ({n}); use strategy='ring'")
    hq = p.Hq // n
    group = p.Hq // p.Hkv
    if hq % group and group % hq:
        raise ValueError(f"strategy all_to_all: {hq} query heads per rank do not cover whole kv "
                         f"heads ({p.Hkv} kv heads, {group} query heads each); use "
                         f"strategy='ring'")


def _seq_gather(p, parts, lens, segs_of, shape_tail, heads):
    """Flat parts received from each rank (its sequence shard of some heads) -> the whole
    sequence [B, L, heads, tail] in global order."""
    total = sum(lens)
    full = torch.empty(p.B, total, heads, shape_tail, dtype=p.cdtype, device=p.device)
    for r, flat in enumerate(parts):
        t = flat.view(p.B, lens[r], heads, shape_tail)
        off = 0
        for a, b in segs_of[r]:
            full[:, a:b] = t[:, off:off + b - a]
            off += b - a
    return full


def _seq_take(x, segs):
    parts = [x[:, a:b] for a, b in segs]
    return parts[0] if len(parts) == 1 else torch.cat(parts, 1)


def _a2a_tables(p, lo, hi):
    """The tables sliced to query heads [lo, hi)."""
    out = {}
    for n in p.names:
        t = p.tables[n]
        if n == "r_net":
            t = t[lo * p.D:hi * p.D]
        elif n in ("rel_k", "rel_v") and t.dim() == 3:
            t = t[:, lo:hi]
        elif n in _TABLE_HEAD_AXIS:
            t = t.narrow(_TABLE_HEAD_AXIS[n], lo, hi - lo)
        out[n] = t.contiguous()
    if p.alibi_max_bias is not None and "slopes" not in out:
        slopes = torch.from_numpy(_posenc.alibi_slopes(p.Hq, max_bias=float(p.alibi_max_bias)))
        out["slopes"] = slopes[lo:hi].to(p.device, p.cdtype).contiguous()
    return out


def _a2a_scatter_grads(p, lo, hi, grads):
    """Local table gradients (heads [lo, hi)) placed in zero tables of the full shapes."""
    full = {}
    for n in p.names:
        t = torch.zeros(p.tables[n].shape, dtype=torch.float64, device=p.device)
        g = grads.get(n)
        if g is not None:
            g = g.double()
            if n == "r_net":
                t[lo * p.D:hi * p.D] = g
            elif n in ("rel_k", "rel_v") and t.dim() == 3:
                t[:, lo:hi] = g
            elif n in _TABLE_HEAD_AXIS:
                t.narrow(_TABLE_HEAD_AXIS[n], lo, hi - lo).copy_(g)
            else:
                t += g
        full[n] = t
    return full


def _a2a_forward(p, q, k, v):
    c = p.c
    hr = _head_ranges(p)
    lo, hi, klo, khi = hr[c.rank]
    hq, hk = hi - lo, khi - klo
    qseg = p.q_segs
    kseg = p.k_segs
    sends = []
    for r in range(c.world):
        rlo, rhi, rklo, rkhi = hr[r]
        sends.append(torch.cat([q[:, :, rlo:rhi].reshape(-1), k[:, :, rklo:rkhi].reshape(-1),
                                v[:, :, rklo:rkhi].reshape(-1)]))
    recv_numels = [p.B * (p.lq[r] * hq * p.D + p.lk[r] * hk * (p.D + p.Dv))
                   for r in range(c.world)]
    got = _all_to_all(c, sends, recv_numels, p.cdtype, _TAG_A2A)
    qp, kp, vp = [], [], []
    for r, flat in enumerate(got):
        nq, nk = p.B * p.lq[r] * hq * p.D, p.B * p.lk[r] * hk * p.D
        qp.append(flat[:nq])
        kp.append(flat[nq:nq + nk])
        vp.append(flat[nq + nk:])
    qh = _seq_gather(p, qp, p.lq, qseg, p.D, hq)
    kh = _seq_gather(p, kp, p.lk, kseg, p.D, hk)
    vh = _seq_gather(p, vp, p.lk, kseg, p.Dv, hk)
    tables = _a2a_tables(p, lo, hi)
    names = sorted(tables)
    settings = _settings(p, allow=p.allow_fully_masked)
    masks = {n: p.masks[n] for n in p.mask_names}
    error = None
    oh = lh = None
    try:
        with _Timer("compute_s"):
            oh, lh = _ops.attention_impl(qh, kh, vh, [tables[n] for n in names], names, p.qpos,
                                         p.kpos, **masks, **settings)
        _STATS["blocks_computed"] += 1
        _STATS["visible_pairs"] += _visible_pairs(p, 0, p.Lq, 0, p.Lk) * hq // p.Hq
    except Exception as e:
        error = e
    _agree(c, error)
    # Back to sequence shards: rank r gets its rows of my heads (out and lse).
    sends = []
    for r in range(c.world):
        o = _seq_take(oh, qseg[r]).reshape(-1)
        ls = torch.cat([lh[:, :, a:b] for a, b in qseg[r]], 2).reshape(-1)
        sends.append(torch.cat([o, ls.to(p.cdtype)]))
    recv_numels = [p.B * p.lq[c.rank] * (hr[r][1] - hr[r][0]) * (p.Dv + 1)
                   for r in range(c.world)]
    got = _all_to_all(c, sends, recv_numels, p.cdtype, _TAG_A2A + 1)
    lq = p.lq[c.rank]
    out = torch.empty(p.B, lq, p.Hq, p.Dv, dtype=p.cdtype, device=p.device)
    lse = torch.empty(p.B, p.Hq, lq, dtype=lh.dtype, device=p.device)
    for r, flat in enumerate(got):
        rlo, rhi = hr[r][0], hr[r][1]
        n = p.B * lq * (rhi - rlo) * p.Dv
        out[:, :, rlo:rhi] = flat[:n].view(p.B, lq, rhi - rlo, p.Dv)
        lse[:, rlo:rhi] = flat[n:].view(p.B, rhi - rlo, lq).to(lse.dtype)
    saved = (qh, kh, vh, oh, lh, tables, names, settings)
    return out, lse, saved


def _a2a_backward(p, saved, dout):
    c = p.c
    qh, kh, vh, oh, lh, tables, names, settings = saved
    hr = _head_ranges(p)
    lo, hi = hr[c.rank][:2]
    hq = hi - lo
    lq = p.lq[c.rank]
    sends = [dout[:, :, hr[r][0]:hr[r][1]].reshape(-1) for r in range(c.world)]
    got = _all_to_all(c, sends, [p.B * p.lq[r] * hq * p.Dv for r in range(c.world)], p.cdtype,
                      _TAG_A2A + 2)
    douth = _seq_gather(p, got, p.lq, p.q_segs, p.Dv, hq)
    error = None
    try:
        with _Timer("compute_s"):
            g = _ops.attention_backward_impl(qh, kh, vh, oh, lh, douth,
                                             [tables[n] for n in names], names, p.qpos, p.kpos,
                                             **{n: p.masks[n] for n in p.mask_names},
                                             **settings)
    except Exception as e:
        error = e
        g = [torch.zeros_like(qh), torch.zeros_like(kh), torch.zeros_like(vh)] + \
            [torch.zeros_like(tables[n]) for n in names]
    tgrads = _a2a_scatter_grads(p, lo, hi, dict(zip(names, g[3:])))
    sends = []
    for r in range(c.world):
        sends.append(torch.cat([_seq_take(g[0], p.q_segs[r]).reshape(-1),
                                _seq_take(g[1], p.k_segs[r]).reshape(-1),
                                _seq_take(g[2], p.k_segs[r]).reshape(-1)]))
    lk = p.lk[c.rank]
    recv_numels = []
    for r in range(c.world):
        rlo, rhi, rklo, rkhi = hr[r]
        recv_numels.append(p.B * (lq * (rhi - rlo) * p.D + lk * (rkhi - rklo) * (p.D + p.Dv)))
    got = _all_to_all(c, sends, recv_numels, p.cdtype, _TAG_A2A + 3)
    dq = torch.empty(p.B, lq, p.Hq, p.D, dtype=p.cdtype, device=p.device)
    dk = torch.zeros(p.B, lk, p.Hkv, p.D, dtype=p.cdtype, device=p.device)
    dv = torch.zeros(p.B, lk, p.Hkv, p.Dv, dtype=p.cdtype, device=p.device)
    for r, flat in enumerate(got):
        rlo, rhi, rklo, rkhi = hr[r]
        nq = p.B * lq * (rhi - rlo) * p.D
        nk = p.B * lk * (rkhi - rklo) * p.D
        dq[:, :, rlo:rhi] = flat[:nq].view(p.B, lq, rhi - rlo, p.D)
        dk[:, :, rklo:rkhi] += flat[nq:nq + nk].view(p.B, lk, rkhi - rklo, p.D)
        dv[:, :, rklo:rkhi] += flat[nq + nk:].view(p.B, lk, rkhi - rklo, p.Dv)
    return dq, dk, dv, tgrads, error
