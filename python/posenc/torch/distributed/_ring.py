"""strategy="ring": the key/value shards travel around the ring, every block is a posenc
attention call with the block's global positions, partial results merged exactly through their
log-sum-exp; the backward sends dk / dv with their shard back to it."""

import math

import torch

from ... import _device, _ops, _posenc
from ._comm import _STATS, _TAG_DKV, _TAG_KV, _Timer, _agree, _next, _prev
from ._plan import _block_hidden, _block_masks, _pos_slice, _settings, _visible_pairs


# A finite sink that contributes nothing (exp(-1e30 - s) == 0): lets a config whose layers
# require sinks run blocks whose real sink is merged once, outside the kernel.
_NO_SINK = -1e30


# ---- merging ------------------------------------------------------------------------------------

def _merge(out_a, lse_a, out_b, lse_b):
    """Exact merge of two partial attentions (float32: posenc's attention_merge, in double per
    row, or its device form with the same numbers; float64: the same formula in float64)."""
    if out_a.dtype == torch.float32 and not out_a.is_cpu:
        return _device.attention_merge(out_a, lse_a, out_b, lse_b)
    if out_a.dtype == torch.float32:
        o, lse = _posenc.attention_merge(_ops._np(out_a, "out_a"), _ops._np(lse_a, "lse_a"),
                                         _ops._np(out_b, "out_b"), _ops._np(lse_b, "lse_b"))
        return torch.from_numpy(o), torch.from_numpy(lse)
    m = torch.maximum(lse_a, lse_b)
    safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    wa, wb = torch.exp(lse_a - safe), torch.exp(lse_b - safe)
    tot = wa + wb
    lse = torch.where(tot > 0, safe + torch.log(tot), torch.full_like(m, -math.inf))
    denom = torch.where(tot > 0, tot, torch.ones_like(tot))
    wa4 = (wa / denom).transpose(1, 2).unsqueeze(-1)
    wb4 = (wb / denom).transpose(1, 2).unsqueeze(-1)
    return wa4 * out_a + wb4 * out_b, lse


def _add_sink(out, lse, sinks):
    """Merges the sink (a key with logit sink_h and value 0) into a finished partial result."""
    s = sinks.to(lse.dtype).view(1, -1, 1).expand_as(lse).contiguous()
    return _merge(out, lse, torch.zeros_like(out), s)


def _sink_grad(out, lse, dout, sinks):
    """dsink_h = -sum_i exp(sink_h - lse_i) (dout_i . out_i) over this rank's rows (double)."""
    d = (dout.double() * out.double()).sum(-1).transpose(1, 2)  # [B, H, L]
    pr = torch.exp(sinks.double().view(1, -1, 1) - lse.double())
    return -(pr * d).sum((0, 2))


# ---- ring ---------------------------------------------------------------------------------------

def _pack(p, k, v):
    """k and v of a shard as one flat message in the wire dtype: half precision when the inputs
    were (lossless: the values came from it), else the computing dtype."""
    return torch.cat([k.reshape(-1), v.reshape(-1)]).to(p.wire)


def _unpack(p, buf, src):
    n = p.lk[src]
    nk = p.B * n * p.Hkv * p.D
    if buf.dtype != p.cdtype:
        buf = buf.to(p.cdtype)
    k = buf[:nk].view(p.B, n, p.Hkv, p.D)
    v = buf[nk:].view(p.B, n, p.Hkv, p.Dv)
    return k, v


def _kv_numel(p, src):
    return p.B * p.lk[src] * p.Hkv * (p.D + p.Dv)


def _local_q_segs(p):
    """[(local start, local end, global start, global end)] of this rank's queries."""
    out, off = [], 0
    for a, b in p.q_segs[p.rank]:
        out.append((off, off + b - a, a, b))
        off += b - a
    return out


def _k_segs_of(p, src):
    out, off = [], 0
    for a, b in p.k_segs[src]:
        out.append((off, off + b - a, a, b))
        off += b - a
    return out


def _ring_tables(p):
    """(names, tensors) for the kernel calls: the tables without sinks (merged outside), plus a
    silent sink when a config requires one."""
    names = [n for n in p.names if n != "sinks"]
    tables = [p.tables[n] for n in names]
    if p.config_sinks:
        names = sorted(names + ["sinks"])
        silent = torch.full((p.Hq,), _NO_SINK, dtype=p.cdtype, device=p.device)
        tables = [silent if n == "sinks" else p.tables[n] for n in names]
    return names, tables


def _ring_forward(p, q, k, v):
    c = p.c
    names, tables = _ring_tables(p)
    settings = _settings(p)
    qsegs = _local_q_segs(p)
    acc = [None] * len(qsegs)
    error = None
    buf = _pack(p, k, v)
    for step in range(c.world):
        src = (c.rank - step) % c.world
        waits = []
        nxt = None
        if step < c.world - 1:
            nxt = torch.empty(_kv_numel(p, (c.rank - step - 1) % c.world), dtype=buf.dtype,
                              device=p.device)
            waits.append(c.recv(nxt, _prev(c), _TAG_KV + step))
            c.send(buf, _next(c), _TAG_KV + step)
        if error is None:
            try:
                ks, vs = _unpack(p, buf, src)
                for i, (la, lb, qa, qb) in enumerate(qsegs):
                    for ka_l, kb_l, ka, kb in _k_segs_of(p, src):
                        if _block_hidden(p, qa, qb, ka, kb):
                            _STATS["blocks_skipped"] += 1
                            continue
                        with _Timer("compute_s"):
                            o, lse = _ops.attention_impl(
                                q[:, la:lb], ks[:, ka_l:kb_l], vs[:, ka_l:kb_l], tables, names,
                                _pos_slice(p.qpos, qa, qb), _pos_slice(p.kpos, ka, kb),
                                **_block_masks(p, qa, qb, ka, kb), **settings)
                            acc[i] = (o, lse) if acc[i] is None else _merge(*acc[i], o, lse)
                        _STATS["blocks_computed"] += 1
                        _STATS["visible_pairs"] += _visible_pairs(p, qa, qb, ka, kb)
            except Exception as e:  # the ring goes on; every rank raises it afterwards
                error = e
        c.wait(waits)
        c.flush()
        if nxt is not None:
            buf = nxt
    outs, lses = [], []
    if error is None:
        try:
            with _Timer("compute_s"):
                for i, (la, lb, qa, qb) in enumerate(qsegs):
                    if acc[i] is None:
                        o = torch.zeros(p.B, lb - la, p.Hq, p.Dv, dtype=p.cdtype,
                                        device=p.device)
                        lse = torch.full((p.B, p.Hq, lb - la), -math.inf, dtype=o.dtype,
                                         device=p.device)
                    else:
                        o, lse = acc[i]
                    if p.config_sinks:
                        lse = torch.where(lse < _NO_SINK / 10, torch.full_like(lse, -math.inf),
                                          lse)
                    if "sinks" in p.tables:
                        o, lse = _add_sink(o, lse, p.tables["sinks"])
                    outs.append(o)
                    lses.append(lse)
            out = torch.cat(outs, 1) if len(outs) > 1 else outs[0]
            lse = torch.cat(lses, 2) if len(lses) > 1 else lses[0]
            _check_masked_rows(p, lse)
        except Exception as e:
            error = e
    _agree(c, error)
    return out, lse


def _check_masked_rows(p, lse):
    if p.allow_fully_masked or "sinks" in p.tables or lse.numel() == 0:
        return
    bad = torch.isneginf(lse)
    if bool(bad.any()):
        b, h, i = (int(x) for x in bad.nonzero()[0])
        g = _local_to_global(p, i)
        pos = int(p.qpos[..., g] if p.qpos.dim() == 1 else p.qpos[b, g])
        raise ValueError(f"attention: query {g} (batch row {b}, position {pos}) sees no key "
                         f"(pass allow_fully_masked=True for output 0)")


def _local_to_global(p, i):
    for la, lb, qa, _ in _local_q_segs(p):
        if la <= i < lb:
            return qa + i - la
    return i


def _ring_backward(p, q, k, v, out, lse, dout):
    c = p.c
    names, tables = _ring_tables(p)
    settings = _settings(p)
    qsegs = _local_q_segs(p)
    dq = torch.zeros_like(q)
    tgrads = {n: torch.zeros(p.tables[n].shape, dtype=torch.float64, device=p.device)
              for n in p.names}
    error = None
    buf = _pack(p, k, v)
    dkv = None
    for step in range(c.world):
        src = (c.rank - step) % c.world
        waits_in = None
        incoming = None
        if step > 0:  # the shard's gradient so far, from the ranks it visited before
            incoming = torch.empty(_kv_numel(p, src), dtype=p.cdtype, device=p.device)
            waits_in = c.recv(incoming, _prev(c), _TAG_DKV + step - 1)
        waits = []
        nxt = None
        if step < c.world - 1:
            nxt = torch.empty(_kv_numel(p, (c.rank - step - 1) % c.world), dtype=buf.dtype,
                              device=p.device)
            waits.append(c.recv(nxt, _prev(c), _TAG_KV + step))
            c.send(buf, _next(c), _TAG_KV + step)
        dkv = torch.zeros(_kv_numel(p, src), dtype=p.cdtype, device=p.device)
        if error is None:
            try:
                ks, vs = _unpack(p, buf, src)
                dks, dvs = _unpack(p, dkv, src)
                for la, lb, qa, qb in qsegs:
                    for ka_l, kb_l, ka, kb in _k_segs_of(p, src):
                        if _block_hidden(p, qa, qb, ka, kb):
                            continue
                        with _Timer("compute_s"):
                            g = _ops.attention_backward_impl(
                                q[:, la:lb], ks[:, ka_l:kb_l], vs[:, ka_l:kb_l],
                                out[:, la:lb], lse[:, :, la:lb].contiguous(),
                                dout[:, la:lb].contiguous(), tables, names,
                                _pos_slice(p.qpos, qa, qb), _pos_slice(p.kpos, ka, kb),
                                **_block_masks(p, qa, qb, ka, kb), **settings)
                            dq[:, la:lb] += g[0]
                            dks[:, ka_l:kb_l] += g[1]
                            dvs[:, ka_l:kb_l] += g[2]
                            for n, gt in zip(names, g[3:]):
                                if n in tgrads:
                                    tgrads[n] += gt.double()
            except Exception as e:
                error = e
        c.wait([waits_in])
        if incoming is not None:
            dkv += incoming
        if c.world > 1:
            c.send(dkv, _next(c), _TAG_DKV + step)
        c.wait(waits)
        if nxt is not None:
            buf = nxt
    own = (torch.empty(_kv_numel(p, c.rank), dtype=p.cdtype, device=p.device) if c.world > 1
           else dkv)
    if c.world > 1:
        c.wait([c.recv(own, _prev(c), _TAG_DKV + c.world - 1)])
    c.flush()
    dk, dv = _unpack(p, own, c.rank)
    if error is None and "sinks" in p.tables:
        try:
            with _Timer("compute_s"):
                tgrads["sinks"] += _sink_grad(out, lse, dout, p.tables["sinks"])
        except Exception as e:
            error = e
    return dq, dk.clone(), dv.clone(), tgrads, error
