"""posenc.torch.distributed: context-parallel attention over torch.distributed, for every scheme.

The sequence dimension (dim 1 of ``[batch, seq, heads, head_dim]``) is split across the ranks of
a process group, and ``context_parallel_attention`` gives each rank its shard of the exact
attention over the whole sequence, forward and backward:

- ``strategy="ring"``: each rank keeps its queries; the key/value shards travel around the ring
  (``isend`` / ``irecv``, the next transfer overlapped with the current block's kernel), every
  block is an ordinary posenc attention call with the block's *global* query and key positions,
  and the partial results are merged exactly through their per-row log-sum-exp
  (``attention_merge``). Under a causal mask (or a window, or chunks) blocks that no query can
  see are skipped. The backward is the ring backward (FlashAttention-2's recomputation from the
  global ``out`` and ``lse``): ``dq`` stays, ``dk`` / ``dv`` travel with their shard back to it.
- ``strategy="all_to_all"`` (DeepSpeed-Ulysses): an all-to-all turns sequence shards into head
  shards, each rank runs full-sequence attention on ``heads_q / world_size`` heads (per-head
  tables sliced to them), and another all-to-all turns the output back.

Layouts (``shard`` / ``unshard``): ``contiguous``, rank r holds chunk r of
``torch.tensor_split(x, N, dim=1)``; ``zigzag``, the sequence cut into 2N chunks and rank r
holding chunks r and 2N-1-r, so causal work is even. Positions, document ids and dense masks are
given whole (the global sequence's) and sharded by the same rule inside; every scheme (RoPE,
ALiBi, T5, Shaw, Transformer-XL, DeBERTa) therefore sees global distances.

Gradients: q, k, v get their shard's gradients; learned tables (``params``) get the gradient of
the global attention, summed over the ranks (``reduce_grads=True``, the default) or, with
``reduce_grads=False``, this rank's share (the shares of all ranks sum to it: reduce them with the
model's other gradients).

Errors: the ranks exchange shapes and a fingerprint of their arguments before any work, and
agree on success after it, so a mismatched shard, different options or tables on one rank, or an
error raised on one rank (bad input in its shard) raises on every rank, naming the rank; a dead
or hung peer ends in the process group's timeout (or ``timeout=``), never a hang.

``comm_stats()`` returns the bytes and messages this process sent and received and the time
spent computing and waiting on communication; ``cost_model(...)`` gives the same counts and the
per-rank work without running anything (docs/distributed.md).
"""

import datetime
import math
import time
import zlib

import numpy as np
import torch
import torch.distributed as dist

from .. import _ops, _posenc

__all__ = ["context_parallel_attention", "ContextParallel", "shard", "unshard", "shard_indices",
           "comm_stats", "reset_comm_stats", "cost_model", "STRATEGIES", "LAYOUTS"]

STRATEGIES = ("ring", "all_to_all")
LAYOUTS = ("contiguous", "zigzag")

_HALF = (torch.bfloat16, torch.float16)
# Keywords of posenc.torch.attention handled here rather than passed through.
_MASK_TENSORS = ("query_documents", "key_documents", "prefix", "mask")
_TABLE_HEAD_AXIS = {"slopes": 0, "relative_attention_bias": 1, "r_w_bias": 0, "r_r_bias": 0,
                    "pos_key": 1, "pos_query": 1, "sinks": 0}
# A finite sink that contributes nothing (exp(-1e30 - s) == 0): lets a config whose layers
# require sinks run blocks whose real sink is merged once, outside the kernel.
_NO_SINK = -1e30

# ---- layouts -----------------------------------------------------------------------------------


def _check_layout(layout):
    if layout not in LAYOUTS:
        raise ValueError(f"layout: '{layout}' (contiguous or zigzag)")


def _check_world(rank, world_size):
    if not isinstance(world_size, (int, np.integer)) or world_size < 1:
        raise ValueError(f"world_size: {world_size!r} (an int >= 1)")
    if not isinstance(rank, (int, np.integer)) or not 0 <= rank < world_size:
        raise ValueError(f"rank: {rank!r} (an int in [0, world_size = {world_size}))")


def _chunk_bounds(length, parts):
    """Start offsets of torch.tensor_split(range(length), parts): parts + 1 values."""
    base, extra = divmod(length, parts)
    bounds = [0]
    for c in range(parts):
        bounds.append(bounds[-1] + base + (1 if c < extra else 0))
    return bounds


def _segments(length, rank, world_size, layout):
    """The global ranges [start, end) rank `rank` holds, in its shard's order."""
    if layout == "contiguous":
        b = _chunk_bounds(length, world_size)
        return [(b[rank], b[rank + 1])]
    b = _chunk_bounds(length, 2 * world_size)
    c = 2 * world_size - 1 - rank
    return [(b[rank], b[rank + 1]), (b[c], b[c + 1])]


def _shard_len(length, rank, world_size, layout):
    return sum(e - s for s, e in _segments(length, rank, world_size, layout))


def shard_indices(length, rank, world_size, layout="contiguous"):
    """The global indices (int64 tensor) of the sequence positions rank `rank` holds in a
    sequence of `length` split over `world_size` ranks with `layout`."""
    _check_layout(layout)
    _check_world(rank, world_size)
    if length < 0:
        raise ValueError(f"length: {length} (>= 0)")
    return torch.cat([torch.arange(s, e, dtype=torch.int64)
                      for s, e in _segments(int(length), rank, world_size, layout)])


def shard(x, rank, world_size, layout="contiguous", *, dim=1):
    """Rank `rank`'s shard of x along `dim` (1: the sequence of [batch, seq, heads, head_dim]).

    contiguous: chunk `rank` of torch.tensor_split(x, world_size, dim); zigzag: chunks `rank` and
    2*world_size-1-rank of torch.tensor_split(x, 2*world_size, dim), concatenated. Works on any
    tensor (positions [seq] with dim=0, document ids [batch, seq] with dim=1); the contiguous
    shard is a view, the zigzag one a new tensor."""
    _check_layout(layout)
    _check_world(rank, world_size)
    if not isinstance(x, torch.Tensor):
        x = torch.as_tensor(np.asarray(x))
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim: {dim} is outside a tensor of {x.dim()} dimensions")
    if layout == "contiguous":
        return torch.tensor_split(x, world_size, dim)[rank]
    parts = torch.tensor_split(x, 2 * world_size, dim)
    return torch.cat([parts[rank], parts[2 * world_size - 1 - rank]], dim)


def unshard(shards, layout="contiguous", *, dim=1):
    """The whole tensor from the shards of every rank, in rank order (the inverse of
    ``shard``). A shard whose length does not match the layout raises ValueError."""
    _check_layout(layout)
    shards = list(shards)
    if not shards:
        raise ValueError("shards: an empty list (one shard per rank)")
    shards = [s if isinstance(s, torch.Tensor) else torch.as_tensor(np.asarray(s))
              for s in shards]
    n = len(shards)
    length = sum(int(s.shape[dim]) for s in shards)
    for r, s in enumerate(shards):
        want = _shard_len(length, r, n, layout)
        if s.shape[dim] != want:
            raise ValueError(f"shards[{r}]: {s.shape[dim]} rows along dim {dim}; the {layout} "
                             f"layout of {length} rows over {n} ranks gives rank {r} {want}")
    if layout == "contiguous":
        return torch.cat(shards, dim)
    pieces = [None] * (2 * n)
    for r, s in enumerate(shards):
        (a0, a1), (b0, b1) = _segments(length, r, n, layout)
        pieces[r] = s.narrow(dim, 0, a1 - a0)
        pieces[2 * n - 1 - r] = s.narrow(dim, a1 - a0, b1 - b0)
    return torch.cat(pieces, dim)


# ---- statistics --------------------------------------------------------------------------------

_STATS_KEYS = ("calls", "bytes_sent", "bytes_received", "messages_sent", "messages_received",
               "compute_s", "comm_wait_s", "blocks_computed", "blocks_skipped",
               "visible_pairs")
_STATS = dict.fromkeys(_STATS_KEYS, 0)


def comm_stats():
    """What context_parallel_attention did in this process since the last reset (a dict):
    calls (forward and backward passes), bytes_sent / bytes_received and messages_sent /
    messages_received (point-to-point payloads of the ring and the all-to-all; the small
    agreement collectives are not counted), compute_s (time in posenc kernels and merges),
    comm_wait_s (time blocked waiting for transfers: communication not hidden behind compute),
    blocks_computed / blocks_skipped (kernel calls of the ring, and blocks a mask hid entirely),
    visible_pairs (query-key pairs the computed blocks could see: the work, per head and batch
    row; an upper bound where masks other than causal / window / chunk apply)."""
    return dict(_STATS)


def reset_comm_stats():
    """Sets every counter of comm_stats() to zero."""
    for key in _STATS_KEYS:
        _STATS[key] = 0


class _Timer:
    def __init__(self, key):
        self.key = key

    def __enter__(self):
        self.t = time.perf_counter()

    def __exit__(self, *exc):
        _STATS[self.key] += time.perf_counter() - self.t


# ---- communication -----------------------------------------------------------------------------

class _Comm:
    """Point-to-point transfers within a group, counted, waited on with a timeout."""

    def __init__(self, group, timeout):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.timeout = timeout
        self.globals = [dist.get_global_rank(group, r) if group is not None else r
                        for r in range(self.world)]
        self.works = []

    def send(self, t, to, tag):
        if t.numel() == 0:
            return
        self.works.append(dist.isend(t, self.globals[to], group=self.group, tag=tag))
        _STATS["bytes_sent"] += t.numel() * t.element_size()
        _STATS["messages_sent"] += 1

    def recv(self, t, frm, tag):
        if t.numel() == 0:
            return None
        w = dist.irecv(t, self.globals[frm], group=self.group, tag=tag)
        _STATS["bytes_received"] += t.numel() * t.element_size()
        _STATS["messages_received"] += 1
        return w

    def wait(self, works):
        with _Timer("comm_wait_s"):
            for w in works:
                if w is None:
                    continue
                if self.timeout is None:
                    w.wait()
                else:
                    w.wait(self.timeout)

    def flush(self):
        """Waits for every send posted so far."""
        works, self.works = self.works, []
        self.wait(works)


def _prev(c):
    return (c.rank - 1) % c.world


def _next(c):
    return (c.rank + 1) % c.world


_TAG_KV, _TAG_DKV, _TAG_A2A = 1 << 16, 2 << 16, 3 << 16


def _all_to_all(c, sends, recv_numels, dtype, tag):
    """sends[r]: the flat tensor for rank r (own rank: kept); returns the flat tensors received
    from each rank (point-to-point, so the sizes may differ)."""
    out = [None] * c.world
    waits = []
    for step in range(1, c.world):  # pairwise order: every rank talks to rank +- step
        to, frm = (c.rank + step) % c.world, (c.rank - step) % c.world
        buf = torch.empty(recv_numels[frm], dtype=dtype)
        waits.append(c.recv(buf, frm, tag))
        c.send(sends[to], to, tag)
        out[frm] = buf
    out[c.rank] = sends[c.rank]
    c.wait(waits)
    c.flush()
    return out


# ---- agreement between ranks -------------------------------------------------------------------

def _raise_agreed(c, errors, local=None):
    """errors: the gathered (rank, type name, message) of the ranks that failed."""
    first = errors[0]
    others = ", ".join(str(e[0]) for e in errors[1:])
    msg = (f"context_parallel_attention: rank {first[0]} of {c.world} failed: {first[2]}"
           + (f" (ranks {others} failed too)" if others else ""))
    cls = {"ValueError": ValueError, "TypeError": TypeError,
           "NotImplementedError": NotImplementedError}.get(first[1], RuntimeError)
    raise cls(msg) from local


def _agree(c, error, extra=None):
    """Every rank learns whether any failed; raises the same error on all of them if so. extra:
    a float tensor summed over the ranks in the same collective (returned)."""
    flag = torch.tensor([1.0 if error is not None else 0.0], dtype=torch.float64)
    buf = flag if extra is None else torch.cat([flag, extra.reshape(-1).double()])
    if c.world > 1:
        dist.all_reduce(buf, group=c.group)
    if buf[0].item() > 0:
        local = None if error is None else (c.rank, _error_name(error), str(error))
        gathered = [None] * c.world
        if c.world > 1:
            dist.all_gather_object(gathered, local, group=c.group)
        else:
            gathered = [local]
        failed = [g for g in gathered if g is not None]
        if error is not None and c.world == 1:
            raise error
        _raise_agreed(c, failed, error)
    return None if extra is None else buf[1:].view(extra.shape).to(extra.dtype)


def _error_name(e):
    for cls in (NotImplementedError, TypeError, ValueError):
        if isinstance(e, cls):
            return cls.__name__
    return "RuntimeError"


# ---- the plan: everything both passes need ------------------------------------------------------

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
        t = a.detach() if isinstance(a, torch.Tensor) else torch.as_tensor(np.asarray(a))
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
    t = value.detach() if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))
    return t.to(torch.int64)


def _as_int_tensor(value, what):
    if isinstance(value, torch.Tensor):
        _ops.require_cpu(value, what)
        return value
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
    """The call's layout, positions, masks, options and tables, agreed between the ranks (plain
    attributes, set by _make_plan and _finish_plan)."""


def _local_checks(q, k, v, strategy, layout, kwargs):
    for t, what in ((q, "q"), (k, "k"), (v, "v")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: a torch.Tensor")
        _ops.require_cpu(t, what)
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
    for bad in ("out", "lse", "_base_options"):
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
    meta = torch.zeros(24, dtype=torch.int64)
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
        whole = ("query_positions", "key_positions") + _MASK_TENSORS
        settings = {n: kwargs[n] for n in sorted(kwargs)
                    if n not in whole + ("config", "num_threads")}
        meta[14] = _crc(repr((scheme, strategy, layout, sorted(params or {}),
                              _ops.encode(settings))))
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
    """Positions, masks, options and tables (after the ranks agreed on the shapes)."""
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
    p.params = dict(params or {})
    p.names = sorted(p.params)
    p.mask_names = [n for n in _MASK_TENSORS if n in masks]
    p.dtype = q.dtype


def _options(p, names, mask_names, allow=True):
    kw = dict(p.kw)
    kw["allow_fully_masked"] = allow or p.allow_fully_masked
    kw["\x00names"] = list(names)
    if mask_names:
        kw["\x00masks"] = list(mask_names)
    return _ops.encode(kw)


def _block_masks(p, qa, qb, ka, kb):
    out = []
    for n in p.mask_names:
        t = p.masks[n]
        if n == "query_documents":
            t = t[:, qa:qb].contiguous()
        elif n == "key_documents":
            t = t[:, ka:kb].contiguous()
        elif n == "mask":
            t = t[:, qa:qb, ka:kb].contiguous()
        out.append(t)
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


# ---- merging -----------------------------------------------------------------------------------

def _merge(out_a, lse_a, out_b, lse_b):
    """Exact merge of two partial attentions (float32: posenc's attention_merge, in double per
    row; float64: the same formula in float64)."""
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


# ---- ring --------------------------------------------------------------------------------------

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
        silent = torch.full((p.Hq,), _NO_SINK, dtype=p.cdtype)
        tables = [silent if n == "sinks" else p.tables[n] for n in names]
    return names, tables


def _ring_forward(p, q, k, v):
    c = p.c
    names, tables = _ring_tables(p)
    opts = _options(p, names, p.mask_names)
    qsegs = _local_q_segs(p)
    acc = [None] * len(qsegs)
    error = None
    buf = _pack(p, k, v)
    for step in range(c.world):
        src = (c.rank - step) % c.world
        waits = []
        nxt = None
        if step < c.world - 1:
            nxt = torch.empty(_kv_numel(p, (c.rank - step - 1) % c.world), dtype=buf.dtype)
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
                                q[:, la:lb], ks[:, ka_l:kb_l], vs[:, ka_l:kb_l], tables,
                                _pos_slice(p.qpos, qa, qb), _pos_slice(p.kpos, ka, kb),
                                _block_masks(p, qa, qb, ka, kb), opts)
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
                        o = torch.zeros(p.B, lb - la, p.Hq, p.Dv, dtype=p.cdtype)
                        lse = torch.full((p.B, p.Hq, lb - la), -math.inf, dtype=o.dtype)
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
    opts = _options(p, names, p.mask_names)
    qsegs = _local_q_segs(p)
    dq = torch.zeros_like(q)
    tgrads = {n: torch.zeros(p.tables[n].shape, dtype=torch.float64) for n in p.names}
    error = None
    buf = _pack(p, k, v)
    dkv = None
    for step in range(c.world):
        src = (c.rank - step) % c.world
        waits_in = None
        incoming = None
        if step > 0:  # the shard's gradient so far, from the ranks it visited before
            incoming = torch.empty(_kv_numel(p, src), dtype=p.cdtype)
            waits_in = c.recv(incoming, _prev(c), _TAG_DKV + step - 1)
        waits = []
        nxt = None
        if step < c.world - 1:
            nxt = torch.empty(_kv_numel(p, (c.rank - step - 1) % c.world), dtype=buf.dtype)
            waits.append(c.recv(nxt, _prev(c), _TAG_KV + step))
            c.send(buf, _next(c), _TAG_KV + step)
        dkv = torch.zeros(_kv_numel(p, src), dtype=p.cdtype)
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
                                dout[:, la:lb].contiguous(), tables,
                                _pos_slice(p.qpos, qa, qb), _pos_slice(p.kpos, ka, kb),
                                _block_masks(p, qa, qb, ka, kb), opts)
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
    own = torch.empty(_kv_numel(p, c.rank), dtype=p.cdtype) if c.world > 1 else dkv
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


# ---- all-to-all (Ulysses) ----------------------------------------------------------------------

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
    full = torch.empty(p.B, total, heads, shape_tail, dtype=p.cdtype)
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
        out["slopes"] = slopes[lo:hi].to(p.cdtype).contiguous()
    return out


def _a2a_scatter_grads(p, lo, hi, grads):
    """Local table gradients (heads [lo, hi)) placed in zero tables of the full shapes."""
    full = {}
    for n in p.names:
        t = torch.zeros(p.tables[n].shape, dtype=torch.float64)
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
    opts = _options(p, names, p.mask_names, allow=p.allow_fully_masked)
    error = None
    oh = lh = None
    try:
        with _Timer("compute_s"):
            oh, lh = _ops.attention_impl(qh, kh, vh, [tables[n] for n in names], p.qpos, p.kpos,
                                         [p.masks[n] for n in p.mask_names], opts)
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
    out = torch.empty(p.B, lq, p.Hq, p.Dv, dtype=p.cdtype)
    lse = torch.empty(p.B, p.Hq, lq, dtype=lh.dtype)
    for r, flat in enumerate(got):
        rlo, rhi = hr[r][0], hr[r][1]
        n = p.B * lq * (rhi - rlo) * p.Dv
        out[:, :, rlo:rhi] = flat[:n].view(p.B, lq, rhi - rlo, p.Dv)
        lse[:, rlo:rhi] = flat[n:].view(p.B, rhi - rlo, lq).to(lse.dtype)
    saved = (qh, kh, vh, oh, lh, tables, names, opts)
    return out, lse, saved


def _a2a_backward(p, saved, dout):
    c = p.c
    qh, kh, vh, oh, lh, tables, names, opts = saved
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
                                             [tables[n] for n in names], p.qpos, p.kpos,
                                             [p.masks[n] for n in p.mask_names], opts)
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
    dq = torch.empty(p.B, lq, p.Hq, p.D, dtype=p.cdtype)
    dk = torch.zeros(p.B, lk, p.Hkv, p.D, dtype=p.cdtype)
    dv = torch.zeros(p.B, lk, p.Hkv, p.Dv, dtype=p.cdtype)
    for r, flat in enumerate(got):
        rlo, rhi, rklo, rkhi = hr[r]
        nq = p.B * lq * (rhi - rlo) * p.D
        nk = p.B * lk * (rkhi - rklo) * p.D
        dq[:, :, rlo:rhi] = flat[:nq].view(p.B, lq, rhi - rlo, p.D)
        dk[:, :, rklo:rkhi] += flat[nq:nq + nk].view(p.B, lk, rkhi - rklo, p.D)
        dv[:, :, rklo:rkhi] += flat[nq + nk:].view(p.B, lk, rkhi - rklo, p.Dv)
    return dq, dk, dv, tgrads, error


# ---- autograd ----------------------------------------------------------------------------------

class _ContextParallel(torch.autograd.Function):
    """out, lse of this rank's queries; backward: the ring / all-to-all backward."""

    @staticmethod
    def forward(ctx, p, q, k, v, *tables):
        _STATS["calls"] += 1
        p.tables = {n: t.detach().to(p.cdtype) for n, t in zip(p.names, tables)}
        q0, k0, v0 = q, k, v
        p.wire = k.dtype if (k.dtype in _HALF and v.dtype == k.dtype) else p.cdtype
        q, k, v = (x.detach().to(p.cdtype).contiguous() for x in (q, k, v))
        if p.strategy == "ring":
            out, lse = _ring_forward(p, q, k, v)
            ctx.save_for_backward(q, k, v, out, lse)
        else:
            out, lse, ctx.a2a = _a2a_forward(p, q, k, v)
        ctx.p = p
        ctx.table_dtypes = [t.dtype for t in tables]
        ctx.in_dtypes = [x.dtype for x in (q0, k0, v0)]
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        _STATS["calls"] += 1
        p = ctx.p
        dout = dout.to(p.cdtype).contiguous()
        if p.strategy == "ring":
            q, k, v, out, lse = ctx.saved_tensors
            dq, dk, dv, tgrads, error = _ring_backward(p, q, k, v, out, lse, dout)
        else:
            dq, dk, dv, tgrads, error = _a2a_backward(p, ctx.a2a, dout)
            ctx.a2a = None
        flat = None
        if p.names and p.reduce_grads:
            flat = torch.cat([tgrads[n].reshape(-1) for n in p.names])
        summed = _agree(p.c, error, flat)
        if summed is not None:
            off = 0
            for n in p.names:
                size = tgrads[n].numel()
                tgrads[n] = summed[off:off + size].view(tgrads[n].shape)
                off += size
        dtables = [tgrads[n].to(dt) if ctx.needs_input_grad[4 + i] else None
                   for i, (n, dt) in enumerate(zip(p.names, ctx.table_dtypes))]
        dq, dk, dv = (g.to(dt) for g, dt in zip((dq, dk, dv), ctx.in_dtypes))
        return (None, dq, dk, dv, *dtables)


def context_parallel_attention(q, k, v, scheme=None, *, group=None, strategy="ring",
                               layout="contiguous", params=None, return_lse=False,
                               reduce_grads=True, timeout=None, **kwargs):
    """This rank's shard of the attention over the whole, sharded sequence (differentiable).

    q [batch, seq_q_shard, heads_q, head_dim], k and v [batch, seq_k_shard, heads_kv, ...]: this
    rank's shards of the sequence dimension by `layout` ('contiguous' or 'zigzag', as ``shard``
    makes them; shard sizes are checked against it on every rank). Returns out [batch,
    seq_q_shard, heads_q, v_dim] (and lse [batch, heads_q, seq_q_shard], detached, with
    return_lse=True): the rows of posenc.torch.attention over the whole q, k, v that this rank
    holds. Every rank of `group` (None: the default group) must call it with the same
    arguments apart from its shards.

    strategy: 'ring' (k/v shards passed around, partial results merged by their log-sum-exp;
    masked blocks skipped) or 'all_to_all' (Ulysses: heads_q must be divisible by the world
    size, and each rank's query heads must cover whole kv heads). scheme, params and kwargs: as
    posenc.torch.attention (causal, scale, window, chunk, softcap, sinks in params, config,
    layer, allow_fully_masked, num_threads, ...). query_positions / key_positions (an int
    offset or ids [seq] / [batch, seq]), query_documents / key_documents and mask are those of
    the whole sequence; defaults are posenc's (key j at j, query i at seq_k - seq_q + i, over
    the global lengths). Packed sequences (cu_seqlens) are not supported.

    reduce_grads: table gradients summed over the ranks (True: every rank gets the full
    gradient) or left per rank (False: reduce them with the other parameters' gradients).
    timeout: seconds or a timedelta for each transfer (default: the process group's).
    Half-precision inputs are computed in float32 and the output cast back to q's dtype."""
    p, _ = _make_plan(q, k, v, scheme, params, group, strategy, layout, kwargs, timeout)
    error = None
    try:
        _finish_plan(p, q, scheme, params, kwargs)
        p.cdtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        p.reduce_grads = reduce_grads
        if strategy == "all_to_all":
            if kwargs.get("config") is not None:
                raise ValueError("strategy all_to_all: config= fixes the model's head count, "
                                 "which a head shard cannot match; use strategy='ring', or the "
                                 "scheme and its settings as keywords")
            _check_heads(p)
        elif p.Hkv == 0 or p.Hq % p.Hkv:
            raise ValueError(f"k: kv heads ({p.Hkv}) must divide q heads ({p.Hq})")
    except Exception as e:
        error = e
    _agree(p.c, error)
    tables = [params[n] if isinstance(params[n], torch.Tensor)
              else torch.as_tensor(np.asarray(params[n])) for n in p.names]
    out_dtype = q.dtype
    out, lse = _ContextParallel.apply(p, q, k, v, *tables)
    if out_dtype in _HALF:
        out = out.to(out_dtype)
    return (out, lse) if return_lse else out


class ContextParallel(torch.nn.Module):
    """A posenc.torch attention module run context-parallel: wraps a PositionalAttention or a
    scheme module (NoPositions, Rope, Alibi, T5RelativeBias, ShawRelative, XLRelative,
    DebertaRelative) and calls context_parallel_attention with its scheme, settings and tables
    (and, for PositionalAttention, its causal flag, chunk, sinks and layout) on this rank's
    shards. The wrapped module keeps its parameters (``.module``); the forward's keywords are
    context_parallel_attention's and override the module's settings."""

    def __init__(self, module, *, group=None, strategy="ring", layout="contiguous",
                 reduce_grads=True, timeout=None):
        super().__init__()
        from . import PositionalAttention, _Scheme
        if not isinstance(module, (PositionalAttention, _Scheme)):
            raise TypeError("module: a posenc.torch.PositionalAttention or scheme module, got "
                            f"{type(module).__name__}")
        self.module = module
        self.cp = {"group": group, "strategy": strategy, "layout": layout,
                   "reduce_grads": reduce_grads, "timeout": timeout}

    def forward(self, q, k, v, *, params=None, causal=None, **kwargs):
        """This rank's shard of the module's attention over the whole sequence."""
        from . import PositionalAttention
        m = self.module
        transpose = False
        tables = {}
        if isinstance(m, PositionalAttention):
            transpose = m.layout == "bhld"
            if transpose:
                q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            if m.chunk is not None:
                kwargs.setdefault("chunk", m.chunk)
            if m.sinks is not None:
                tables["sinks"] = m.sinks
            causal = m.causal if causal is None else causal
            m = m.positions
        tables = {**m.tables(), **tables, **(params or {})}
        kw = {**m.settings(), **kwargs}
        if causal is not None:
            kw["causal"] = causal
        out = context_parallel_attention(q, k, v, m.scheme, params=tables or None,
                                         **{**self.cp, **kw})
        return out.transpose(1, 2) if transpose else out


# ---- cost model --------------------------------------------------------------------------------

def cost_model(seq_len, world_size, *, heads_q, heads_kv=None, head_dim, v_dim=None, batch=1,
               strategy="ring", layout="contiguous", causal=True, bytes_per_element=4):
    """Per-rank communication and work of one attention layer (no process group needed).

    Returns a dict: bytes_sent_forward / bytes_sent_backward (per rank, the most any rank sends:
    ring: (N-1) k/v shards forward, (N-1) k/v shards and N k/v gradient shards backward;
    all_to_all: q, k, v out and back forward plus lse, dout, dq, dk, dv backward),
    work (visible query-key pairs per rank, per head and batch row: the ring's causal blocks
    after skipping, or Ulysses' full sequence on heads/N), work_max_over_min (the compute
    imbalance), activation_elements (per rank: its q, k, v and out shards)."""
    _check_layout(layout)
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy: '{strategy}' (ring or all_to_all)")
    n = world_size
    hkv = heads_kv or heads_q
    dv = v_dim or head_dim
    lens = [_shard_len(seq_len, r, n, layout) for r in range(n)]
    segs = [_segments(seq_len, r, n, layout) for r in range(n)]
    be = bytes_per_element

    def pairs(qa, qb, ka, kb):
        if qb <= qa or kb <= ka:
            return 0
        if not causal:
            return (qb - qa) * (kb - ka)
        # sum over queries i of |{j in [ka, kb): j <= i}|, in closed form
        lo, hi = max(qa, ka), min(qb, kb - 1)
        ramp = (hi - lo) * (lo + hi + 1 - 2 * ka) // 2 if hi > lo else 0
        full = max(0, qb - max(qa, kb - 1)) * (kb - ka)
        return ramp + full

    def block_pairs(qr, kr):
        return sum(pairs(a, b, c, d) for a, b in segs[qr] for c, d in segs[kr])

    if strategy == "ring":
        work = [sum(block_pairs(r, s) for s in range(n)) * heads_q for r in range(n)]
        kv = [batch * L * hkv * (head_dim + dv) * be for L in lens]
        fwd = [sum(kv[(r - t) % n] for t in range(n - 1)) for r in range(n)]
        bwd = [fwd[r] + sum(kv[(r - t) % n] for t in range(n)) for r in range(n)]
    else:
        if heads_q % n:
            raise ValueError(f"heads_q ({heads_q}) must be divisible by world_size ({n})")
        total = pairs(0, seq_len, 0, seq_len)
        work = [total * heads_q // n] * n
        hq = heads_q // n
        group = heads_q // hkv
        hk = [((r + 1) * hq - 1) // group + 1 - (r * hq) // group for r in range(n)]
        fwd, bwd = [], []
        for r in range(n):
            others = [s for s in range(n) if s != r]
            # q, k, v of this rank's rows for the other ranks' heads; out and lse of their rows
            # for this rank's heads back.
            to = sum(lens[r] * (hq * head_dim + hk[s] * (head_dim + dv)) for s in others)
            back = sum(lens[s] * hq * (dv + 1) for s in others)
            fwd.append(batch * (to + back) * be)
            # dout of this rank's rows for the others' heads; dq, dk, dv of their rows back.
            b_dout = sum(lens[r] * hq * dv for s in others)
            b_grads = sum(lens[s] * (hq * head_dim + hk[r] * (head_dim + dv)) for s in others)
            bwd.append(batch * (b_dout + b_grads) * be)
    act = [batch * L * (2 * heads_q * head_dim + hkv * (head_dim + dv)) for L in lens]
    lo = min(work) if min(work) > 0 else 1
    return {"bytes_sent_forward": max(fwd), "bytes_sent_backward": max(bwd),
            "bytes_sent_forward_per_rank": fwd, "bytes_sent_backward_per_rank": bwd,
            "work": work, "work_max_over_min": max(work) / lo,
            "activation_elements": act}
