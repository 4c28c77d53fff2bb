"""posenc.torch.flex: posenc's positional schemes on PyTorch's FlexAttention.

FlexAttention (``torch.nn.attention.flex_attention``) compiles a ``score_mod`` (a function of
one score and its batch, head, query and key indices) and a ``block_mask`` into fused kernels
with a backward, on CUDA GPUs and on the CPU. This module writes posenc's schemes in that form,
with posenc's exact semantics (docs/attention.md, docs/flex.md):

- ``attention(q, k, v, scheme=None, *, params=None, return_lse=False, **keywords)``: the
  layout, keywords and result of ``posenc.torch.attention`` (q [batch, seq_q, heads_q,
  head_dim], k and v [batch, seq_k, heads_kv, head_dim]), computed by ``flex_attention`` on the
  tensors' device; gradients reach q, k, v and every table in ``params`` (T5's table, ALiBi's
  slopes, Shaw's rel_k, DeBERTa's pos_key and pos_query, the sinks).
- ``score_mod(scheme, q, k, ...)`` and ``block_mask(q_len, k_len, ...)`` for callers of
  ``flex_attention`` itself; ``apply_sinks(out, lse, sinks)`` adds attention sinks afterwards.

Schemes: none, rope (q and k rotated by posenc's RoPE before the call), alibi (any head count,
fixed or learned slopes), t5, shaw (relative keys through a per-row table q·rel_k, O(seq_q·K)),
deberta (c2p and p2c through tables q·pos_key and k·pos_query, O(seq·K)); masks: causal, window,
chunk, documents, prefix, global tokens, a dense mask, packed sequences (cu_seqlens); sinks,
soft-capping, GQA / MQA, explicit (per-row) positions. Shaw's relative values and
Transformer-XL cannot be written as a score_mod in O(seq·K) memory: they raise
``UnsupportedScheme`` naming posenc's own fused kernel, ``posenc.torch.attention``.
"""

import math
import threading

import numpy as np
import torch

from .. import _posenc
from ._keywords import PACKED_KEYWORDS as _PACKED_KEYWORDS
from ._keywords import VISIBILITY_KEYWORDS as _VISIBILITY_KEYWORDS

__all__ = ["attention", "score_mod", "mask_mod", "block_mask", "apply_sinks",
           "UnsupportedScheme", "SCHEMES"]

# Schemes this module computes; the others of posenc.schemes() are refused.
SCHEMES = ("none", "rope", "alibi", "t5", "shaw", "deberta")

_POSITION_LIMIT = 2 ** 48
# Each scheme's settings (keywords) and parameter tables, as the registry declares them.
_REGISTRY = {s["name"]: s for s in _posenc.schemes() if s["name"] in SCHEMES}
_SETTINGS = {n: tuple(x["keyword"] for x in s["settings"]) for n, s in _REGISTRY.items()}
_TABLES = {n: tuple(p["name"] for p in s["params"]) for n, s in _REGISTRY.items()}
_COMMON = _VISIBILITY_KEYWORDS + ("scale", "softcap", "allow_fully_masked",
                                  "num_threads") + _PACKED_KEYWORDS


class UnsupportedScheme(ValueError, NotImplementedError):
    """A scheme (or a part of one) that FlexAttention cannot express in O(seq·K) memory:
    Transformer-XL and Shaw's relative values. posenc.torch.attention computes them."""


def _refuse(scheme, what):
    return UnsupportedScheme(
        f"posenc.torch.flex: {what} cannot be written as a FlexAttention score_mod in "
        f"O(seq * K) memory; use posenc's own fused kernel, posenc.torch.attention(q, k, v, "
        f"{scheme!r}, params=...), which computes it (forward and backward)")


def _check_scheme(scheme, params):
    if scheme is None:
        scheme = "none"
    if not isinstance(scheme, str):
        raise TypeError(f"scheme: a name ({', '.join(SCHEMES)}), got {type(scheme).__name__}")
    if scheme == "xl":
        raise _refuse("xl", "Transformer-XL's position term (q + v)·W_r·R(pos_q - pos_k), a "
                      "[heads, head_dim] vector per distance,")
    if scheme not in SCHEMES:
        raise ValueError(f"scheme: '{scheme}' (posenc.torch.flex computes "
                         f"{', '.join(SCHEMES)}; 'xl' only posenc.torch.attention)")
    if scheme == "shaw" and params is not None and params.get("rel_v") is not None:
        raise _refuse("shaw", "Shaw's relative values (rel_v: out_i += Σ_j α_ij·rel_v[idx_ij])")
    return scheme


# ---------------------------------------------------------------------------------------------
# Positions


class _Pos:
    """Positions of one side: an offset (token i at offset + i) or ids [1 or batch, seq]."""

    def __init__(self, offset=None, ids=None):
        self.offset, self.ids = offset, ids

    @property
    def per_row(self):
        return self.ids is not None and self.ids.shape[0] > 1

    def at(self, b, i):
        """Positions at batch indices b and token indices i (tensors, broadcast)."""
        if self.ids is None:
            return i + self.offset if self.offset else i
        if self.ids.shape[0] == 1:
            return self.ids[0][i]
        return self.ids[b, i]

    def bounds(self, seq):
        """(smallest, largest) position (Python ints; seq > 0)."""
        if self.ids is None:
            return self.offset, self.offset + seq - 1
        return int(self.ids.min()), int(self.ids.max())

    def dense(self, batch, seq, device):
        """int64 [batch or 1, seq]."""
        if self.ids is not None:
            return self.ids
        return torch.arange(seq, device=device).add_(self.offset)[None]


def _positions(value, seq, batch, what, device, default):
    if value is None:
        return _Pos(offset=default)
    if isinstance(value, bool):
        raise TypeError(f"{what}: None, an int offset or int ids [seq] / [batch, seq]")
    if isinstance(value, (int, np.integer)):
        value = int(value)
        if value < 0 or value + max(seq - 1, 0) > _POSITION_LIMIT:
            raise ValueError(f"{what}: offset {value} puts positions outside [0, 2^48]")
        return _Pos(offset=value)
    t = value if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{what}: integer ids, got {t.dtype}")
    if t.dim() == 1:
        t = t[None]
    if t.dim() != 2 or t.shape[1] != seq or t.shape[0] not in (1, batch):
        raise ValueError(f"{what}: ids of shape [{seq}] or [{batch}, {seq}], got "
                         f"{list(value.shape) if hasattr(value, 'shape') else list(t.shape)}")
    t = t.to(device=device, dtype=torch.int64)
    if t.numel() and not torch.compiler.is_compiling():
        lo, hi = int(t.min()), int(t.max())
        if lo < 0 or hi > _POSITION_LIMIT:
            bad = lo if lo < 0 else hi
            raise ValueError(f"{what}: position {bad} is outside [0, 2^48]")
    return _Pos(ids=t)


# ---------------------------------------------------------------------------------------------
# Masks


class _MaskSpec:
    """Everything the mask reads (positions, documents, prefix, global tokens, dense mask)."""

    def __init__(self, batch, q_len, k_len, device, *, causal=False, window=None, chunk=None,
                 query_positions=None, key_positions=None, query_documents=None,
                 key_documents=None, prefix=None, global_positions=None, mask=None):
        if q_len < 0 or k_len < 0:
            raise ValueError("sequence lengths must be >= 0")
        default_q = k_len - q_len
        if query_positions is None and default_q < 0:
            raise ValueError(f"seq_q ({q_len}) > seq_k ({k_len}) with default positions (query i "
                             f"at seq_k - seq_q + i); pass query_positions and key_positions")
        self.batch, self.q_len, self.k_len, self.device = batch, q_len, k_len, device
        self.qpos = _positions(query_positions, q_len, batch, "query_positions", device,
                               max(default_q, 0))
        self.kpos = _positions(key_positions, k_len, batch, "key_positions", device, 0)
        if not isinstance(causal, (bool, np.bool_)):
            raise TypeError(f"causal: a bool, got {type(causal).__name__}")
        self.causal = bool(causal)
        self.window = _opt_int(window, "window")
        self.chunk = _opt_int(chunk, "chunk")
        self.qdoc = self.kdoc = self.prefix = self.gq = self.gk = self.dense = None
        if (query_documents is None) != (key_documents is None):
            raise ValueError("query_documents and key_documents: give both or neither")
        if query_documents is not None:
            self.qdoc = _int_table(query_documents, (batch, q_len), "query_documents", device)
            self.kdoc = _int_table(key_documents, (batch, k_len), "key_documents", device)
        if prefix is not None:
            p = _int_table(prefix, None, "prefix", device).reshape(-1)
            if p.numel() and int(p.min()) < 0:
                raise ValueError(f"prefix: lengths must be >= 0, got {int(p.min())}")
            if self.qdoc is None:
                if p.numel() != batch:
                    raise ValueError(f"prefix: one length per batch row [{batch}] (or one per "
                                     f"document id with documents), got {p.numel()}")
            else:
                n = int(max(int(self.qdoc.max()), int(self.kdoc.max()))) + 1 if \
                    self.qdoc.numel() + self.kdoc.numel() else 0
                lo = min(int(self.qdoc.min()) if self.qdoc.numel() else 0,
                         int(self.kdoc.min()) if self.kdoc.numel() else 0)
                if lo < 0 or n > p.numel():
                    raise ValueError(f"prefix: {p.numel()} lengths, but document ids span "
                                     f"[{lo}, {n - 1}]")
            self.prefix = p
        if global_positions is not None:
            g = torch.as_tensor(np.asarray(list(global_positions), dtype=np.int64)
                                if not isinstance(global_positions, torch.Tensor)
                                else global_positions).reshape(-1).to(device, torch.int64)
            qd = self.qpos.dense(batch, q_len, device)
            kd = self.kpos.dense(batch, k_len, device)
            self.gq = torch.isin(qd, g)
            self.gk = torch.isin(kd, g)
        if mask is not None:
            m = mask if isinstance(mask, torch.Tensor) else torch.as_tensor(np.asarray(mask))
            if m.dim() != 3 or m.shape[0] not in (1, batch) or tuple(m.shape[1:]) != (q_len,
                                                                                    k_len):
                raise ValueError(f"mask: [batch or 1, seq_q, seq_k] = [{batch}, {q_len}, "
                                 f"{k_len}], got {list(m.shape)}")
            self.dense = m.to(device=device, dtype=torch.bool)

    @property
    def per_row(self):
        """Whether the mask differs between batch rows."""
        return bool(self.qpos.per_row or self.kpos.per_row or self.qdoc is not None
                    or (self.prefix is not None) or (self.gq is not None and self.gq.shape[0] > 1)
                    or (self.gk is not None and self.gk.shape[0] > 1)
                    or (self.dense is not None and self.dense.shape[0] > 1))

    @property
    def trivial(self):
        """No key is ever hidden."""
        return not (self.causal or self.window is not None or self.chunk is not None
                    or self.qdoc is not None or self.dense is not None)

    def mask_mod(self):
        """mask_mod(b, h, q_idx, kv_idx) -> bool: posenc's visibility rule."""
        qpos, kpos = self.qpos, self.kpos
        causal, window, chunk = self.causal, self.window, self.chunk
        qdoc, kdoc, prefix, gq, gk, dense = (self.qdoc, self.kdoc, self.prefix, self.gq,
                                             self.gk, self.dense)
        open_keys = prefix is not None or gq is not None

        def mod(b, h, q_idx, kv_idx):
            pq = qpos.at(b, q_idx)
            pk = kpos.at(b, kv_idx)
            rel = pk - pq
            vis = rel <= 0 if causal else None
            if window is not None:
                w = (rel < window) & (rel > -window)
                vis = w if vis is None else vis & w
            if chunk is not None:
                c = torch.div(pk, chunk, rounding_mode="floor") == torch.div(
                    pq, chunk, rounding_mode="floor")
                vis = c if vis is None else vis & c
            if vis is None:
                vis = rel == rel
            if open_keys:
                if prefix is not None:
                    lim = prefix[kdoc[b, kv_idx]] if qdoc is not None else prefix[b]
                    vis = vis | (pk < lim)
                if gq is not None:
                    vis = vis | _row(gq, b, q_idx) | _row(gk, b, kv_idx)
            if qdoc is not None:
                vis = vis & (qdoc[b, q_idx] == kdoc[b, kv_idx])
            if dense is not None:
                vis = vis & (dense[b, q_idx, kv_idx] if dense.shape[0] > 1
                             else dense[0][q_idx, kv_idx])
            return vis

        return mod


def _row(t, b, i):
    return t[b, i] if t.shape[0] > 1 else t[0][i]


def _opt_int(value, what):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{what}: an int >= 1, got {value!r}")
    if value < 1:
        raise ValueError(f"{what}: must be >= 1, got {value}")
    return int(value)


def _int_table(value, shape, what, device):
    t = value if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))
    if t.dtype.is_floating_point or t.dtype.is_complex:
        raise TypeError(f"{what}: integer ids, got {t.dtype}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{what}: shape {list(shape)}, got {list(t.shape)}")
    return t.to(device=device, dtype=torch.int64)


def _flex():
    from torch.nn.attention import flex_attention as fa
    return fa


def _create_block_mask(spec, device, block_size, compile):
    fa = _flex()
    if compile is None:
        compile = device.type != "cpu" and spec.q_len * spec.k_len > 2 ** 24
    return fa.create_block_mask(spec.mask_mod(), spec.batch if spec.per_row else None, None,
                                spec.q_len, spec.k_len, device=device, BLOCK_SIZE=block_size,
                                _compile=bool(compile))


def mask_mod(q_len, k_len, *, batch=1, device="cpu", **keywords):
    """posenc's visibility rule as a FlexAttention mask_mod(b, h, q_idx, kv_idx) -> bool.

    keywords: causal, window, chunk, query_positions, key_positions (None, an int offset, ids
    [seq] or [batch, seq]; default key j at j, query i at k_len - q_len + i), query_documents,
    key_documents ([batch, seq] ints), prefix, global_positions, mask ([batch or 1, q_len,
    k_len] bool): the masks of posenc.torch.attention (docs/attention.md, Masks and Block
    masks)."""
    _only(keywords, _VISIBILITY_KEYWORDS, "mask_mod")
    return _MaskSpec(batch, q_len, k_len, torch.device(device), **keywords).mask_mod()


def block_mask(q_len, k_len, *, batch=1, device="cpu", block_size=128, compile=None,
               **keywords):
    """A FlexAttention BlockMask of posenc's masks, for flex_attention(..., block_mask=...).

    keywords as mask_mod (causal, window, chunk, positions, documents, prefix,
    global_positions, mask). The mask has batch rows only when it differs between rows (per-row
    positions, documents, prefix, per-row dense mask), else it broadcasts over batch and heads.
    compile: build it with torch.compile (block by block, no [q_len, k_len] tensor); None:
    on GPUs when q_len * k_len > 2^24. A row that sees no key gives out = 0 and lse = -inf in
    flex_attention (posenc.torch.flex.attention raises unless allow_fully_masked or sinks)."""
    _only(keywords, _VISIBILITY_KEYWORDS, "block_mask")
    device = torch.device(device)
    spec = _MaskSpec(batch, q_len, k_len, device, **keywords)
    return _create_block_mask(spec, device, block_size, compile)


def _only(keywords, allowed, fn):
    for name in keywords:
        if name not in allowed:
            raise TypeError(f"{fn}() got an unexpected keyword argument '{name}'")


# ---------------------------------------------------------------------------------------------
# Score mods


def _table(params, name, scheme):
    t = params.get(name)
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        t = torch.as_tensor(np.asarray(t))
    if not t.dtype.is_floating_point:
        raise TypeError(f"params['{name}']: a floating-point tensor, got {t.dtype}")
    if not torch.compiler.is_compiling() and not bool(torch.isfinite(t.detach()).all()):
        raise ValueError(f"params['{name}']: non-finite values")
    return t


def _shape_error(name, want, got):
    return ValueError(f"params['{name}']: shape {want}, got {list(got)}")


def _saturation(index_of, start):
    """The smallest T >= start (doubling) with index_of(+-T) == index_of(+-2^48): beyond T the
    index no longer changes (the bucket maps are monotone and saturate)."""
    far = np.array([-_POSITION_LIMIT, _POSITION_LIMIT], np.int64)
    want = index_of(far)
    t = max(int(start), 1)
    while not np.array_equal(index_of(np.array([-t, t], np.int64)), want):
        t *= 2
        if t > _POSITION_LIMIT:
            return _POSITION_LIMIT
    return t


# The largest table of distances a score_mod gathers from (2^24 entries).
_MAX_DISTANCES = 1 << 24


def _distance_reach(index_of, start, spec, what):
    """T for a table of the distances [-T, T] that a score_mod reads with rel.clamp(-T, T): where
    the index saturates (_saturation from start), or the largest distance the call's positions
    reach when that is smaller (the clamp then never changes a distance). ValueError when the
    table would exceed _MAX_DISTANCES."""
    t = _saturation(index_of, start)
    lq, lk = spec.q_len, spec.k_len
    if not torch.compiler.is_compiling() and lq > 0 and lk > 0:
        qlo, qhi = spec.qpos.bounds(lq)
        klo, khi = spec.kpos.bounds(lk)
        t = min(t, max(qhi - klo, khi - qlo, 1))
    if 2 * t + 1 > _MAX_DISTANCES:
        raise ValueError(f"{what}: the positions reach distances whose {what} index table would "
                         f"hold {2 * t + 1} entries (more than {_MAX_DISTANCES}); "
                         f"posenc.torch.attention takes them")
    return t


class _Terms:
    """A scheme's score terms: tensors (on the device) and the score_mod over them."""

    def __init__(self, scheme, q, k, params, settings, spec, scale, softcap, heads_q, head_dim):
        self.scheme = scheme
        self.scale = scale
        params = dict(params or {})
        for name in params:
            if name not in _TABLES[scheme] + ("sinks",):
                raise ValueError(f"params: '{name}' is not a table of scheme '{scheme}' "
                                 f"(its tables: {', '.join(_TABLES[scheme] + ('sinks',))})")
        self.sinks = _table(params, "sinks", scheme)
        if self.sinks is not None and tuple(self.sinks.shape) != (heads_q,):
            raise _shape_error("sinks", f"[heads_q] = [{heads_q}]", self.sinks.shape)
        qpos, kpos = spec.qpos, spec.kpos
        dev = spec.device
        self.mod = None
        if scheme == "alibi":
            slopes = _table(params, "slopes", scheme)
            if slopes is None:
                slopes = torch.from_numpy(_posenc.alibi_slopes(
                    heads_q, max_bias=settings.get("max_bias", 8.0)))
            elif "max_bias" in settings:
                raise ValueError("alibi: give slopes or max_bias, not both")
            if tuple(slopes.shape) != (heads_q,):
                raise _shape_error("slopes", f"[heads_q] = [{heads_q}]", slopes.shape)
            m = slopes.to(dev, torch.float32)

            def term(score, b, h, q_idx, kv_idx):
                rel = kpos.at(b, kv_idx) - qpos.at(b, q_idx)
                return score - m[h] * rel.abs().to(torch.float32)
            self.mod = term
        elif scheme == "t5":
            table = _table(params, "relative_attention_bias", scheme)
            if table is None:
                raise ValueError("t5: params['relative_attention_bias'] [num_buckets, heads] "
                                 "is required")
            if table.dim() != 2 or table.shape[1] != heads_q:
                raise _shape_error("relative_attention_bias", f"[num_buckets, {heads_q}]",
                                   table.shape)
            nb = table.shape[0]
            if settings.get("num_buckets") not in (None, nb):
                raise ValueError(f"num_buckets ({settings['num_buckets']}) must equal "
                                 f"relative_attention_bias's rows ({nb})")
            md = settings.get("max_distance", 128)
            bidir = settings.get("bidirectional")
            bidir = (not spec.causal) if bidir is None else bool(bidir)

            def bucket(rel):
                return _posenc.t5_bucket(rel, num_buckets=nb, max_distance=md,
                                         bidirectional=bidir)
            bucket(np.zeros(1, np.int64))  # validates the settings (ValueError naming them)
            t = _distance_reach(bucket, md + 1, spec, "t5")
            idx = torch.from_numpy(np.asarray(bucket(np.arange(-t, t + 1)), np.int64)).to(dev)
            # bias by distance [heads, 2T + 1], differentiable in the table (a gather)
            bias = table.to(dev, torch.float32).index_select(0, idx).t().contiguous()

            def term(score, b, h, q_idx, kv_idx):
                rel = kpos.at(b, kv_idx) - qpos.at(b, q_idx)
                return score + bias[h, rel.clamp(-t, t) + t]
            self.mod = term
        elif scheme == "shaw":
            rk = _table(params, "rel_k", scheme)
            if rk is None:
                raise ValueError("shaw: params['rel_k'] [2K+1, head_dim] (or [2K+1, heads, "
                                 "head_dim]) is required")
            if rk.dim() == 2:
                ok = rk.shape[1] == head_dim
            else:
                ok = rk.dim() == 3 and rk.shape[1] in (1, heads_q) and rk.shape[2] == head_dim
            if not ok or rk.shape[0] % 2 == 0:
                raise _shape_error("rel_k", f"[2K+1, {head_dim}] or [2K+1, {heads_q}, "
                                   f"{head_dim}] (an odd row count)", rk.shape)
            K = (rk.shape[0] - 1) // 2
            rk = rk.to(dev, torch.float32)
            if rk.dim() == 2:
                qa = torch.einsum("blhd,ud->bhlu", q.float(), rk)
            else:
                qa = torch.einsum("blhd,uhd->bhlu", q.float(), rk.expand(-1, heads_q, -1))
            qa = qa * scale  # [batch, heads_q, seq_q, 2K + 1]: scale·q_i·rel_k[u]
            qb = qa.shape[0] > 1

            def term(score, b, h, q_idx, kv_idx):
                rel = kpos.at(b, kv_idx) - qpos.at(b, q_idx)
                u = rel.clamp(-K, K) + K
                return score + (qa[b, h, q_idx, u] if qb else qa[0][h, q_idx, u])
            self.mod = term
        elif scheme == "deberta":
            pk_t = _table(params, "pos_key", scheme)
            pq_t = _table(params, "pos_query", scheme)
            if pk_t is None or pq_t is None:
                raise ValueError("deberta: params['pos_key'] and params['pos_query'] [2K, "
                                 "heads, head_dim] are required")
            mr = settings.get("max_relative_positions", 512)
            pb = settings.get("position_buckets", 0)
            p2c = settings.get("deberta_p2c", "model")
            if p2c == "spec":
                p2c = "paper"
            if p2c not in ("model", "paper"):
                raise ValueError(f"deberta_p2c: 'model' or 'paper', got {p2c!r}")
            f64 = bool(settings.get("deberta_float64_log", False))

            def rho_bucket(rho):
                return np.asarray(_posenc.deberta_bucket(
                    rho, max_relative_positions=mr, position_buckets=pb, float64_log=f64),
                    np.int64)
            rho_bucket(np.zeros(1, np.int64))  # validates the settings (before the tables)
            span = pb if pb > 0 else mr
            for name, t_ in (("pos_key", pk_t), ("pos_query", pq_t)):
                if tuple(t_.shape) != (2 * span, heads_q, head_dim):
                    raise _shape_error(name, f"[2K, heads, head_dim] = [{2 * span}, {heads_q}, "
                                       f"{head_dim}] (K = {span})", t_.shape)

            def c2p_of(rho):
                return np.clip(rho_bucket(rho) + span, 0, 2 * span - 1)

            t = _distance_reach(c2p_of, span + 1, spec, "deberta")
            rhos = np.arange(-t, t + 1)
            c2p = torch.from_numpy(c2p_of(rhos)).to(dev)
            p2c_idx = c2p if p2c == "model" else torch.from_numpy(
                np.clip(-rho_bucket(rhos) + span, 0, 2 * span - 1)).to(dev)
            group = heads_q // k.shape[2]
            kq = k.float().repeat_interleave(group, dim=2) if group > 1 else k.float()
            # [batch, heads_q, seq, 2K]: scale·q_i·pos_key[u, h] and scale·k_j·pos_query[u, h]
            qpk = torch.einsum("blhd,uhd->bhlu", q.float(), pk_t.to(dev, torch.float32)) * scale
            kpq = torch.einsum("blhd,uhd->bhlu", kq, pq_t.to(dev, torch.float32)) * scale

            def term(score, b, h, q_idx, kv_idx):
                rho = qpos.at(b, q_idx) - kpos.at(b, kv_idx)
                r = rho.clamp(-t, t) + t
                return score + qpk[b, h, q_idx, c2p[r]] + kpq[b, h, kv_idx, p2c_idx[r]]
            self.mod = term
        if softcap is not None:
            if isinstance(softcap, bool) or not isinstance(softcap, (int, float, np.floating,
                                                                     np.integer)):
                raise TypeError(f"softcap: a float > 0, got {softcap!r}")
            cap = float(softcap)
            if not math.isfinite(cap) or cap <= 0:
                raise ValueError(f"softcap: must be a finite value > 0, got {softcap}")
            inner = self.mod
            # a tensor: a Python float captured by a score_mod becomes a symbolic input that
            # flex_attention's operator rejects
            cap_t = torch.tensor(cap, dtype=torch.float32, device=dev)

            def capped(score, b, h, q_idx, kv_idx):
                s = inner(score, b, h, q_idx, kv_idx) if inner is not None else score
                return cap_t * torch.tanh(s / cap_t)
            self.mod = capped


def _default_scale(scheme, head_dim, scale):
    if scale is None:
        return 1.0 / math.sqrt(3 * head_dim if scheme == "deberta" else head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)):
        raise TypeError(f"scale: a float, got {scale!r}")
    if not math.isfinite(float(scale)):
        raise ValueError(f"scale: must be finite, got {scale}")
    return float(scale)


def _split(scheme, keywords, fn):
    settings, common = {}, {}
    for name, value in keywords.items():
        if name in _SETTINGS[scheme]:
            settings[name] = value
        elif name in _COMMON:
            common[name] = value
        elif any(name in s for s in _SETTINGS.values()):
            raise TypeError(f"{fn}(): '{name}' is a setting of another scheme, not of "
                            f"'{scheme}'")
        elif name in ("config", "layer", "query_temperature"):
            raise TypeError(f"{fn}(): '{name}' is not supported by posenc.torch.flex; pass the "
                            f"scheme and its settings explicitly (posenc.torch.attention takes "
                            f"it)")
        else:
            raise TypeError(f"{fn}() got an unexpected keyword argument '{name}'")
    return settings, common


def score_mod(scheme=None, q=None, k=None, *, params=None, scale=None, softcap=None,
              layout="blhd", heads=None, q_len=None, k_len=None, batch=None, device=None,
              **keywords):
    """posenc's scheme as a FlexAttention score_mod(score, b, h, q_idx, kv_idx).

    Pass the returned function with ``scale=fn.scale`` to ``flex_attention`` (the score it
    receives is ``scale·q·k``; the scheme's terms are added as posenc's score order says:
    ``scale·(q·k + relative-content terms) + bias``, then ``softcap``). q, k: the tensors of the
    call, in posenc's layout [batch, seq, heads, head_dim] (layout='bhld': flex_attention's
    [batch, heads, seq, head_dim]); Shaw and DeBERTa build their tables from them (scale·q·rel_k
    [batch, heads, seq_q, 2K+1], scale·q·pos_key and scale·k·pos_query [batch, heads, seq, 2K]),
    so gradients reach q, k and the tables through the score_mod. Without q and k (none, alibi,
    t5): heads (default: the tables' heads), q_len and k_len (default: the lengths of the
    position ids, else equal lengths, query i at position i), batch with per-row positions,
    device (where its tables go; default q's device, else the CPU), and scale (fn.scale None:
    flex_attention's default 1/sqrt(head_dim), posenc's default too). keywords: the scheme's settings (max_bias;
    num_buckets, max_distance, bidirectional; position_buckets, max_relative_positions,
    deberta_p2c, deberta_float64_log), causal (T5's bucket direction) and the positions
    (query_positions, key_positions). Masks are block_mask's; sinks are apply_sinks'. RoPE is
    no score term: rotate q and k with posenc.torch.rope and use scheme 'none'."""
    scheme = _check_scheme(scheme, params)
    if scheme == "rope":
        raise ValueError("score_mod('rope'): RoPE rotates q and k, it adds no score term; "
                         "rotate them with posenc.torch.rope(x, positions=...) and use scheme "
                         "'none' (posenc.torch.flex.attention does this)")
    if layout not in ("blhd", "bhld"):
        raise ValueError(f"layout: 'blhd' or 'bhld', got {layout!r}")
    if layout == "bhld":
        q = q.transpose(1, 2) if q is not None else None
        k = k.transpose(1, 2) if k is not None else None
    if scheme in ("shaw", "deberta") and (q is None or (scheme == "deberta" and k is None)):
        raise ValueError(f"score_mod('{scheme}'): q (and k for deberta) are required: the "
                         f"scheme's per-row tables are products with them")
    settings, common = _split(scheme, keywords, "score_mod")
    for name in common:
        if name not in ("causal", "query_positions", "key_positions"):
            raise TypeError(f"score_mod(): '{name}' belongs to block_mask (masks) or attention")
    batch = batch or (q.shape[0] if q is not None else 1)
    heads_q = heads or (q.shape[2] if q is not None else _heads_of(params))
    if heads_q is None:
        raise ValueError(f"score_mod('{scheme}'): give q, or heads (the query heads)")
    q_len = q_len if q_len is not None else (
        q.shape[1] if q is not None else _len_of(common.get("query_positions")))
    k_len = k_len if k_len is not None else (
        k.shape[1] if k is not None else _len_of(common.get("key_positions")))
    if q_len is None or k_len is None:
        # lengths unknown: default positions are the indices on both sides (q_len == k_len)
        q_len = k_len = q_len if q_len is not None else (k_len if k_len is not None else 0)
    head_dim = q.shape[3] if q is not None else 0
    if device is None:
        device = q.device if q is not None else torch.device("cpu")
    device = torch.device(device)
    spec = _MaskSpec(batch, q_len, k_len, device, **common)
    # The score_mod of none, alibi and t5 adds terms after the scale: without q and scale, it
    # leaves the scale to flex_attention's default, 1/sqrt(head_dim) (posenc's default too).
    s = _default_scale(scheme, head_dim, scale) if (scale is not None or q is not None) else None
    terms = _Terms(scheme, q, k, params, settings, spec, s if s is not None else 1.0, softcap,
                   heads_q, head_dim)
    if terms.sinks is not None:
        raise ValueError("score_mod: sinks are not a score term; apply them to flex_attention's "
                         "result with posenc.torch.flex.apply_sinks(out, lse, sinks)")
    fn = terms.mod

    def mod(score, b, h, q_idx, kv_idx):
        return fn(score, b, h, q_idx, kv_idx) if fn is not None else score
    mod.scale = s
    return mod


def _heads_of(params):
    """The query heads a scheme's tables show (None if they do not)."""
    for name, axis in (("relative_attention_bias", 1), ("slopes", 0), ("pos_key", 1),
                       ("pos_query", 1), ("sinks", 0)):
        t = (params or {}).get(name)
        if t is not None and len(np.shape(t)) > axis:
            return int(np.shape(t)[axis])
    t = (params or {}).get("rel_k")
    if t is not None and len(np.shape(t)) == 3 and np.shape(t)[1] > 1:
        return int(np.shape(t)[1])
    return None


def _len_of(positions):
    """The length of explicit position ids (None for None or an offset)."""
    if positions is None or isinstance(positions, (int, np.integer)):
        return None
    return int(np.shape(positions)[-1])


def apply_sinks(out, lse, sinks, *, layout="bhld"):
    """Attention sinks (gpt-oss) added to a finished attention: (out, lse).

    out, lse: flex_attention's output [batch, heads, seq_q, v_dim] (layout='blhd': [batch,
    seq_q, heads, v_dim]) and log-sum-exp [batch, heads, seq_q]; sinks [heads]. A sink logit
    joins every row's softmax denominator: out·σ(lse - sink) and log(exp(lse) + exp(sink)),
    exact (docs/attention.md, Attention sinks), differentiable in out, lse and sinks (FlexAttention
    carries the gradient of lse into q and k). A row with no visible key (lse = -inf) gets
    out = 0 and lse = sink."""
    s = sinks.to(device=lse.device, dtype=torch.float32)[None, :, None]
    w = torch.sigmoid(lse.float() - s)
    w = w.unsqueeze(-1) if layout == "bhld" else w.transpose(1, 2).unsqueeze(-1)
    return (out.float() * w).to(out.dtype), torch.logaddexp(lse.float(), s)


# ---------------------------------------------------------------------------------------------
# RoPE


def _rope(x, pos, settings, seq_len, batch):
    """RoPE of x [batch, seq, heads, head_dim] at positions pos (_Pos): posenc's rope op on the
    CPU; elsewhere the same frequencies (posenc.rope_frequencies) and angles in float64."""
    from . import rope as posenc_rope
    kw = {n: settings[n] for n in ("style", "rotary_dim", "base", "scaling", "angles", "freqs")
          if n in settings}
    if "scaling" in kw or "freqs" not in kw:
        kw["seq_len"] = seq_len
    positions = pos.offset if pos.ids is None else pos.ids
    if x.device.type == "cpu":
        if pos.ids is not None and pos.ids.shape[0] == 1 and batch > 1:
            positions = pos.ids[0]
        return posenc_rope(x, kw.pop("freqs", None), positions=positions, **kw)
    return _rope_torch(x, pos, kw, seq_len)


def _rope_torch(x, pos, kw, seq_len):
    """RoPE in PyTorch operations on x's device: posenc's frequencies (posenc.rope_frequencies,
    or kw['freqs']), angles p·inv_freq in float64 (float32 with angles='float32'), cos and sin
    (times the attention factor) rounded to float32, the rotation in float32."""
    f = kw.get("freqs")
    if f is None:
        f = _posenc.rope_frequencies(x.shape[-1], rotary_dim=kw.get("rotary_dim", 0),
                                     base=kw.get("base", 1e4), scaling=kw.get("scaling"),
                                     seq_len=seq_len, angles=kw.get("angles", "accurate"))
    style = kw.get("style", "half")
    if style not in ("half", "interleaved"):
        raise ValueError(f"style: 'half' or 'interleaved', got {style!r}")
    inv = torch.as_tensor(np.asarray(f.inv_freq, np.float64), device=x.device)
    r = 2 * inv.numel()
    p = pos.dense(x.shape[0], x.shape[1], x.device)  # [1 or batch, seq]
    if f.angles == "float32":
        ang = (p.float()[..., None] * inv.float()).double()
    else:
        ang = p.double()[..., None] * inv
    af = float(f.attention_factor)
    c = (torch.cos(ang) * af).float()[:, :, None, :]  # [1 or batch, seq, 1, R/2]
    s = (torch.sin(ang) * af).float()[:, :, None, :]
    xf = x.float()
    rot, rest = xf[..., :r], xf[..., r:]
    if style == "half":
        a, b = rot[..., :r // 2], rot[..., r // 2:]
        y = torch.cat([a * c - b * s, b * c + a * s], dim=-1)
    else:
        a, b = rot[..., 0::2], rot[..., 1::2]
        y = torch.stack([a * c - b * s, b * c + a * s], dim=-1).flatten(-2)
    return torch.cat([y, rest], dim=-1).to(x.dtype)


# ---------------------------------------------------------------------------------------------
# attention


_CPU_GRAD_LOCK = threading.Lock()
_COMPILED = {}


def _call_flex(q, k, v, mod, bmask, scale, gqa, want_lse, compile):
    fa = _flex()
    kwargs = dict(score_mod=mod, block_mask=bmask, scale=scale, enable_gqa=gqa)
    if want_lse:
        if hasattr(fa, "AuxRequest"):
            kwargs["return_aux"] = fa.AuxRequest(lse=True)
        else:  # PyTorch before AuxRequest
            kwargs["return_lse"] = True
    if torch.compiler.is_compiling():
        fn = fa.flex_attention
    elif compile:
        fn = _COMPILED.get("flex")
        if fn is None:
            fn = _COMPILED["flex"] = torch.compile(fa.flex_attention, dynamic=False)
    else:
        fn = fa.flex_attention
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if not grad:  # FlexAttention's CPU check looks at requires_grad even under no_grad
        q, k, v = q.detach(), k.detach(), v.detach()
    if q.device.type == "cpu" and grad and not compile and not torch.compiler.is_compiling():
        # FlexAttention refuses q, k, v with requires_grad on the CPU up front, although its
        # eager (unfused, score-materializing) implementation differentiates there; let it run.
        with _CPU_GRAD_LOCK:
            check = getattr(fa, "_validate_device", None)
            if check is None:
                res = fn(q, k, v, **kwargs)
            else:
                fa._validate_device = lambda *a: None
                try:
                    res = fn(q, k, v, **kwargs)
                finally:
                    fa._validate_device = check
    else:
        res = fn(q, k, v, **kwargs)
    if want_lse:
        out, aux = res
        return out, getattr(aux, "lse", aux)
    return res, None


def _packed(q, k, v, common):
    """cu_seqlens_q / cu_seqlens_k: rank-3 q, k, v as one batch row with documents and
    per-sequence positions."""
    cq, ck = common.pop("cu_seqlens_q"), common.pop("cu_seqlens_k", None)
    if ck is None:
        raise ValueError("cu_seqlens_q and cu_seqlens_k: give both or neither")
    for name in ("query_documents", "key_documents"):
        if common.get(name) is not None:
            raise ValueError(f"{name} cannot be combined with cu_seqlens (the sequences are "
                             f"the documents)")
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError("with cu_seqlens, q [total_q, heads_q, D], k and v [total_k, "
                         "heads_kv, D] (rank 3)")
    dev = q.device
    cq = _int_table(cq, None, "cu_seqlens_q", dev).reshape(-1)
    ck = _int_table(ck, None, "cu_seqlens_k", dev).reshape(-1)
    for name, cu, total in (("cu_seqlens_q", cq, q.shape[0]), ("cu_seqlens_k", ck, k.shape[0])):
        if cu.numel() < 1 or int(cu[0]) != 0 or int(cu[-1]) != total or bool(
                (cu[1:] < cu[:-1]).any()):
            raise ValueError(f"{name}: offsets [num_seqs + 1] from 0, non-decreasing, ending at "
                             f"the total ({total})")
    if cq.numel() != ck.numel():
        raise ValueError(f"cu_seqlens_q ({cq.numel()}) and cu_seqlens_k ({ck.numel()}) must "
                         f"have the same length")
    tq, tk = q.shape[0], k.shape[0]
    qdoc = torch.searchsorted(cq[1:], torch.arange(tq, device=dev), right=True)
    kdoc = torch.searchsorted(ck[1:], torch.arange(tk, device=dev), right=True)
    lq, lk = cq[1:] - cq[:-1], ck[1:] - ck[:-1]
    if common.get("key_positions") is None:
        common["key_positions"] = torch.arange(tk, device=dev) - ck[kdoc]
    if common.get("query_positions") is None:
        qp = (lk - lq)[qdoc] + torch.arange(tq, device=dev) - cq[qdoc]
        if tq and int(qp.min()) < 0:
            raise ValueError("a sequence has more queries than keys with default positions; "
                             "pass query_positions and key_positions")
        common["query_positions"] = qp
    common["query_documents"] = qdoc[None]
    common["key_documents"] = kdoc[None]
    return q[None], k[None], v[None]


def attention(q, k, v, scheme=None, *, params=None, return_lse=False, compile=None,
              block_size=128, **keywords):
    """posenc.torch.attention computed by FlexAttention, on the tensors' device.

    The layout, keywords and result of posenc.torch.attention: q [batch, seq_q, heads_q,
    head_dim], k and v [batch, seq_k, heads_kv, head_dim] (GQA / MQA when heads_kv divides
    heads_q) give out [batch, seq_q, heads_q, v_dim] in q's dtype (and lse [batch, heads_q,
    seq_q] float32 with return_lse=True). scheme: none, rope, alibi, t5, shaw (rel_k only),
    deberta; params: {name: tensor} (slopes, relative_attention_bias, rel_k, pos_key,
    pos_query, sinks), tables with requires_grad get gradients. keywords: causal, scale,
    window, chunk, softcap, allow_fully_masked, query_positions, key_positions (None, an int
    offset, ids [seq] / [batch, seq]), query_documents, key_documents, prefix,
    global_positions, mask, cu_seqlens_q / cu_seqlens_k (rank-3 packed q, k, v), the scheme's
    settings (rope: base, rotary_dim, style, angles, seq_len, scaling, freqs; alibi:
    max_bias; t5: num_buckets, max_distance, bidirectional; deberta: position_buckets,
    max_relative_positions, deberta_p2c, deberta_float64_log); num_threads is accepted and
    ignored. 'xl' and Shaw's rel_v raise UnsupportedScheme (use posenc.torch.attention).

    RoPE: q and k are rotated by posenc's RoPE (posenc.torch.rope on the CPU, the same
    frequencies and float64 angles elsewhere) at their positions, then attended without
    positions. Sinks: flex_attention's log-sum-exp rescales the output (apply_sinks), exact and
    differentiable. A row with no visible key raises ValueError (naming it) unless
    allow_fully_masked or sinks (then out = 0); under torch.compile the check is skipped (such
    rows give 0).

    compile: run flex_attention through torch.compile (fused kernels); None: on GPUs yes, on
    the CPU no (the eager implementation, which materializes [seq_q, seq_k] scores per head and
    is the one with a backward on the CPU). Inside a torch.compile region flex_attention is
    traced into the caller's graph. On the CPU the compiled kernel is inference-only and
    returns no log-sum-exp, so return_lse and sinks need compile=False there. block_size:
    FlexAttention's mask block size (128)."""
    for bad in ("out", "lse"):
        if bad in keywords:
            raise TypeError(f"attention() got an unexpected keyword argument '{bad}'")
    for t, what in ((q, "q"), (k, "k"), (v, "v")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: a torch.Tensor, got {type(t).__name__}")
    if params is not None and not isinstance(params, dict):
        raise TypeError("params: a dict {name: tensor}")
    scheme = _check_scheme(scheme, params)
    settings, common = _split(scheme, keywords, "attention")
    common.pop("num_threads", None)
    given = {"q": q, "k": k, "v": v}
    packed = "cu_seqlens_q" in common or "cu_seqlens_k" in common
    if packed:
        q, k, v = _packed(q, k, v, common)
    for t, what in ((q, "q"), (k, "k"), (v, "v")):
        if t.dim() != 4:
            raise ValueError(f"{what}: [batch, seq, heads, head_dim] (rank 4), got rank {t.dim()}")
        if t.device != q.device:
            raise ValueError(f"{what} is on {t.device}, q on {q.device}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{what}: a floating-point tensor, got {t.dtype}")
    B, Lq, Hq, D = q.shape
    _, Lk, Hkv, _ = k.shape
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k: [batch, seq_k, heads_kv, head_dim] with batch {B} and head_dim "
                         f"{D}, got {list(k.shape)}")
    if tuple(v.shape[:3]) != tuple(k.shape[:3]) or v.shape[3] > D or v.shape[3] < 1:
        raise ValueError(f"v: [batch, seq_k, heads_kv, v_dim] like k {list(k.shape[:3])} with "
                         f"1 <= v_dim <= head_dim, got {list(v.shape)}")
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"k: kv heads ({Hkv}) must divide q heads ({Hq})")
    dev = q.device
    out_dtype = q.dtype
    if not (q.dtype == k.dtype == v.dtype):
        # one computing dtype, the widest of the three (posenc: q's dtype decides the result's)
        wide = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
        q, k, v = (x.to(wide) for x in (q, k, v))
    allow_empty = bool(common.pop("allow_fully_masked", False))
    if Lq == 0 or Lk == 0:
        return _empty(q, v, params, common, allow_empty, return_lse, packed)
    scale = _default_scale(scheme, D, common.pop("scale", None))
    softcap = common.pop("softcap", None)
    spec = _MaskSpec(B, Lq, Lk, dev, **common)
    if scheme == "rope":
        lo_q, hi_q = spec.qpos.bounds(Lq) if Lq else (0, -1)
        lo_k, hi_k = spec.kpos.bounds(Lk) if Lk else (0, -1)
        seq_len = settings.get("seq_len") or (max(hi_q, hi_k) + 1)
        q = _rope(q, spec.qpos, settings, seq_len, B)
        k = _rope(k, spec.kpos, settings, seq_len, B)
    terms = _Terms(scheme, q, k, params or {}, settings, spec, scale, softcap, Hq, D)
    sinks = terms.sinks
    if compile is None:
        compile = dev.type != "cpu"
    compiling = torch.compiler.is_compiling()
    cpu_compiled = dev.type == "cpu" and (compile or compiling)
    if cpu_compiled and (return_lse or sinks is not None):
        raise NotImplementedError(
            "posenc.torch.flex: compiled FlexAttention on the CPU returns no log-sum-exp, which "
            f"{'return_lse' if return_lse else 'sinks'} need; call with compile=False on the "
            "CPU (or use posenc.torch.attention)")
    want_lse = not cpu_compiled
    if cpu_compiled and torch.is_grad_enabled() and any(
            t.requires_grad for t in (q, k, v)):
        raise NotImplementedError(
            "posenc.torch.flex: compiled FlexAttention on the CPU has no backward; call with "
            "compile=False on the CPU (FlexAttention's eager implementation differentiates) or "
            "use posenc.torch.attention")
    bmask = None if spec.trivial and Lq and Lk else _create_block_mask(spec, dev, block_size,
                                                                       None)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    out, lse = _call_flex(qt, kt, vt, terms.mod, bmask, scale, Hq != Hkv, want_lse, compile)
    if not compiling:
        _check_finite(out, given)
    if not allow_empty and sinks is None and not compiling and not spec.trivial:
        _check_rows(spec, lse, bmask)
    if sinks is not None:
        out, lse = apply_sinks(out, lse, sinks)
    out = out.transpose(1, 2).contiguous()
    if out.dtype != out_dtype:
        out = out.to(out_dtype)
    if packed:
        out = out[0]
        lse = lse[0] if lse is not None else None
    if return_lse:
        return out, lse.float()
    return out


def _empty(q, v, params, common, allow_empty, return_lse, packed):
    """A call without queries or without keys: out 0, lse -inf (the sink with sinks)."""
    B, Lq, Hq, _ = q.shape
    _MaskSpec(B, Lq, 0, q.device, query_positions=common.get("query_positions"))
    sinks = (params or {}).get("sinks")
    if sinks is not None and tuple(sinks.shape) != (Hq,):
        raise _shape_error("sinks", f"[heads_q] = [{Hq}]", sinks.shape)
    if Lq and sinks is None and not allow_empty:
        raise ValueError("attention: query 0 of batch row 0 sees no key (seq_k is 0; pass "
                         "allow_fully_masked=True for a zero output)")
    out = torch.zeros(B, Lq, Hq, v.shape[3], dtype=q.dtype, device=q.device)
    lse = torch.full((B, Hq, Lq), float("-inf"), device=q.device)
    if sinks is not None:
        lse = sinks.to(q.device, torch.float32)[None, :, None].expand(B, Hq, Lq)
    if packed:
        out, lse = out[0], lse[0]
    return (out, lse) if return_lse else out


def _check_finite(out, tensors):
    """posenc's rule for non-finite values: when the output has one, name the input element
    (ValueError), or say that the scores overflowed."""
    if bool(torch.isfinite(out.detach()).all()):
        return
    for name, t in tensors.items():
        bad = ~torch.isfinite(t.detach())
        if bool(bad.any()):
            idx = [int(i) for i in torch.nonzero(bad)[0]]
            raise ValueError(f"attention: {name}: non-finite value {float(t.detach()[tuple(idx)])}"
                             f" at {idx}")
    raise ValueError("attention: the scores overflowed (non-finite output from finite inputs: "
                     "inputs or scale too large)")


def _check_rows(spec, lse, bmask):
    """ValueError for the first query row that sees no key (posenc's rule)."""
    if lse is not None:
        empty = torch.isneginf(lse.detach()).any(dim=1)  # [batch, seq_q]
    else:
        empty = _empty_rows(spec)
    if bool(empty.any()):
        b, i = (int(x) for x in torch.nonzero(empty)[0])
        p = int(spec.qpos.at(torch.tensor(b), torch.tensor(i)))
        raise ValueError(f"attention: query {i} of batch row {b} (position {p}) sees no key "
                         f"(pass allow_fully_masked=True for a zero output)")


def _empty_rows(spec, rows=256):
    """[batch, seq_q] bool: rows with no visible key, by evaluating the mask in row blocks."""
    mod = spec.mask_mod()
    dev = spec.device
    out = torch.zeros(spec.batch, spec.q_len, dtype=torch.bool, device=dev)
    b = torch.arange(spec.batch, device=dev)[:, None, None]
    kj = torch.arange(spec.k_len, device=dev)[None, None, :]
    for start in range(0, spec.q_len, rows):
        qi = torch.arange(start, min(start + rows, spec.q_len), device=dev)[None, :, None]
        vis = mod(b, 0, qi, kj)
        vis = vis.expand(spec.batch, qi.shape[1], spec.k_len)
        out[:, start:start + qi.shape[1]] = ~vis.any(dim=-1)
    return out
