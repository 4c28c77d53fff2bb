"""The float64 oracle of each check: RoPE settings and rotation, the biases (ALiBi, T5,
DeBERTa's relative positions and indices) and attention (posenc.ref.attention), with the
tolerances derived from the dtype."""

import numpy as np

import posenc as _pe

from .._tables import TABLE_HEAD_AXIS as _TABLE_HEAD_AXIS
from ._frameworks import EPS, _is_tensor, _maxerr


# ---- RoPE ---------------------------------------------------------------------------------------

class _RopeSettings:
    def __init__(self, head_dim, base, style, rotary_dim, scaling, config, layer):
        self.config = None
        if config is not None:
            cfg = config if isinstance(config, _pe.ModelConfig) else _pe.read_model_config(config)
            if cfg.scheme != "rope" and not any(la.get("rope") for la in cfg.layers):
                raise ValueError(f"config: a {cfg.model_type} model has no RoPE (scheme "
                                 f"{cfg.scheme!r})")
            f = (_pe.rope_frequencies(cfg, layer=layer) if layer is not None
                 else _pe.rope_frequencies(cfg))
            if getattr(f, "nope", False):
                raise ValueError(f"config: layer {layer} has no RoPE (NoPE layer)")
            rope = cfg.rope
            cd = int(rope.get("head_dim") or cfg.head_dim)
            for given, have, what in ((head_dim, cd, "head_dim"),
                                      (rotary_dim, f.rotary_dim, "rotary_dim")):
                if (given is not None and int(given) != int(have)
                        and not (what == "rotary_dim" and given == 0)):
                    raise ValueError(f"{what}={given} contradicts the config ({have})")
            if base is not None or scaling is not None:
                raise ValueError("base / scaling: the config decides (pass either config= or "
                                 "the settings)")
            self.config, self.layer = cfg, layer
            self.head_dim, self.rotary_dim = cd, int(f.rotary_dim)
            self.style = style or getattr(f, "style", None) or rope.get("style", "half")
            if layer is not None:
                lay = cfg.layers[layer]
                self.scaling = dict(lay.get("rope_scaling") or {})
            else:
                self.scaling = dict(rope.get("scaling") or {})
            self.base = None
        else:
            if head_dim is None:
                raise ValueError("check_rope: head_dim= (or config=) is required")
            self.head_dim = int(head_dim)
            self.rotary_dim = int(rotary_dim or self.head_dim)
            self.base = 1e4 if base is None else float(base)
            self.style = style or "half"
            self.scaling = dict(scaling) if scaling else {}
            self.layer = None
            _pe.rope_frequencies(self.head_dim, rotary_dim=self.rotary_dim, base=self.base,
                                 scaling=self.scaling or None)  # validates
        if self.style not in ("half", "interleaved"):
            raise ValueError(f"style: {self.style!r} ('half' or 'interleaved')")
        self.scaling_type = self.scaling.get("rope_type", self.scaling.get("type", "default"))
        lo = self.scaling.get("original_max_position_embeddings")
        self.original = int(lo) if lo else None

    def theta(self):
        if self.config is None:
            return self.base
        if self.layer is not None:
            return float(self.config.layers[self.layer].get("rope_theta")
                         or self.config.rope["base"])
        return float(self.config.rope["base"])

    def other_thetas(self):
        """Bases a wrong implementation may have used: the model's other layers', the common
        ones."""
        cands = [1e4, 5e5, 1e6]
        if self.config is not None:
            cands = [float(la.get("rope_theta")) for la in self.config.layers
                     if la.get("rope_theta")] + cands
        out = []
        for b in cands:
            if b > 1 and abs(b - self.theta()) > 1e-9 * b and b not in out:
                out.append(b)
        return out

    def freqs(self, seq_len, angles="accurate", rotary_dim=None, scaling=True, base=None):
        if self.config is not None and rotary_dim is None and scaling and base is None:
            kw = {"layer": self.layer} if self.layer is not None else {}
            return _pe.rope_frequencies(self.config, seq_len=int(seq_len), angles=angles, **kw)
        base = self.theta() if base is None else base
        sc = (self.scaling or None) if scaling else None
        if sc is not None and self.scaling_type == "default":
            sc = None
        return _pe.rope_frequencies(self.head_dim, rotary_dim=rotary_dim or self.rotary_dim,
                                    base=base, scaling=sc, seq_len=int(seq_len), angles=angles)

    def describe(self):
        s = f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, style='{self.style}'"
        if self.base is not None:
            s += f", base={self.base:g}"
        if self.scaling_type != "default":
            s += f", scaling {self.scaling_type}"
        return s


def _rope_apply(x, positions, freqs, style, inverse=False):
    """The oracle: float64 x -> float64 reference (float32 x with float32-angle freqs -> the
    float32 recipe)."""
    return np.asarray(_pe.apply_rope(x, freqs, style=style, positions=positions, inverse=inverse),
                      np.float64)


def _f32_allowance(af, max_x, a_max):
    """What the float32 recipe may differ by between two implementations of it: one float32
    rounding of the output, and one ulp of an inverse frequency (PyTorch's vectorised pow and
    the C library's powf disagree on a few inputs), i.e. eps_32·a_max radians."""
    return af * max_x * EPS["float32"] * (2 + a_max)


# ---- biases -------------------------------------------------------------------------------------

def _bias_positions(q_len, k_len, shift=0):
    return np.arange(q_len) + (k_len - q_len) + shift, np.arange(k_len)


def _alibi_ref(q_len, k_len, slopes, shift=0, sign=1.0):
    pq, pk = _bias_positions(q_len, k_len, shift)
    d = np.abs(pq[:, None] - pk[None, :]).astype(np.float64)
    return -sign * np.asarray(slopes, np.float64)[:, None, None] * d[None]


def _visible(q_len, k_len):
    pq, pk = _bias_positions(q_len, k_len)
    return pk[None, :] <= pq[:, None]


def _bias_err(y, ref, mask, invariant):
    d = y - ref
    if mask is not None:
        d = np.where(mask[None], d, 0.0)
    if invariant:
        m = mask if mask is not None else np.ones(d.shape[1:], bool)
        cnt = np.maximum(m.sum(-1), 1)
        row = np.where(m[None], d, 0.0).sum(-1) / cnt
        d = np.where(m[None], d - row[..., None], 0.0)
    return _maxerr(d, 0.0)


def _bias_tol(y_dtype, ref):
    if y_dtype is None:
        return 0.0
    return 2 * EPS[y_dtype] * float(np.max(np.abs(ref), initial=0.0))


def _result_dtype(raw):
    if _is_tensor(raw):
        name = str(raw.dtype).replace("torch.", "")
    else:
        name = np.asarray(raw).dtype.name
    if name in ("int64", "int32", "int16", "int8", "uint8", "bool", "long"):
        return None
    return name if name in EPS else "float64"


def _bias_reference(scheme, ql, kl, h, table, kw, shift=0, variant=None):
    """The oracle for one case: (ref [h, ql, kl] or bucket map, mask)."""
    pq, pk = _bias_positions(ql, kl, shift)
    v = variant or {}
    if scheme == "alibi":
        slopes = v.get("slopes")
        if slopes is None:
            slopes = _pe.alibi_slopes(h, max_bias=kw["max_bias"])
        return _alibi_ref(ql, kl, slopes, shift, v.get("sign", 1.0)), None
    if scheme == "t5":
        bidi = v.get("bidirectional", kw["bidirectional"])
        rel = pk[None, :] - pq[:, None]
        if v.get("flip"):
            rel = -rel
        bfn = _pe.ref.t5_bucket if v.get("float64_log") else _pe.t5_bucket
        b = np.asarray(bfn(rel, num_buckets=kw["num_buckets"], max_distance=kw["max_distance"],
                           bidirectional=bidi), np.int64)
        if table is None:
            return b, None
        return np.moveaxis(table[b], -1, 0), None
    dkw = dict(kw["dkw"])
    dkw.update(v.get("dkw", {}))
    index = v.get("index", kw["index"])
    PQ, PK = np.broadcast_arrays(pq[:, None], pk[None, :])
    PQ, PK = np.ascontiguousarray(PQ, np.int64), np.ascontiguousarray(PK, np.int64)
    if index == "relative":
        rho = PQ - PK
        if v.get("flip"):
            rho = -rho
        r = np.asarray(_pe.deberta_bucket(rho, **dkw), np.float64)
    elif index == "c2p":
        r = np.asarray(_pe.deberta_c2p_index(PQ, PK, **dkw), np.float64)
    else:
        r = np.asarray(_pe.deberta_p2c_index(PQ, PK, p2c=v.get("p2c", kw["p2c"]), **dkw),
                       np.float64)
    return np.broadcast_to(r, (h, ql, kl)), None


def _t5_tablefree_err(y, buckets, mask):
    """Largest deviation from a per-(bucket, head) constant: half the spread of the function's
    values within each bucket of each head (cells outside mask ignored)."""
    err = 0.0
    m = np.ones(buckets.shape, bool) if mask is None else mask
    for b in np.unique(buckets[m]):
        sel = (buckets == b) & m
        vals = y[:, sel]
        if not np.all(np.isfinite(vals)):
            return float("inf")
        err = max(err, float((vals.max(axis=1) - vals.min(axis=1)).max()) / 2)
    return err


# ---- attention ----------------------------------------------------------------------------------

def _attn_dims(params, settings, head_dim, heads):
    D, H = head_dim, heads
    cfg = settings.get("config")
    if cfg is not None:
        c = cfg if isinstance(cfg, _pe.ModelConfig) else _pe.read_model_config(cfg)
        return int(c.head_dim), int(c.heads_q), int(c.heads_kv)
    for n, t in (params or {}).items():
        shape = np.shape(t)
        if n in _TABLE_HEAD_AXIS and len(shape) > _TABLE_HEAD_AXIS[n]:
            hh = shape[_TABLE_HEAD_AXIS[n]]
            if H is not None and H != hh:
                raise ValueError(f"params['{n}'] has {hh} heads, heads={H}")
            H = hh
        if n in ("rel_k", "rel_v", "r_w_bias", "r_r_bias", "pos_key", "pos_query"):
            D = shape[-1] if D is None else D
            if shape[-1] != D:
                raise ValueError(f"params['{n}'] has head_dim {shape[-1]}, head_dim={D}")
        if n in ("rel_k", "rel_v") and len(shape) == 3:
            H = shape[1]
    return D or 16, H, None


def _attn_ref(q, k, v, scheme, params64, kw, settings, dt, angles, **over):
    """float64 oracle output and the dtype's tolerance."""
    okw = dict(settings)
    okw.update(kw)
    okw.update(over)
    sch = scheme
    qq, kk = q, k
    if angles == "float32" and scheme == "rope":
        # rotate with the float32 recipe, then attend without positions
        rope_kw = {n: okw.pop(n) for n in ("base", "style", "rotary_dim", "scaling", "config")
                   if n in okw}
        style = rope_kw.pop("style", None)
        qp = okw.get("query_positions")
        kp = okw.get("key_positions")
        Lq, Lk = q.shape[1], k.shape[1]
        qp = np.arange(Lq) + Lk - Lq if qp is None else qp
        kp = np.arange(Lk) if kp is None else kp
        seq_len = int(max(np.max(qp), np.max(kp))) + 1
        if "config" in rope_kw:
            f = _pe.rope_frequencies(rope_kw["config"], seq_len=seq_len, angles="float32")
        else:
            f = _pe.rope_frequencies(q.shape[-1], rotary_dim=rope_kw.get("rotary_dim", 0),
                                     base=rope_kw.get("base", 1e4), scaling=rope_kw.get("scaling"),
                                     seq_len=seq_len, angles="float32")
        qq, kk = (np.asarray(_pe.apply_rope(t.astype(np.float32), f, style=style, positions=p),
                             np.float64) for t, p in ((q, qp), (k, kp)))
        sch = None
    p = params64 or None
    ref = np.asarray(_pe.ref.attention(qq, kk, v, sch, params=p, **okw), np.float64)
    smax = 0.0
    skw = {n: x for n, x in okw.items()
           if n not in ("causal", "window", "chunk", "allow_fully_masked")}
    for b in range(q.shape[0]):
        for h in range(q.shape[2]):
            s = _pe.ref.attention_scores(qq, kk, sch, batch_index=b, head=h, params=p, **skw)
            smax = max(smax, float(np.max(np.abs(s))))
    tol = 2 * EPS[dt] * float(np.max(np.abs(v))) * (1 + smax)
    return ref, tol
