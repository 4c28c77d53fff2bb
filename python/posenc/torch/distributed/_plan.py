"""The plan of a call: the ranks exchange shapes and fingerprints of their arguments, agree on
them, and each builds the layout, the whole sequence's positions and masks, the settings and the
blocks a mask hides entirely (everything the forward and the backward need)."""

import datetime
import zlib

import numpy as np
import torch
import torch.distributed as dist

from ... import _ops, _posenc
from .._keywords import MASK_KEYWORDS, PACKED_KEYWORDS
from ._layout import STRATEGIES, _check_layout, _segments, _shard_len
from ._comm import _Comm, _error_name, _raise_agreed


_HALF = (torch.bfloat16, torch.float16)
# Keywords of posenc.torch.attention handled here rather than passed through: its mask tensors
# (given for the whole sequence), less the packed-sequence ones (refused).
_MASK_TENSORS = tuple(n for n in MASK_KEYWORDS if n not in PACKED_KEYWORDS)


_CRC_SAMPLE = 1 << 16


def _crc(*arrays):
    """A fingerprint of strings and arrays (arrays over 65536 elements: an even sample of them),
    for comparing the ranks' arguments."""
    h = 0
    for a in arrays:
        if a is None:
            h = zlib.crc32(b"\x00none", h)
            continue
        if isinstance(a, (bytes, str)):
            h = zlib.crc32(a.encode() if isinstance(a, str) else a, h)
            continue
        t = a.detach().cpu() if isinstance(a, torch.Tensor) else torch.as_tensor(np.asarray(a))
        h = zlib.crc32(repr((tuple(t.shape), str(t.dtype))).encode(), h)
        flat = t.reshape(-1)
        if flat.numel() > _CRC_SAMPLE:  # a large table or mask: an even sample (cheap per call)
            flat = flat[::flat.numel() // _CRC_SAMPLE + 1]
        flat = flat.contiguous()
        if flat.dtype in _HALF:
            flat = flat.view(torch.int16)
        h = zlib.crc32(flat.numpy().tobytes(), h)
    return h


def _fingerprint_value(value):
    """A positions / mask argument in a form whose bytes do not depend on how it was passed."""
    if value is None or isinstance(value, (bool, int, np.integer)):
        return repr(value)
    t = (value.detach().cpu() if isinstance(value, torch.Tensor)
         else torch.as_tensor(np.asarray(value)))
    return t.to(torch.int64)


def _as_int_tensor(value, what):
    """An index argument (positions, document ids, a mask) on the host: the plan reads it there
    (a CUDA tensor is copied once)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    return torch.as_tensor(np.asarray(value))


def _whole_positions(value, length, batch, what):
    """Positions of the whole sequence as an int64 tensor [seq] or [batch, seq] (None: None)."""
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{what}: an int offset or int ids, not a bool")
    if isinstance(value, (int, np.integer)):
        return torch.arange(length, dtype=torch.int64) + int(value)
    t = _as_int_tensor(value, what)
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{what}: integer ids, got {t.dtype}")
    if t.dim() not in (1, 2) or t.shape[-1] != length:
        raise ValueError(f"{what}: shape {tuple(t.shape)}; context_parallel_attention takes the "
                         f"whole sequence's positions, [{length}] or [batch, {length}] (each "
                         f"rank's share is taken by the layout)")
    if t.dim() == 2 and t.shape[0] != batch:
        raise ValueError(f"{what}: {t.shape[0]} rows, batch is {batch}")
    return t.to(torch.int64)


def _pos_slice(pos, a, b):
    return pos[..., a:b].contiguous()


def _minmax(pos, a, b):
    p = pos[..., a:b]
    return p.amin(-1), p.amax(-1)


def _resolve_config(kw):
    cfg = kw.get("config")
    if cfg is None:
        return None, None
    if not isinstance(cfg, _posenc.ModelConfig):
        cfg = _posenc.read_model_config(cfg if isinstance(cfg, dict) else str(cfg))
    layer = kw.get("layer")
    layers = cfg.layers
    chosen = [layers[layer]] if layer is not None and 0 <= layer < len(layers) else layers
    return cfg, chosen


class _Plan:
    """The call's layout, positions, masks, settings and tables, agreed between the ranks (plain
    attributes, set by _make_plan and _finish_plan)."""


def _local_checks(q, k, v, strategy, layout, kwargs):
    for t, what in ((q, "q"), (k, "k"), (v, "v")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: a torch.Tensor")
        if t.device != q.device:
            raise ValueError(f"{what} is on {t.device}, q on {q.device}: q, k and v share one "
                             f"device")
        if t.dim() != 4:
            raise ValueError(f"{what}: {t.dim()} dimensions; context_parallel_attention takes "
                             f"[batch, seq, heads, head_dim] shards (packed sequences are not "
                             f"supported)")
        if not (t.dtype.is_floating_point and t.dtype in
                (torch.float32, torch.float64) + _HALF):
            raise TypeError(f"{what}: dtype {t.dtype} (float32, float64, bfloat16, float16)")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy: '{strategy}' (ring or all_to_all)")
    _check_layout(layout)
    for bad in ("out", "lse", "_base_args"):
        if bad in kwargs:
            raise TypeError(f"context_parallel_attention() got an unexpected keyword argument "
                            f"'{bad}'")
    for bad in ("cu_seqlens_q", "cu_seqlens_k"):
        if kwargs.get(bad) is not None:
            raise ValueError(f"{bad}: packed sequences are not supported by "
                             f"context_parallel_attention (use query_documents / key_documents "
                             f"on [batch, seq] shards)")


_DTYPES = {torch.float32: 0, torch.float64: 1, torch.bfloat16: 2, torch.float16: 3}


def _make_plan(q, k, v, scheme, params, group, strategy, layout, kwargs, timeout):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("context_parallel_attention: torch.distributed is not initialized "
                           "(call torch.distributed.init_process_group first)")
    if timeout is not None and not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(seconds=float(timeout))
    c = _Comm(group, timeout)
    if c.rank < 0:
        raise ValueError("group: this process is not a member of the group")
    meta = torch.zeros(24, dtype=torch.int64, device=c.device)
    error = None
    try:
        _local_checks(q, k, v, strategy, layout, kwargs)
        if params is not None and not isinstance(params, dict):
            raise TypeError("params: a dict {name: tensor}")
        meta[0] = 0
        meta[1:5] = torch.tensor(q.shape)
        meta[5:9] = torch.tensor(k.shape)
        meta[9:13] = torch.tensor(v.shape)
        meta[13] = _DTYPES[q.dtype]
        meta[18] = _crc(str(q.device.type))
        whole = ("query_positions", "key_positions") + _MASK_TENSORS
        settings = {n: kwargs[n] for n in sorted(kwargs)
                    if n not in whole + ("config", "num_threads")}
        typed = _ops.typed("attention", settings, "context_parallel_attention")
        meta[14] = _crc(repr((scheme, strategy, layout, sorted(params or {}),
                              sorted(typed.items()))))
        cfg = kwargs.get("config")
        meta[15] = _crc(cfg if isinstance(cfg, str) else repr(type(cfg).__name__))
        meta[16] = _crc(*[params[n] for n in sorted(params or {})])
        meta[17] = _crc(*[_fingerprint_value(kwargs.get(n)) for n in whole])
    except Exception as e:  # reported on every rank below
        error = e
        meta.zero_()
        meta[0] = 1
    gathered = [torch.zeros_like(meta) for _ in range(c.world)]
    if c.world > 1:
        dist.all_gather(gathered, meta, group=c.group)
    else:
        gathered = [meta]
    if any(int(g[0]) for g in gathered):
        local = None if error is None else (c.rank, _error_name(error), str(error))
        if c.world == 1:
            raise error
        objs = [None] * c.world
        dist.all_gather_object(objs, local, group=c.group)
        _raise_agreed(c, [o for o in objs if o is not None], error)
    # From here every rank sees the same metadata and reaches the same verdict.
    m = [g.tolist() for g in gathered]
    problems = _cross_check(m, layout, c.world)
    if problems:
        raise ValueError("context_parallel_attention: " + problems)
    p = _Plan()
    p.c, p.strategy, p.layout = c, strategy, layout
    p.world, p.rank = c.world, c.rank
    p.B, p.Hq, p.D = m[0][1], m[0][3], m[0][4]
    p.Hkv, p.Dv = m[0][7], m[0][12]
    p.lq = [r[2] for r in m]
    p.lk = [r[6] for r in m]
    p.Lq, p.Lk = sum(p.lq), sum(p.lk)
    p.q_segs = [_segments(p.Lq, r, c.world, layout) for r in range(c.world)]
    p.k_segs = [_segments(p.Lk, r, c.world, layout) for r in range(c.world)]
    return p, m


def _cross_check(m, layout, world):
    """Shapes and fingerprints of every rank: a message naming the first difference, or ''."""
    names = ["batch", "heads", "head_dim"]
    for r, row in enumerate(m):
        qs, ks, vs = row[1:5], row[5:9], row[9:13]
        if ks[1] != vs[1] or ks[0] != vs[0] or ks[2] != vs[2]:
            return f"rank {r}: k {tuple(ks)} and v {tuple(vs)} differ in batch, seq or heads"
        if qs[0] != ks[0]:
            return f"rank {r}: q batch {qs[0]} and k batch {ks[0]} differ"
        for what, a, b in (("q", qs, m[0][1:5]), ("k", ks, m[0][5:9]), ("v", vs, m[0][9:13])):
            for i, n in zip((0, 2, 3), names):
                if a[i] != b[i]:
                    return f"rank {r}: {what} has {n} {a[i]}, rank 0 has {b[i]}"
        if row[13] != m[0][13]:
            return f"rank {r}: q's dtype differs from rank 0's"
        if row[18] != m[0][18]:
            return (f"rank {r}: q's device type differs from rank 0's (every rank computes on "
                    f"the same kind of device)")
        if row[14] != m[0][14]:
            return (f"rank {r}: scheme, strategy, layout, options or parameter names differ "
                    f"from rank 0's (every rank must make the same call)")
        if row[15] != m[0][15]:
            return f"rank {r}: config differs from rank 0's"
        if row[17] != m[0][17]:
            return (f"rank {r}: the positions, document ids, prefix or mask differ from rank "
                    f"0's (they are given whole, the same on every rank)")
        if row[16] != m[0][16]:
            return (f"rank {r}: the parameter tables differ from rank 0's (tables must be "
                    f"replicated on every rank)")
    for what, col in (("q", 2), ("k", 6)):
        total = sum(row[col] for row in m)
        for r, row in enumerate(m):
            want = _shard_len(total, r, world, layout)
            if row[col] != want:
                sizes = [row2[col] for row2 in m]
                return (f"rank {r} holds {row[col]} rows of {what}; the {layout} layout of "
                        f"{total} rows over {world} ranks gives it {want} (shard sizes "
                        f"{sizes}: use posenc.torch.distributed.shard)")
    return ""


def _finish_plan(p, q, scheme, params, kwargs):
    """Positions, masks, settings and tables (after the ranks agreed on the shapes)."""
    kw = dict(kwargs)
    kw.pop("allow_fully_masked", None)
    p.allow_fully_masked = bool(kwargs.get("allow_fully_masked", False))
    p.qpos = _whole_positions(kw.pop("query_positions", None), p.Lq, p.B, "query_positions")
    p.kpos = _whole_positions(kw.pop("key_positions", None), p.Lk, p.B, "key_positions")
    if p.kpos is None:
        p.kpos = torch.arange(p.Lk, dtype=torch.int64)
    if p.qpos is None:
        if p.Lq > p.Lk:
            raise ValueError(f"seq_q ({p.Lq}) > seq_k ({p.Lk}) with default positions: pass "
                             f"query_positions and key_positions")
        p.qpos = torch.arange(p.Lq, dtype=torch.int64) + (p.Lk - p.Lq)
    masks = {}
    for n in _MASK_TENSORS:
        value = kw.pop(n, None)
        if value is not None:
            masks[n] = _as_int_tensor(value, n)
    qd, kd = masks.get("query_documents"), masks.get("key_documents")
    if qd is not None and (qd.dim() != 2 or qd.shape[1] != p.Lq):
        raise ValueError(f"query_documents: shape {tuple(qd.shape)}; the whole sequence's ids "
                         f"[batch, {p.Lq}] are expected")
    if kd is not None and (kd.dim() != 2 or kd.shape[1] != p.Lk):
        raise ValueError(f"key_documents: shape {tuple(kd.shape)}; the whole sequence's ids "
                         f"[batch, {p.Lk}] are expected")
    dm = masks.get("mask")
    if dm is not None and (dm.dim() != 3 or dm.shape[1] != p.Lq or dm.shape[2] != p.Lk):
        raise ValueError(f"mask: shape {tuple(dm.shape)}; the whole [batch or 1, {p.Lq}, "
                         f"{p.Lk}] mask is expected")
    p.masks = masks
    p.skippable = "prefix" not in masks and not kw.get("global_positions")
    p.causal = bool(kw.get("causal", False))
    p.window = kw.get("window")
    p.chunk = kw.get("chunk")
    cfg, layers = _resolve_config(kw)
    is_rope = scheme == "rope" or (scheme is None and layers is not None and
                                   any(lay.get("rope") for lay in layers))
    if is_rope and "seq_len" not in kw and "freqs" not in kw:
        # Scalings that follow the sequence length see the whole sequence's, not a block's.
        top = max(int(p.qpos.max()) if p.qpos.numel() else 0,
                  int(p.kpos.max()) if p.kpos.numel() else 0)
        kw["seq_len"] = top + 1
    p.config_sinks = layers is not None and any(lay.get("attention_sinks") for lay in layers)
    if p.config_sinks and "sinks" not in (params or {}):
        raise ValueError("params: the config's layers use attention sinks; params must hold "
                         "'sinks'")
    p.alibi_max_bias = None
    if scheme == "alibi" or (scheme is None and cfg is not None and cfg.scheme == "alibi"):
        p.alibi_max_bias = (kw.get("max_bias", 8.0) if cfg is None else cfg.alibi["max_bias"])
    if scheme is not None:
        kw["scheme"] = scheme
    p.kw = kw
    p.settings = _ops.typed("attention", kw, "context_parallel_attention")
    p.params = dict(params or {})
    p.names = sorted(p.params)
    p.mask_names = [n for n in _MASK_TENSORS if n in masks]
    p.dtype = q.dtype


def _settings(p, allow=True):
    """The attention op's typed keyword arguments of a block (allow: a block may hide a row's
    every key; the merge of the blocks sees the rows that none shows)."""
    return {**p.settings, "allow_fully_masked": allow or p.allow_fully_masked}


def _block_masks(p, qa, qb, ka, kb):
    """{name: mask tensor} of a block."""
    out = {}
    for n in p.mask_names:
        t = p.masks[n]
        if n == "query_documents":
            t = t[:, qa:qb].contiguous()
        elif n == "key_documents":
            t = t[:, ka:kb].contiguous()
        elif n == "mask":
            t = t[:, qa:qb, ka:kb].contiguous()
        out[n] = t
    return out


def _block_hidden(p, qa, qb, ka, kb):
    """True when the causal / window / chunk masks hide every cell of the block in every row."""
    if qb <= qa or kb <= ka:
        return True
    if not p.skippable or not (p.causal or p.window or p.chunk):
        return False
    qmin, qmax = _minmax(p.qpos, qa, qb)
    kmin, kmax = _minmax(p.kpos, ka, kb)
    hidden = torch.zeros(torch.broadcast_shapes(qmin.shape, kmin.shape), dtype=torch.bool)
    if p.causal:
        hidden |= kmin > qmax
    if p.window:
        w = int(p.window)
        hidden |= (kmin - qmax >= w) | (qmin - kmax >= w)
    if p.chunk:
        ch = int(p.chunk)
        hidden |= (torch.div(kmax, ch, rounding_mode="floor") <
                   torch.div(qmin, ch, rounding_mode="floor"))
        hidden |= (torch.div(kmin, ch, rounding_mode="floor") >
                   torch.div(qmax, ch, rounding_mode="floor"))
    return bool(hidden.all())


def _visible_pairs(p, qa, qb, ka, kb):
    """Query-key pairs of a block the causal / window masks leave (for the statistics)."""
    n = (qb - qa) * (kb - ka)
    if not p.causal or p.qpos.dim() != 1 or p.kpos.dim() != 1:
        return n
    qp = p.qpos[qa:qb]
    kp = p.kpos[ka:kb]
    srt = torch.sort(kp).values
    return int(torch.searchsorted(srt, qp, right=True).sum())
