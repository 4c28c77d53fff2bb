"""The relative-table terms of Shaw, Transformer-XL and DeBERTa: their tables on the device (host
side) and the per-cell gathers of the kernels (Triton side).

Each of these schemes adds to the content score q_i . k_j terms that read a row of a table chosen
by the cell's relative position rel = pos_k - pos_q:

    query side   a_i . E[row(rel), h]   Shaw: a = q, E = rel_k; XL: a = q + r_r_bias, E = r(delta)
                                        (W_r R(delta) for delta = -rel); DeBERTa c2p: a = q,
                                        E = pos_key
    key side     k_j . F[row'(rel), h]  DeBERTa p2c: F = pos_query
    value side   sum_j P_ij G[row(rel)] Shaw's rel_v, added to the output

and XL's content score reads q + r_w_bias. Every row map is one int32 lookup table of the rel
values [lo, lo + n) with rel clamped into that range (Shaw: clamp(rel, -K, K) + K; DeBERTa: its
c2p and p2c indices after the log buckets, from posenc.deberta_c2p_index / deberta_p2c_index over
the range of rel the positions produce; XL: the distance's own row of r, computed for that range).

The kernels gather the rows of every cell of a tile: a [BLOCK_M, BLOCK_N, dim] load of the
table (which caches keep close: it is small and read by every tile) reduced against the tile's
q or k rows. That is exact for any positions, packed or sparse. The backward adds each cell's
share of a table's gradient with atomic adds (float32) into a zeroed buffer.
"""

import math
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

import posenc

# The largest lookup table of rel values a call may need (positions spanning more relative
# distances than this are refused: posenc's CPU kernels take them).
MAX_SPAN = 1 << 24


@dataclass
class Term:
    """One table term: table float32 [rows, 1 or heads_q, width] (1: shared by the heads), the
    row of each rel in [lo, lo + len(index)) (int32), and the parameter name its gradient goes
    to (None: computed, as XL's r)."""

    table: torch.Tensor
    index: torch.Tensor
    lo: int
    name: str = None

    def args(self, prefix, dummy):
        t = self.table
        return {prefix: t, f"{prefix.lower()}_stride_r": t.stride(0),
                f"{prefix.lower()}_stride_h": 0 if t.shape[1] == 1 else t.stride(1),
                f"{prefix}Idx": self.index, f"{prefix.lower()}_lo": self.lo,
                f"{prefix.lower()}_n": self.index.numel()}


def absent_args(prefix, dummy):
    """The kernel arguments of an absent term (never read)."""
    return {prefix: dummy, f"{prefix.lower()}_stride_r": 0, f"{prefix.lower()}_stride_h": 0,
            f"{prefix}Idx": dummy, f"{prefix.lower()}_lo": 0, f"{prefix.lower()}_n": 1}


def rel_range(plan):
    """(lo, hi): the smallest and largest pos_k - pos_q over the call's tokens."""
    qlo, qhi = int(plan.query_pos.min()), int(plan.query_pos.max())
    klo, khi = int(plan.key_pos.min()), int(plan.key_pos.max())
    lo, hi = klo - qhi, khi - qlo
    if hi - lo + 1 > MAX_SPAN:
        raise posenc.InvalidValueError(
            f"positions: relative distances span {hi - lo + 1} values, more than the Triton "
            f"kernels' tables hold ({MAX_SPAN}); backend='cpu' takes them")
    return lo, hi


def float_table(t, what, device, shape_text="", shape=None):
    """A table as the kernels read it, float32 and detached: a floating-point tensor on the
    device (TypeError / ValueError otherwise), of the given shape when one is given
    (ShapeError), finite in float32 (InvalidValueError)."""
    if not isinstance(t, torch.Tensor):
        text = f" {shape_text}" if shape_text else ""
        raise TypeError(f"{what}: a torch.Tensor{text}, got {type(t).__name__}")
    if t.device != device:
        raise ValueError(f"{what}: on {t.device}, expected {device} (q's device)")
    if not t.is_floating_point():
        raise TypeError(f"{what}: a floating-point tensor, got {t.dtype}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise posenc.ShapeError(f"{what}: shape {list(t.shape)}, expected {list(shape)}")
    t32 = t.detach().float()
    if not bool(torch.isfinite(t32).all()):  # float32's: a float64 value past its range is inf
        raise posenc.InvalidValueError(f"{what}: non-finite values (in float32)")
    return t32


def _per_head(t, what, rows, heads, width, device):
    """A table [rows, width] (shared) or [rows, 1 or heads, width] as float32 [rows, 1 or heads,
    width], contiguous."""
    text = f"[{rows}, {width}] or [{rows}, {heads}, {width}]"
    t32 = float_table(t, what, device, text)
    if t32.dim() == 2:
        t32 = t32[:, None, :]
    if t32.dim() != 3 or t32.shape[0] != rows or t32.shape[1] not in (1, heads) or \
            t32.shape[2] != width:
        raise posenc.ShapeError(f"{what}: shape {list(t.shape)}, expected {text}")
    return t32.contiguous()


def prepare_shaw(plan, settings, device):
    rel_k = settings.get("rel_k")
    if rel_k is None:
        raise posenc.InvalidValueError("scheme shaw needs rel_k [2K+1, head_dim] or [2K+1, "
                                       "heads_q, head_dim]")
    if not isinstance(rel_k, torch.Tensor):
        raise TypeError(f"rel_k: a torch.Tensor [2K+1, head_dim] or [2K+1, heads_q, head_dim], "
                        f"got {type(rel_k).__name__}")
    if rel_k.dim() not in (2, 3):
        raise posenc.ShapeError(f"rel_k: shape {list(rel_k.shape)}, expected [2K+1, head_dim] or "
                                "[2K+1, heads_q, head_dim]")
    rows = rel_k.shape[0]
    if rows < 1 or rows % 2 == 0:
        raise posenc.ShapeError(f"rel_k: 2K+1 (odd) rows, got {rows}")
    kk = (rows - 1) // 2
    index = torch.arange(rows, dtype=torch.int32, device=device)
    plan.rel_q = Term(_per_head(rel_k, "rel_k", rows, plan.heads_q, plan.head_dim, device),
                      index, -kk, "rel_k")
    rel_v = settings.get("rel_v")
    if rel_v is not None:
        plan.rel_v = Term(_per_head(rel_v, "rel_v", rows, plan.heads_q, plan.v_dim, device),
                          index, -kk, "rel_v")


def _bucket_keywords(plan, settings):
    kw = {}
    for name in ("position_buckets", "max_relative_positions"):
        value = settings.get(name)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"{name}: an integer, got {type(value).__name__}")
            if not 0 <= int(value) <= 1 << 48:
                raise posenc.InvalidValueError(f"{name} must be an integer in [0, 2^48] (got "
                                               f"{int(value)})")
            kw[name] = int(value)
    p2c = settings.get("deberta_p2c", "model")
    if not isinstance(p2c, str):
        raise TypeError(f"deberta_p2c: 'model' or 'paper', got {type(p2c).__name__}")
    if p2c not in ("model", "paper"):
        raise posenc.InvalidValueError(f"deberta_p2c: 'model' or 'paper', got {p2c!r}")
    float64_log = settings.get("deberta_float64_log", False)
    if not isinstance(float64_log, (bool, np.bool_)):
        raise TypeError(f"deberta_float64_log: a bool, got {type(float64_log).__name__}")
    kw["float64_log"] = bool(float64_log)
    return kw, p2c


def prepare_deberta(plan, settings, device):
    kw, p2c = _bucket_keywords(plan, settings)
    buckets = kw.get("position_buckets", 0)
    span = buckets if buckets > 0 else kw.get("max_relative_positions", 512)
    if span < 1:
        raise posenc.InvalidValueError("max_relative_positions: >= 1 without position_buckets")
    tables = {}
    for name in ("pos_key", "pos_query"):
        t = settings.get(name)
        if t is None:
            raise posenc.InvalidValueError(f"scheme deberta needs {name} [2K, heads_q, head_dim]")
        text = f"[{2 * span}, {plan.heads_q}, {plan.head_dim}] (2K, heads_q, head_dim; K = {span})"
        t32 = float_table(t, name, device, text)
        if tuple(t32.shape) != (2 * span, plan.heads_q, plan.head_dim):
            raise posenc.ShapeError(f"{name}: shape {list(t.shape)}, expected {text}")
        tables[name] = t32.contiguous()
    lo, hi = rel_range(plan)
    rel = np.arange(lo, hi + 1, dtype=np.int64)
    # pos_q - pos_k = -rel, with both positions >= 0
    pos_q = np.full_like(rel, max(-lo, 0))
    pos_k = pos_q + rel
    c2p = posenc.deberta_c2p_index(pos_q, pos_k, **kw)
    p2c_rows = posenc.deberta_p2c_index(pos_q, pos_k, **kw, p2c=p2c)
    plan.rel_q = Term(tables["pos_key"], torch.as_tensor(
        np.asarray(c2p, dtype=np.int32)).to(device), lo, "pos_key")
    plan.rel_k = Term(tables["pos_query"], torch.as_tensor(
        np.asarray(p2c_rows, dtype=np.int32)).to(device), lo, "pos_query")


def xl_sinusoids(lo, n, d_model, base, device):
    """R(delta) float64 [n, d_model] for delta = -(lo + t), t < n: sin(delta w_i) then cos(delta
    w_i), w_i = base^(-2i / d_model) (the concat layout)."""
    half = d_model // 2
    w = torch.pow(torch.tensor(float(base), dtype=torch.float64, device=device),
                  -2.0 * torch.arange(half, dtype=torch.float64, device=device) / d_model)
    delta = -(lo + torch.arange(n, dtype=torch.float64, device=device))
    angle = delta[:, None] * w[None, :]
    return torch.cat([torch.sin(angle), torch.cos(angle)], 1)


def prepare_xl(plan, settings, device):
    heads, dim = plan.heads_q, plan.head_dim
    bias = {}
    for name in ("r_w_bias", "r_r_bias"):
        t = settings.get(name)
        if t is None:
            raise posenc.InvalidValueError(f"scheme xl needs {name} [heads_q, head_dim]")
        t32 = float_table(t, name, device, f"[{heads}, {dim}]")
        if tuple(t32.shape) != (heads, dim):
            raise posenc.ShapeError(f"{name}: shape {list(t.shape)}, expected [{heads}, {dim}]")
        bias[name] = t32.contiguous()
    r_net = settings.get("r_net")
    if r_net is None:
        raise posenc.InvalidValueError("scheme xl needs r_net [heads_q * head_dim, d_model]")
    if not isinstance(r_net, torch.Tensor):
        raise TypeError(f"r_net: a torch.Tensor [{heads * dim}, d_model], got "
                        f"{type(r_net).__name__}")
    if r_net.dim() != 2 or r_net.shape[0] != heads * dim:
        raise posenc.ShapeError(f"r_net: shape {list(r_net.shape)}, expected "
                                f"[{heads * dim}, d_model]")
    d_model = r_net.shape[1]
    if d_model < 2 or d_model % 2:
        raise posenc.ShapeError(f"r_net: d_model ({d_model}) must be even and >= 2")
    float_table(r_net, "r_net", device, "[heads_q * head_dim, d_model]")
    base = settings.get("base", 1e4)
    if isinstance(base, bool) or not isinstance(base, (int, float, np.floating, np.integer)):
        raise TypeError(f"base: a number, got {type(base).__name__}")
    if not math.isfinite(float(base)) or float(base) <= 1.0:
        raise posenc.InvalidValueError(f"base: a finite number > 1, got {base!r}")
    lo, hi = rel_range(plan)
    n = hi - lo + 1
    if n > 4 * (plan.seq_q + plan.seq_k) + 4096:
        raise posenc.InvalidValueError(
            f"positions: {n} relative distances for {plan.seq_q} queries and {plan.seq_k} keys; "
            "the Triton kernels' Transformer-XL table holds contiguous ranges (backend='cpu' "
            "takes sparse positions)")
    sinusoid = xl_sinusoids(lo, n, d_model, float(base), device)
    r = (sinusoid @ r_net.detach().to(torch.float64).t()).view(n, heads, dim)
    plan.rel_q = Term(r.float().contiguous(), torch.arange(n, dtype=torch.int32, device=device),
                      lo, None)
    plan.q_bias = (bias["r_w_bias"], bias["r_r_bias"])
    plan.xl_sinusoid = sinusoid


# ---- the kernels' side --------------------------------------------------------------------------

@triton.jit
def rows_of(rel, Idx, lo, n):
    """The table row of each cell: Idx[clamp(rel - lo, 0, n - 1)] (int64)."""
    return tl.load(Idx + tl.minimum(tl.maximum(rel - lo, 0), n - 1)).to(tl.int64)


@triton.jit
def cell_rows(Table, stride_r, stride_h, head, rows, cols, width):
    """The [cells..., width-padded] rows of a table: Table[rows, head, cols] (0 past width)."""
    return tl.load(Table + rows[:, :, None] * stride_r + head * stride_h + cols[None, None, :],
                   mask=(cols < width)[None, None, :], other=0.0)


@triton.jit
def query_term(a, rows, Table, stride_r, stride_h, head, dims, dim):
    """a_i . Table[rows_ij, head] of every cell: a [M, D] float32, rows [M, N]."""
    e = cell_rows(Table, stride_r, stride_h, head, rows, dims, dim)
    return tl.sum(a[:, None, :] * e, 2)


@triton.jit
def key_term(k, rows, Table, stride_r, stride_h, head, dims, dim):
    """k_j . Table[rows_ij, head] of every cell: k [N, D] float32, rows [M, N]."""
    e = cell_rows(Table, stride_r, stride_h, head, rows, dims, dim)
    return tl.sum(k[None, :, :] * e, 2)


@triton.jit
def value_term(p, rows, Table, stride_r, stride_h, head, vdims, v_dim):
    """sum_j p_ij Table[rows_ij, head]: [M, DV]."""
    e = cell_rows(Table, stride_r, stride_h, head, rows, vdims, v_dim)
    return tl.sum(p[:, :, None] * e, 1)


@triton.jit
def dot_value_rows(do, rows, Table, stride_r, stride_h, head, vdims, v_dim):
    """do_i . Table[rows_ij, head]: the value term's part of dP, [M, N]."""
    e = cell_rows(Table, stride_r, stride_h, head, rows, vdims, v_dim)
    return tl.sum(do[:, None, :] * e, 2)


@triton.jit
def rows_weighted_by_cells(ds, rows, Table, stride_r, stride_h, head, dims, dim, AXIS: tl.constexpr):
    """sum over the other axis of ds_ij Table[rows_ij, head]: AXIS 1 gives [M, D] (per query),
    AXIS 0 gives [N, D] (per key)."""
    e = cell_rows(Table, stride_r, stride_h, head, rows, dims, dim)
    return tl.sum(ds[:, :, None] * e, AXIS)


@triton.jit
def add_to_rows(DTable, stride_r, stride_h, head, rows, w, x, dims, dim, mask,
                X_PER_QUERY: tl.constexpr):
    """DTable[rows_ij, head] += w_ij x (x [M, D] per query row i, or [N, D] per key j) for the
    cells of mask, with atomic adds."""
    if X_PER_QUERY:
        val = w[:, :, None] * x[:, None, :]
    else:
        val = w[:, :, None] * x[None, :, :]
    ptr = DTable + rows[:, :, None] * stride_r + head * stride_h + dims[None, None, :]
    tl.atomic_add(ptr, val, mask=mask[:, :, None] & (dims < dim)[None, None, :])
