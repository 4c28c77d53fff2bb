"""Host side of the Triton attention: argument checks, positions, and each scheme's tables on the
device.

``prepare(...)`` turns the keywords of ``posenc.triton.attention`` into a ``Plan``: the sizes, the
masks, the positions as int64 tensors ``[batch or 1, seq]`` on the tensors' device, the block masks
per token (document ids, open tokens, the dense mask), and the scheme's tables (RoPE's cos and sin
per token, ALiBi's slopes, T5's bucket of every clamped distance and its bias table).
``Plan.kernel_args`` gives the keyword arguments that every kernel of ``_forward`` and ``_backward``
takes in the same order. ``unpack`` turns packed sequences (cu_seqlens) into one batch row with
documents and per-sequence positions.
"""

import math
import numbers
from dataclasses import dataclass, field

import torch

import posenc

from . import _relative

NONE, ROPE, ALIBI, T5, SHAW, XL, DEBERTA = 0, 1, 2, 3, 4, 5, 6
SCHEMES = {"none": NONE, "rope": ROPE, "alibi": ALIBI, "t5": T5, "shaw": SHAW, "xl": XL,
           "deberta": DEBERTA}
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_POSITION = 1 << 48  # posenc's largest position id

# (BLOCK_M, BLOCK_N, num_warps) of each kernel, by the kind of tiles its dots take: "half"
# (float16 / bfloat16 inputs) or "float32" (float32 inputs, and RoPE's rotated tiles). Chosen
# from ptxas's register reports for sm_90 at head_dim 128: the half kernels without RoPE compile
# with no or few spills, the float32 backward kernels still spill. Not yet timed on a GPU. The
# relative-table schemes (Shaw, XL, DeBERTa) gather a [BLOCK_M, BLOCK_N, head_dim] block of
# table rows per tile: "relative" keeps those blocks small.
TILES = {
    ("forward", "half"): (64, 64, 8), ("forward", "float32"): (32, 32, 4),
    ("backward_kv", "half"): (32, 64, 8), ("backward_kv", "float32"): (32, 32, 4),
    ("backward_q", "half"): (64, 32, 8), ("backward_q", "float32"): (32, 32, 4),
    ("forward", "relative"): (16, 16, 4), ("backward_kv", "relative"): (16, 16, 4),
    ("backward_q", "relative"): (16, 16, 4),
}

# The keywords that belong to one scheme; any other scheme refuses them (TypeError).
SCHEME_KEYWORDS = {
    "rope": ("rope", "rope_style"),
    "alibi": ("slopes", "max_bias"),
    "t5": ("relative_attention_bias", "num_buckets", "max_distance", "bidirectional"),
    "shaw": ("rel_k", "rel_v"),
    "xl": ("r_w_bias", "r_r_bias", "r_net", "base"),
    "deberta": ("pos_key", "pos_query", "position_buckets", "max_relative_positions",
                "deberta_p2c", "deberta_float64_log"),
}
# The learned tables of each scheme: the tensors that may get a gradient.
SCHEME_TABLES = {
    "alibi": ("slopes",), "t5": ("relative_attention_bias",), "shaw": ("rel_k", "rel_v"),
    "xl": ("r_w_bias", "r_r_bias", "r_net"), "deberta": ("pos_key", "pos_query"),
}


@dataclass
class Plan:
    """Everything the kernels need besides q, k, v: sizes, masks, positions and scheme tables."""

    scheme: int
    batch: int
    seq_q: int
    seq_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    v_dim: int
    scale: float
    causal: bool
    window: int = 0        # 0: none
    chunk: int = 0         # 0: none
    softcap: float = 0.0   # 0: none
    sinks: torch.Tensor = None      # float32 [heads_q]
    query_pos: torch.Tensor = None  # int64 [1 or batch, seq_q], contiguous
    key_pos: torch.Tensor = None    # int64 [1 or batch, seq_k], contiguous
    table: torch.Tensor = None      # float32: ALiBi slopes [heads_q] or T5 bias [buckets, heads_q]
    buckets: torch.Tensor = None    # int32 [2 * max_distance + 1]: T5 bucket of rel + max_distance
    max_distance: int = 0
    rotary_dim: int = 0
    interleaved: bool = False
    rope_q: tuple = None            # (cos, sin) float32 [1 or batch, seq_q, rotary_dim / 2]
    rope_k: tuple = None
    query_docs: torch.Tensor = None  # int32 [batch, seq_q]: document ids
    key_docs: torch.Tensor = None    # int32 [batch, seq_k]
    query_open: torch.Tensor = None  # int32 [batch, seq_q]: 1 for global queries
    key_open: torch.Tensor = None    # int32 [batch, seq_k]: 1 for global and prefix keys
    dense: torch.Tensor = None       # uint8 [batch or 1, seq_q, seq_k]: nonzero may attend
    rel_q: _relative.Term = None     # the query side table term (Shaw rel_k, XL r, DeBERTa c2p)
    rel_k: _relative.Term = None     # the key side table term (DeBERTa p2c)
    rel_v: _relative.Term = None     # the value table term (Shaw rel_v)
    q_bias: tuple = None             # XL: (r_w_bias, r_r_bias) float32 [heads_q, head_dim]
    xl_sinusoid: torch.Tensor = None  # XL: R(delta) float64 [rows of rel_q, d_model]
    nonfinite: torch.Tensor = None   # int32 [1], set by the forward: an output is not finite
    dtype: torch.dtype = torch.float32
    blocks: tuple = None            # the caller's (block_m, block_n), or None: TILES
    dummy: torch.Tensor = field(default=None, repr=False)  # stands for absent tensors

    @property
    def group(self):
        """Query heads per kv head (query head h reads kv head h // group)."""
        return self.heads_q // self.heads_kv

    def tiles(self, kernel):
        """(BLOCK_M, BLOCK_N, num_warps) of a kernel ('forward', 'backward_kv', 'backward_q')."""
        kind = "float32" if self.dtype == torch.float32 or self.rotary_dim else "half"
        if self.rel_q is not None:
            kind = "relative"
        block_m, block_n, warps = TILES[kernel, kind]
        if self.blocks is not None:
            block_m, block_n = self.blocks
        return block_m, block_n, warps

    def tile_info(self, positions, docs, open_, block):
        """int64 [batch, tiles, 5]: per tile of ``block`` tokens its smallest and largest
        position, smallest and largest document id, and 1 when it holds an open (global or
        prefix) token, so that a kernel can skip tiles the masks hide entirely."""
        n = positions.shape[1]
        tiles = -(-n // block)
        pad = tiles * block - n

        def reduce(x, fill, how):
            x = torch.nn.functional.pad(x.to(torch.int64), (0, pad), value=fill)
            return getattr(x.view(-1, tiles, block), how)(-1).expand(self.batch, tiles)

        zero = torch.zeros((1, n), dtype=torch.int64, device=positions.device)
        docs = zero if docs is None else docs
        open_ = zero if open_ is None else open_
        return torch.stack([reduce(positions, MAX_POSITION + 1, "amin"),
                            reduce(positions, -1, "amax"), reduce(docs, 1 << 40, "amin"),
                            reduce(docs, -1, "amax"), reduce(open_, 0, "amax")], -1).contiguous()

    def kernel_args(self):
        """The scheme and mask arguments every kernel takes (keyword arguments)."""
        d = self.dummy
        cos_q, sin_q = self.rope_q or (d, d)
        cos_k, sin_k = self.rope_k or (d, d)
        table = self.table if self.table is not None else d
        return dict(
            QPos=self.query_pos, KPos=self.key_pos,
            qpos_stride_b=_row_stride(self.query_pos), kpos_stride_b=_row_stride(self.key_pos),
            Sinks=self.sinks if self.sinks is not None else d,
            Table=table, table_stride_u=table.stride(0) if table.dim() == 2 else 0,
            table_stride_h=table.stride(-1),
            Buckets=self.buckets if self.buckets is not None else d, max_distance=self.max_distance,
            QCos=cos_q, QSin=sin_q, KCos=cos_k, KSin=sin_k,
            qcos_stride_b=_row_stride(cos_q), kcos_stride_b=_row_stride(cos_k),
            seq_q=self.seq_q, seq_k=self.seq_k, group=self.group, head_dim=self.head_dim,
            v_dim=self.v_dim, scale=self.scale, softcap=self.softcap or 1.0,
            window=self.window or 1, chunk=self.chunk or 1,
            SCHEME=self.scheme, CAUSAL=self.causal, HAS_WINDOW=self.window > 0,
            HAS_CHUNK=self.chunk > 0, HAS_SOFTCAP=self.softcap > 0,
            HAS_SINKS=self.sinks is not None, ROTARY=self.rotary_dim,
            INTERLEAVED=self.interleaved,
            BLOCK_D=_block_dim(self.head_dim), BLOCK_DV=_block_dim(self.v_dim),
            QDoc=_or(self.query_docs, d), KDoc=_or(self.key_docs, d),
            QOpen=_or(self.query_open, d), KOpen=_or(self.key_open, d),
            Dense=_or(self.dense, d), dense_stride_b=_row_stride(_or(self.dense, d)),
            HAS_DOCS=self.query_docs is not None, HAS_OPEN=self.key_open is not None,
            HAS_DENSE=self.dense is not None,
            **self.relative_args(),
        )

    def relative_args(self):
        """The relative-table terms' kernel arguments (absent terms point at the dummy)."""
        d = self.dummy
        args = {}
        for prefix, term in (("RelQ", self.rel_q), ("RelK", self.rel_k), ("RelV", self.rel_v)):
            args.update(term.args(prefix, d) if term is not None else
                        _relative.absent_args(prefix, d))
        u, w = self.q_bias or (d, d)
        args.update(QBias=u, QRelBias=w, REL_Q=self.rel_q is not None,
                    REL_K=self.rel_k is not None, REL_V=self.rel_v is not None,
                    Q_BIAS=self.q_bias is not None)
        return args


def _or(t, default):
    """t, or default when t is None (an absent table)."""
    return default if t is None else t


def _row_stride(t):
    """The batch stride of a per-row table: 0 when one row serves every batch row."""
    return 0 if t.dim() < 2 or t.shape[0] == 1 else t.stride(0)


def _block_dim(n):
    """A head dim padded to a power of two of at least 16 (tl.dot's smallest size)."""
    return max(16, 1 << (n - 1).bit_length())


def _number(value, what, *, integer=False, minimum=None):
    """A finite number (an integer with integer=True) not below minimum: TypeError for another
    type, InvalidValueError for a value out of range."""
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind):
        raise TypeError(f"{what}: {'an integer' if integer else 'a number'}, got "
                        f"{type(value).__name__}")
    value = int(value) if integer else float(value)
    if not math.isfinite(value) or minimum is not None and value < minimum:
        bound = f" >= {minimum}" if minimum is not None else ""
        raise posenc.InvalidValueError(f"{what} must be a finite number{bound}, got {value}")
    return value


def _tensor(t, what, device, shape=None):
    """A float tensor of a given shape on the device, as float32 (the tables' checks)."""
    return _relative.float_table(t, what, device, shape=shape)


def _positions(p, batch, n, default_start, device, what):
    """Position ids as int64 [1 or batch, n] on the device: None -> default_start + i, an int
    offset k -> k + i, or ids [n] / [batch, n]."""
    if p is None or isinstance(p, numbers.Integral) and not isinstance(p, bool):
        start = default_start if p is None else int(p)
        if start < 0 or start + n - 1 > MAX_POSITION:
            extra = " (default positions need seq_q <= seq_k)" if p is None else ""
            raise posenc.InvalidValueError(
                f"{what}: {start} is outside [0, {MAX_POSITION}]{extra}")
        return (torch.arange(n, device=device, dtype=torch.int64) + start).view(1, n)
    t = torch.as_tensor(p, device=device)
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.is_complex():
        raise TypeError(f"{what}: integer ids, got {t.dtype}")
    if t.dim() == 1:
        t = t.view(1, -1)
    if t.dim() != 2 or t.shape[1] != n or t.shape[0] not in (1, batch):
        raise posenc.ShapeError(f"{what}: shape {list(t.shape)}, expected [{n}] or [{batch}, {n}]")
    t = t.to(torch.int64).contiguous()
    if t.numel() and bool(((t < 0) | (t > MAX_POSITION)).any()):
        raise posenc.InvalidValueError(f"{what}: ids must lie in [0, {MAX_POSITION}]")
    return t


def _rope_tables(positions, freqs):
    """cos and sin of every token's angles, float32 [rows, n, rotary_dim / 2], attention factor
    included: accurate angles p * inv_freq in float64, rounded once (posenc's arithmetic), or
    with angles='float32' the frameworks' float32 recipe."""
    device = positions.device
    af = float(freqs.attention_factor)
    if freqs.angles == "float32":
        inv = torch.tensor(freqs.inv_freq, dtype=torch.float32, device=device)
        angle = positions.to(torch.float32)[..., None] * inv
        return (torch.cos(angle) * af).contiguous(), (torch.sin(angle) * af).contiguous()
    inv = torch.tensor(freqs.inv_freq, dtype=torch.float64, device=device)
    angle = positions.to(torch.float64)[..., None] * inv
    return ((torch.cos(angle) * af).to(torch.float32).contiguous(),
            (torch.sin(angle) * af).to(torch.float32).contiguous())


def _t5_buckets(num_buckets, max_distance, bidirectional, device, reach=None):
    """The bucket of every distance rel in [-reach, reach] (reach: default max_distance), from
    posenc.t5_bucket (T5's float32 log), as int32 [2 * reach + 1]. Buckets are monotone in |rel|
    and saturate at |rel| = max_distance, so a kernel clamps rel to that range first (to the
    reach of the call's positions when that is shorter)."""
    reach = max_distance if reach is None else reach
    rel = torch.arange(-reach, reach + 1).numpy()
    b = posenc.t5_bucket(rel, num_buckets=num_buckets, max_distance=max_distance,
                         bidirectional=bidirectional)
    return torch.as_tensor(b, dtype=torch.int32).to(device)


def check_qkv(q, k, v):
    """Shapes, dtypes and devices of q, k, v (TypeError, ShapeError, ValueError)."""
    for t, what in ((q, "q"), (k, "k"), (v, "v")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in DTYPES:
            raise TypeError(f"{what}: float32, float16 or bfloat16, got {t.dtype}")
        if t.dim() != 4:
            raise posenc.ShapeError(f"{what}: 4 dimensions [batch, seq, heads, dim], got "
                                    f"{list(t.shape)}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v: one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k, v: one device, got {q.device}, {k.device}, {v.device}")
    b, _, hq, d = q.shape
    if k.shape[0] != b or k.shape[3] != d:
        raise posenc.ShapeError(f"k: shape {list(k.shape)} does not match q {list(q.shape)}")
    if tuple(v.shape[:3]) != tuple(k.shape[:3]) or not 1 <= v.shape[3] <= d:
        raise posenc.ShapeError(f"v: shape {list(v.shape)}, expected [{k.shape[0]}, "
                                f"{k.shape[1]}, {k.shape[2]}, v_dim] with v_dim <= {d}")
    if k.shape[2] < 1 or hq % k.shape[2]:
        raise posenc.ShapeError(f"heads_kv ({k.shape[2]}) must divide heads_q ({hq})")
    if d > 256:
        raise posenc.ShapeError(f"head_dim {d}: at most 256")
    if min(q.shape[1], k.shape[1]) < 1 or b < 1:
        raise posenc.ShapeError(f"empty q or k: {list(q.shape)}, {list(k.shape)}")


def _block(value, what):
    """A tile size: a power of two of at least 16 (InvalidValueError otherwise)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 16 or value & (value - 1):
        raise posenc.InvalidValueError(f"{what}: a power of two >= 16, got {value!r}")
    return value


def prepare(q, k, v, scheme, *, causal, scale, window, chunk, softcap, sinks, query_positions,
            key_positions, settings, block_m=None, block_n=None, query_documents=None,
            key_documents=None, prefix=None, global_positions=None, mask=None):
    """Checks the call and builds its Plan. settings: the scheme keywords that were given
    (rope, rope_style, slopes, max_bias, relative_attention_bias, num_buckets, max_distance,
    bidirectional). block_m, block_n: both or neither. query_documents, key_documents, prefix,
    global_positions, mask: the block masks of docs/attention.md."""
    check_qkv(q, k, v)
    if scheme not in SCHEMES:
        raise posenc.InvalidValueError(f"scheme: {scheme!r} (one of {', '.join(SCHEMES)})")
    for other, names in SCHEME_KEYWORDS.items():
        for name in names:
            if other != scheme and name in settings:
                raise TypeError(f"{name}: a setting of scheme '{other}', not '{scheme}'")
    device = q.device
    b, lq, hq, d = q.shape
    lk, hkv = k.shape[1], k.shape[2]
    default_scale = 1.0 / math.sqrt(3 * d if scheme == "deberta" else d)
    plan = Plan(scheme=SCHEMES[scheme], batch=b, seq_q=lq, seq_k=lk, heads_q=hq, heads_kv=hkv,
                head_dim=d, v_dim=v.shape[3],
                scale=default_scale if scale is None else _number(scale, "scale"),
                causal=bool(causal), dtype=q.dtype,
                dummy=torch.zeros(1, dtype=torch.float32, device=device))
    if block_m is not None or block_n is not None:
        plan.blocks = (_block(block_m, "block_m"), _block(block_n, "block_n"))
    if window is not None:
        plan.window = _number(window, "window", integer=True, minimum=1)
    if chunk is not None:
        plan.chunk = _number(chunk, "chunk", integer=True, minimum=1)
    if softcap is not None:
        plan.softcap = _number(softcap, "softcap")
        if plan.softcap <= 0:
            raise posenc.InvalidValueError("softcap must be a finite number > 0")
        # clamped to float32's normal range, as posenc's float32 kernels clamp it
        plan.softcap = min(max(plan.softcap, 1.1754944e-38), 3.4028235e38)
    if sinks is not None:
        plan.sinks = _tensor(sinks, "sinks", device, (hq,)).detach().float()
    plan.key_pos = _positions(key_positions, b, lk, 0, device, "key_positions")
    plan.query_pos = _positions(query_positions, b, lq, lk - lq, device, "query_positions")
    _prepare_block_mask(plan, device, query_documents, key_documents, prefix, global_positions,
                        mask)
    if plan.scheme == ROPE:
        _prepare_rope(plan, settings)
    elif plan.scheme == ALIBI:
        _prepare_alibi(plan, settings, device)
    elif plan.scheme == T5:
        _prepare_t5(plan, settings, device)
    elif plan.scheme == SHAW:
        _relative.prepare_shaw(plan, settings, device)
    elif plan.scheme == XL:
        _relative.prepare_xl(plan, settings, device)
    elif plan.scheme == DEBERTA:
        _relative.prepare_deberta(plan, settings, device)
    return plan


def _prepare_rope(plan, settings):
    freqs = settings.get("rope")
    if freqs is None:
        freqs = posenc.rope_frequencies(plan.head_dim)
    if not isinstance(freqs, posenc.RopeFrequencies):
        raise TypeError(f"rope: a posenc.RopeFrequencies (posenc.rope_frequencies(...)), got "
                        f"{type(freqs).__name__}")
    style = settings.get("rope_style", "half")
    if not isinstance(style, str) or style not in ("half", "interleaved"):
        raise posenc.InvalidValueError(f"rope_style: {style!r} ('half' or 'interleaved')")
    r = int(freqs.rotary_dim)
    if not 2 <= r <= plan.head_dim:
        raise posenc.InvalidValueError(f"rope: rotary_dim {r} must lie in [2, head_dim = "
                                       f"{plan.head_dim}]")
    plan.rotary_dim, plan.interleaved = r, style == "interleaved"
    plan.rope_q = _rope_tables(plan.query_pos, freqs)
    plan.rope_k = _rope_tables(plan.key_pos, freqs)


def _prepare_alibi(plan, settings, device):
    slopes = settings.get("slopes")
    if slopes is None:
        max_bias = _number(settings.get("max_bias", 8.0), "max_bias")
        slopes = torch.as_tensor(posenc.alibi_slopes(plan.heads_q, max_bias=max_bias))
        plan.table = slopes.to(device=device, dtype=torch.float32)
    else:
        plan.table = _tensor(slopes, "slopes", device, (plan.heads_q,)).detach().float()


def _prepare_t5(plan, settings, device):
    table = settings.get("relative_attention_bias")
    if table is None:
        raise posenc.InvalidValueError("scheme t5 needs relative_attention_bias "
                                       "[num_buckets, heads_q]")
    if not isinstance(table, torch.Tensor):
        raise TypeError(f"relative_attention_bias: a torch.Tensor [num_buckets, heads_q], got "
                        f"{type(table).__name__}")
    if table.dim() != 2:
        raise posenc.ShapeError(f"relative_attention_bias: shape {list(table.shape)}, expected "
                                "[num_buckets, heads_q]")
    _tensor(table, "relative_attention_bias", device, (table.shape[0], plan.heads_q))
    nb = table.shape[0]
    if settings.get("num_buckets") not in (None, nb):
        raise posenc.ShapeError(f"num_buckets {settings['num_buckets']} but "
                                f"relative_attention_bias has {nb} rows")
    max_distance = _number(settings.get("max_distance", 128), "max_distance", integer=True,
                           minimum=1)
    if max_distance > MAX_POSITION:
        raise posenc.InvalidValueError(f"max_distance must be an integer in [1, 2^48] (got "
                                       f"{max_distance})")
    bidirectional = settings.get("bidirectional")
    if bidirectional is None:
        bidirectional = not plan.causal
    # The bucket table covers the distances the positions reach (at most max_distance, where
    # the buckets saturate): a huge max_distance costs no more than the positions need.
    lo = int(plan.key_pos.min()) - int(plan.query_pos.max())
    hi = int(plan.key_pos.max()) - int(plan.query_pos.min())
    reach = max(1, min(max_distance, max(-lo, hi)))
    if 2 * reach + 1 > _relative.MAX_SPAN:
        raise posenc.InvalidValueError(
            f"positions: relative distances up to {max(-lo, hi)} with max_distance "
            f"{max_distance} need {2 * reach + 1} buckets, more than the Triton kernels' tables "
            f"hold ({_relative.MAX_SPAN}); backend='cpu' takes them")
    plan.max_distance = reach
    plan.table = table.detach().float()
    plan.buckets = _t5_buckets(nb, max_distance, bool(bidirectional), device, reach)


def _int_tensor(x, what, device):
    """Integer ids as a tensor on the device (TypeError for floats and booleans)."""
    t = torch.as_tensor(x, device=device)
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.is_complex():
        raise TypeError(f"{what}: integers, got {t.dtype}")
    return t


def _prepare_block_mask(plan, device, query_documents, key_documents, prefix, global_positions,
                        mask):
    """The block masks per token (docs/attention.md, "Block masks"): document ids, open queries
    (global positions), open keys (global positions and keys before their prefix) and the dense
    mask, with posenc's checks."""
    b, lq, lk = plan.batch, plan.seq_q, plan.seq_k
    if (query_documents is None) != (key_documents is None):
        raise posenc.InvalidValueError("query_documents and key_documents: give both or neither")
    if query_documents is not None:
        docs = []
        for x, n, what in ((query_documents, lq, "query_documents"),
                           (key_documents, lk, "key_documents")):
            t = _int_tensor(x, what, device)
            if tuple(t.shape) != (b, n):
                raise posenc.ShapeError(f"{what}: shape {list(t.shape)}, expected [{b}, {n}]")
            docs.append(t.to(torch.int32).contiguous())
        plan.query_docs, plan.key_docs = docs
    key_open = torch.zeros((b, lk), dtype=torch.bool, device=device)
    if global_positions is not None:
        if not isinstance(global_positions, torch.Tensor):
            global_positions = [_number(g, "global_positions", integer=True)
                                for g in global_positions]
        glob = torch.as_tensor(global_positions, dtype=torch.int64, device=device).reshape(-1)
        if glob.numel():
            plan.query_open = torch.isin(plan.query_pos, glob).expand(b, lq).to(
                torch.int32).contiguous()
            key_open |= torch.isin(plan.key_pos, glob).expand(b, lk)
    if prefix is not None:
        lengths = _int_tensor(prefix, "prefix", device).reshape(-1).to(torch.int64)
        if plan.query_docs is None and lengths.numel() != b:
            raise posenc.ShapeError(f"prefix has {lengths.numel()} entries, expected batch "
                                    f"({b}): one prefix length per row")
        if bool((lengths < 0).any()):
            raise posenc.InvalidValueError("prefix: lengths must not be negative")
        if plan.query_docs is None:
            at = torch.arange(b, device=device)[:, None].expand(b, lk)
        else:
            at = plan.key_docs.to(torch.int64)
            if lk and bool(((at < 0) | (at >= lengths.numel())).any()):
                raise posenc.InvalidValueError(
                    f"prefix has {lengths.numel()} entries (one per document id) but a key's "
                    "document id lies outside them")
        key_open |= plan.key_pos < lengths[at]
    if global_positions is not None or prefix is not None:
        plan.key_open = key_open.to(torch.int32).contiguous()
        if plan.query_open is None:
            plan.query_open = torch.zeros((b, lq), dtype=torch.int32, device=device)
    if mask is not None:
        t = torch.as_tensor(mask, device=device)
        if t.dim() != 3 or t.shape[0] not in (1, b) or tuple(t.shape[1:]) != (lq, lk):
            raise posenc.ShapeError(f"mask: shape {list(t.shape)}, expected [{b} or 1, {lq}, "
                                    f"{lk}]")
        plan.dense = (t != 0).to(torch.uint8).contiguous()


def unpack(q, k, v, cu_seqlens_q, cu_seqlens_k, query_positions, key_positions):
    """Packed sequences (q [total_q, heads_q, D], k and v [total_k, heads_kv, D], offsets
    cu_seqlens [num_seqs + 1]) as one batch row: (q, k, v as views [1, total, heads, dim],
    query and key document ids [1, total] (the sequence of each token), query and key positions).
    Positions restart in each sequence: key j of a sequence at j, query i at len_k - len_q + i,
    unless given per token ([total] ids)."""
    if cu_seqlens_q is None or cu_seqlens_k is None:
        raise posenc.InvalidValueError("cu_seqlens_q and cu_seqlens_k: give both or neither")
    for t, what in ((q, "q"), (k, "k"), (v, "v")):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise posenc.ShapeError(f"{what}: with cu_seqlens, 3 dimensions [total, heads, dim]")
    device = q.device
    cus = []
    for x, total, what in ((cu_seqlens_q, q.shape[0], "cu_seqlens_q"),
                           (cu_seqlens_k, k.shape[0], "cu_seqlens_k")):
        cu = _int_tensor(x, what, device).reshape(-1).to(torch.int64)
        if cu.numel() < 1 or int(cu[0]) != 0 or int(cu[-1]) != total or bool(
                (cu[1:] < cu[:-1]).any()):
            raise posenc.InvalidValueError(f"{what}: offsets [num_seqs + 1] from 0, "
                                           f"non-decreasing, ending at the total ({total})")
        cus.append(cu)
    cq, ck = cus
    if cq.numel() != ck.numel():
        raise posenc.ShapeError(f"cu_seqlens_q ({cq.numel()}) and cu_seqlens_k ({ck.numel()}) "
                                "must have the same length")
    tq, tk = q.shape[0], k.shape[0]
    qdoc = torch.searchsorted(cq[1:], torch.arange(tq, device=device), right=True)
    kdoc = torch.searchsorted(ck[1:], torch.arange(tk, device=device), right=True)
    if key_positions is None:
        key_positions = torch.arange(tk, device=device) - ck[kdoc]
    if query_positions is None:
        lq, lk = cq[1:] - cq[:-1], ck[1:] - ck[:-1]
        query_positions = (lk - lq)[qdoc] + torch.arange(tq, device=device) - cq[qdoc]
        if tq and int(query_positions.min()) < 0:
            raise posenc.InvalidValueError(
                "query_positions: a sequence has more queries than keys with default "
                "positions; pass query_positions and key_positions")
    return (q[None], k[None], v[None], qdoc[None], kdoc[None], query_positions, key_positions)
