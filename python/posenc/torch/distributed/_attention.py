"""The entry points: context_parallel_attention (the plan, then the ring or all-to-all forward
and backward in one autograd Function) and the ContextParallel module."""

import numpy as np
import torch

from ._comm import _STATS, _agree
from ._plan import _HALF, _finish_plan, _make_plan
from ._ring import _ring_backward, _ring_forward
from ._ulysses import _a2a_backward, _a2a_forward, _check_heads


class _ContextParallel(torch.autograd.Function):
    """out, lse of this rank's queries; backward: the ring / all-to-all backward."""

    @staticmethod
    def forward(ctx, p, q, k, v, *tables):
        _STATS["calls"] += 1
        p.tables = {n: t.detach().to(p.device, p.cdtype) for n, t in zip(p.names, tables)}
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
        p.device = q.device
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
        from .. import PositionalAttention, _Scheme
        if not isinstance(module, (PositionalAttention, _Scheme)):
            raise TypeError("module: a posenc.torch.PositionalAttention or scheme module, got "
                            f"{type(module).__name__}")
        self.module = module
        self.cp = {"group": group, "strategy": strategy, "layout": layout,
                   "reduce_grads": reduce_grads, "timeout": timeout}

    def forward(self, q, k, v, *, params=None, causal=None, **kwargs):
        """This rank's shard of the module's attention over the whole sequence."""
        from .. import PositionalAttention
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
