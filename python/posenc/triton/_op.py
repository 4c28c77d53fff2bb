"""The attention ops' Triton side: ``torch.ops.posenc.attention`` and ``attention_backward`` with
``backend="triton"`` (or ``"auto"`` on CUDA tensors) come here with their typed arguments, which
become a Plan of this package and one launch of its kernels.

Block masks (``query_documents``, ``key_documents``, ``prefix``, ``mask`` and the setting
``global_positions``) and packed sequences (``cu_seqlens_q``, ``cu_seqlens_k``: rank-3 q, k, v,
out [total_q, heads_q, v_dim] and lse [heads_q, total_q]) reach the kernels as one batch row with
documents. A model config (``config``, ``layer``) is resolved by posenc's own scheme builder
(the CPU library's, so its checks and choices are the CPU backend's). What the Triton kernels
do not compute yet is refused by name, with the CPU backend as the way to get it: Llama 4's
query temperature and DeepSeek's RoPE offset.
"""

import numpy as np
import torch

import posenc

from . import _backward, _forward, _prepare

# Settings that reach this backend as the ops' typed arguments, by the scheme that reads them.
_ROPE = ("freqs_inv_freq", "freqs_attention_factor", "freqs_angles", "base", "rotary_dim",
         "style", "scaling", "seq_len", "angles")
_SCHEME_SETTINGS = {"rope": _ROPE, "alibi": ("max_bias",),
                    "t5": ("num_buckets", "max_distance", "bidirectional"), "xl": ("base",),
                    "deberta": ("position_buckets", "max_relative_positions", "deberta_p2c",
                                "deberta_float64_log")}
# Tables by scheme (sinks: every scheme).
_TABLES = _prepare.SCHEME_TABLES
# Arguments with no meaning for these kernels (threads of the CPU kernels).
_IGNORED = ("num_threads", "backend")


def _unsupported(what):
    return ValueError(f"backend='triton': {what} is not supported by the Triton kernels yet "
                      "(backend='cpu' computes it on CPU tensors)")


def _rope_frequencies(settings, head_dim, query_pos, key_pos):
    """The RopeFrequencies of the settings: given directly (freqs_*), or from base, rotary_dim,
    scaling and seq_len (default: the largest position + 1, as posenc.attention takes it)."""
    inv = settings.get("freqs_inv_freq")
    if inv is not None:
        kw = {}
        if settings.get("freqs_attention_factor") is not None:
            kw["attention_factor"] = settings["freqs_attention_factor"]
        if settings.get("freqs_angles") is not None:
            kw["angles"] = settings["freqs_angles"]
        return posenc.RopeFrequencies(list(inv), **kw)
    seq_len = settings.get("seq_len")
    if seq_len is None:
        seq_len = int(max(query_pos.max(), key_pos.max())) + 1
    kw = {"seq_len": seq_len}
    for name in ("rotary_dim", "base", "angles"):
        if settings.get(name) is not None:
            kw[name] = settings[name]
    if settings.get("scaling") is not None:
        import json
        kw["scaling"] = json.loads(settings["scaling"])
    return posenc.rope_frequencies(head_dim, **kw)


def _unpacked(q, k, v, query_positions, key_positions, masks):
    """q, k, v, positions and masks as one batch row when masks hold cu_seqlens (packed
    sequences: the sequences become documents), else as given; and whether they were packed."""
    masks = dict(masks)
    cu_q, cu_k = masks.pop("cu_seqlens_q", None), masks.pop("cu_seqlens_k", None)
    if cu_q is None and cu_k is None:
        return q, k, v, query_positions, key_positions, masks, False
    for name in ("query_documents", "key_documents"):
        if masks.get(name) is not None:
            raise ValueError(f"{name} cannot be combined with cu_seqlens (the sequences are the "
                             "documents)")
    q, k, v, qdoc, kdoc, qpos, kpos = _prepare.unpack(q, k, v, cu_q, cu_k, query_positions,
                                                      key_positions)
    masks["query_documents"], masks["key_documents"] = qdoc, kdoc
    return q, k, v, qpos, kpos, masks, True


def plan(q, k, v, tables, table_names, query_positions, key_positions, masks, settings):
    """(Plan, {table name: tensor}) of one op call (q, k, v of one batch row for packed
    sequences: masks then hold their documents); ValueError naming what this backend lacks."""
    if settings.get("config") is not None or settings.get("layer") is not None:
        return _plan_from_config(q, k, v, tables, table_names, query_positions, key_positions,
                                 masks, settings)
    scheme = settings.get("scheme") or "none"
    if scheme not in _prepare.SCHEMES:
        if scheme not in {s["name"] for s in posenc.schemes()}:  # posenc's message
            raise posenc.InvalidValueError(
                f"unknown scheme '{scheme}' ({', '.join(_prepare.SCHEMES)})")
        raise _unsupported(f"scheme '{scheme}'")
    named = dict(zip(table_names, tables))
    for name in named:
        if name != "sinks" and name not in _TABLES.get(scheme, ()):
            raise ValueError(f"tables: '{name}' is not a table of scheme '{scheme}'")
    known = set(_SCHEME_SETTINGS.get(scheme, ())) | {
        "scheme", "causal", "scale", "window", "chunk", "softcap", "allow_fully_masked",
        "global_positions",
        "query_positions_offset", "key_positions_offset", "config_source", *_IGNORED}
    for name, value in settings.items():
        if value is not None and name not in known:
            owners = [s for s, names in _SCHEME_SETTINGS.items() if name in names]
            if owners:  # a setting of another scheme: posenc's TypeError
                keyword = "freqs" if name.startswith("freqs_") else name
                raise TypeError(f"attention(): keyword '{keyword}' does not apply to scheme "
                                f"'{scheme}' (it is for {' '.join(owners)})")
            raise _unsupported(f"'{name}' with scheme '{scheme}'")
    qpos = query_positions if query_positions is not None else settings.get(
        "query_positions_offset")
    kpos = key_positions if key_positions is not None else settings.get("key_positions_offset")
    given = {}
    if scheme != "rope":
        given = {n: t for n, t in named.items() if n != "sinks"}
        given.update((n, settings[n]) for n in _SCHEME_SETTINGS.get(scheme, ())
                     if settings.get(n) is not None)
    p = _prepare.prepare(q, k, v, scheme, causal=settings.get("causal", False),
                         scale=settings.get("scale"), window=settings.get("window"),
                         chunk=settings.get("chunk"), softcap=settings.get("softcap"),
                         sinks=named.get("sinks"), query_positions=qpos, key_positions=kpos,
                         settings={} if scheme == "rope" else given,
                         query_documents=masks.get("query_documents"),
                         key_documents=masks.get("key_documents"), prefix=masks.get("prefix"),
                         global_positions=settings.get("global_positions"),
                         mask=masks.get("mask"))
    if scheme == "rope":
        freqs = _rope_frequencies(settings, p.head_dim, p.query_pos, p.key_pos)
        _prepare._prepare_rope(p, {"rope": freqs, "rope_style": settings.get("style") or "half"})
    return p, named


def _host_positions(p, batch, n, default_start, what):
    """Position ids (a tensor or an int offset, or None) as int64 NumPy [1 or batch, n]."""
    ids = _prepare._positions(p.cpu() if isinstance(p, torch.Tensor) else p, batch, n,
                              default_start, torch.device("cpu"), what)
    return ids.numpy()


def _plan_from_config(q, k, v, tables, table_names, query_positions, key_positions, masks,
                      settings):
    """The Plan of a call with a model config (or a layer): posenc's own scheme builder resolves
    the config, the layer and the settings (``_posenc._resolve_attention``: the scheme, its
    frequencies or slopes or buckets, the layer's scale, window, chunk and soft-cap, explicit
    values first, with posenc.attention's checks and messages), then the kernels run what it
    resolved. Llama 4's query temperature and DeepSeek's RoPE offset are refused."""
    from .. import _ops
    from .._posenc import _resolve_attention
    named = dict(zip(table_names, tables))
    b, lq, lk = q.shape[0], q.shape[1], k.shape[1]
    kw = _ops._binding_kwargs("attention", {n: x for n, x in settings.items()
                                            if n not in ("query_positions_offset",
                                                         "key_positions_offset")})
    for name in ("num_threads", "allow_fully_masked"):
        kw.pop(name, None)
    kpos = key_positions if key_positions is not None else settings.get("key_positions_offset")
    qpos = query_positions if query_positions is not None else settings.get(
        "query_positions_offset")
    kw["key_positions"] = _host_positions(kpos, b, lk, 0, "key_positions")
    kw["query_positions"] = _host_positions(qpos, b, lq, lk - lq, "query_positions")
    scheme = kw.pop("scheme", None)

    def shape_only(t):
        return np.broadcast_to(np.float32(0), tuple(t.shape))

    r = _resolve_attention(shape_only(q), shape_only(k), shape_only(v), scheme,
                           params={n: shape_only(t) for n, t in named.items()}, **kw)
    if r["query_temperature"] is not None:
        raise _unsupported("a layer's query temperature (Llama 4's NoPE layers)")
    scheme, resolved = r["scheme"], r["settings"]
    if scheme not in _prepare.SCHEMES:
        raise _unsupported(f"scheme '{scheme}'")
    given = {n: t for n, t in named.items() if n != "sinks"}
    if scheme == "alibi" and "slopes" not in given:
        given["slopes"] = torch.tensor(resolved["slopes"], dtype=torch.float32,
                                       device=q.device)
    elif scheme in ("t5", "xl", "deberta"):
        given.update(resolved)
    p = _prepare.prepare(q, k, v, "none" if scheme == "rope" else scheme, causal=r["causal"],
                         scale=r["scale"], window=r["window"], chunk=r["chunk"],
                         softcap=r["softcap"], sinks=named.get("sinks"), query_positions=qpos,
                         key_positions=kpos, settings=given,
                         query_documents=masks.get("query_documents"),
                         key_documents=masks.get("key_documents"), prefix=masks.get("prefix"),
                         global_positions=settings.get("global_positions"),
                         mask=masks.get("mask"))
    if scheme == "rope":
        if resolved["offset"]:
            raise _unsupported("a RoPE offset (DeepSeek's rotated dims after the others)")
        freqs = posenc.RopeFrequencies(resolved["inv_freq"],
                                       attention_factor=resolved["attention_factor"],
                                       angles=resolved["angles"])
        p.scheme = _prepare.ROPE
        _prepare._prepare_rope(p, {"rope": freqs, "rope_style": resolved["style"]})
    return p, named


def _require_runnable(q):
    """ValueError unless the kernels can run on q's device: CUDA, or the CPU under Triton's
    interpreter (TRITON_INTERPRET=1 set before triton was first imported)."""
    if q.device.type != "cuda" and not _forward.INTERPRETED:
        raise ValueError(f"backend='triton': q is on device '{q.device}'; the Triton kernels run "
                         "on CUDA tensors (CPU tensors only under TRITON_INTERPRET=1, set before "
                         "triton is first imported; backend='cpu' runs posenc's CPU kernels)")


def forward(q, k, v, tables, table_names, query_positions, key_positions, masks, settings,
            inputs=None):
    """(out, lse) of the op: out float32 for half inputs (the backward's delta reads it; the
    caller rounds it once), in q's dtype otherwise; lse float32. Packed sequences: out [total_q,
    heads_q, v_dim], lse [heads_q, total_q]. inputs: [(name, tensor)] searched for a non-finite
    element when the result is not finite (default q, k, v)."""
    inputs = inputs or (("q", q), ("k", k), ("v", v))
    q, k, v, query_positions, key_positions, masks, packed = _unpacked(
        q, k, v, query_positions, key_positions, masks)
    p, _ = plan(q, k, v, tables, table_names, query_positions, key_positions, masks, settings)
    _require_runnable(q)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out = torch.empty((p.batch, p.seq_q, p.heads_q, p.v_dim),
                      dtype=torch.float32 if q.dtype in (torch.float16, torch.bfloat16)
                      else q.dtype, device=q.device)
    lse = torch.empty((p.batch, p.heads_q, p.seq_q), dtype=torch.float32, device=q.device)
    _forward.forward(q, k, v, p, out, lse)
    _forward.check_result(lse, p, inputs, settings.get("allow_fully_masked"))
    return (out[0], lse[0]) if packed else (out, lse)


def backward(q, k, v, out, lse, dout, tables, table_names, query_positions, key_positions, masks,
             settings):
    """[dq, dk, dv, d<table> for each table] of the op."""
    q, k, v, query_positions, key_positions, masks, packed = _unpacked(
        q, k, v, query_positions, key_positions, masks)
    if packed:
        out, lse, dout = out[None], lse[None], dout[None]
    p, named = plan(q, k, v, tables, table_names, query_positions, key_positions, masks,
                    settings)
    _require_runnable(q)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    want_table = any(n != "sinks" for n in named)
    dq, dk, dv, dsinks, dtables = _backward.backward(
        q, k, v, out, lse, dout, None, p, (True, True, True, "sinks" in named, want_table))
    grads = dict(dtables or {}, sinks=dsinks)
    if packed:
        dq, dk, dv = dq[0], dk[0], dv[0]
    return [dq, dk, dv] + [grads[n].reshape(named[n].shape).to(named[n].dtype)
                           for n in table_names]


def _check_pages(q, k_pages, v_pages, layout):
    """q and the pools of a paged call: types, one device and dtype, shapes (the CPU kernel's
    messages)."""
    for t, what in ((q, "q"), (k_pages, "k_pages"), (v_pages, "v_pages")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"attention_paged: {what}: a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise posenc.ShapeError(f"attention_paged: {what}: 4 dimensions, got "
                                    f"{list(t.shape)}")
        if t.dtype != q.dtype:
            raise TypeError(f"attention_paged: the Triton kernels take q and the pages of one "
                            f"dtype (q {q.dtype}, {what} {t.dtype})")
        if t.device != q.device:
            raise ValueError(f"attention_paged: {what} is on {t.device}, q on {q.device}")
    if q.dtype not in _prepare.DTYPES:
        raise TypeError(f"attention_paged: q: float32, float16 or bfloat16, got {q.dtype}")
    tok = layout == "token_major"
    page_size, heads_kv = k_pages.shape[1:3] if tok else k_pages.shape[2:0:-1]
    if page_size < 1 or heads_kv < 1 or k_pages.shape[3] < 1:
        want = ("[num_pages, page_size, heads_kv, head_dim] (token_major)" if tok else
                "[num_pages, heads_kv, page_size, head_dim] (head_major)")
        raise posenc.ShapeError(f"attention_paged: k_pages {list(k_pages.shape)} must be {want} "
                                f"with page_size, heads_kv and head_dim >= 1")
    if v_pages.shape != k_pages.shape:
        raise posenc.ShapeError(f"attention_paged: k_pages {list(k_pages.shape)} and v_pages "
                                f"{list(v_pages.shape)} must have the same shape")
    if q.shape[3] != k_pages.shape[3]:
        raise posenc.ShapeError(f"attention_paged: q {list(q.shape)} and k_pages "
                                f"{list(k_pages.shape)} differ in head_dim")
    if q.shape[2] < 1 or q.shape[2] % heads_kv:
        raise posenc.ShapeError(f"attention_paged: k_pages: kv heads ({heads_kv}) must divide q "
                                f"heads ({q.shape[2]})")


def paged(q, k_pages, v_pages, block_table, seq_lens, tables, table_names, query_positions,
          settings):
    """posenc.attention_paged on the Triton kernels: the forward kernel reads each row's keys
    and values from their pages where they lie (key j of row b: slot j % page_size of page
    block_table[b, j // page_size]), with no gathered copy; keys at 0 .. len - 1 and queries at
    len - seq_q + i unless query_positions are given. out [batch, seq_q, heads_q, v_dim] in q's
    dtype. q, k_pages and v_pages share one dtype (float32, float16 or bfloat16)."""
    layout = settings.get("layout") or "token_major"
    if layout not in ("token_major", "head_major"):
        raise ValueError(f"layout: 'token_major' or 'head_major' (got {layout!r})")
    _check_pages(q, k_pages, v_pages, layout)
    batch, seq_q = q.shape[0], q.shape[1]
    page_size = k_pages.shape[2 if layout == "head_major" else 1]
    num_pages = k_pages.shape[0]
    for t, what, dims in ((block_table, "block_table", "[batch, max_pages]"),
                          (seq_lens, "seq_lens", "[batch]")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: a torch.Tensor, got {type(t).__name__}")
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise TypeError(f"{what}: expected integers, got dtype "
                            f"{str(t.dtype).replace('torch.', '')}")
        if t.dim() != dims.count(",") + 1:
            raise posenc.ShapeError(f"{what}: expected {dims.count(',') + 1} dimensions "
                                    f"{dims}, got {t.dim()}")
        if t.shape[0] != batch:
            raise posenc.ShapeError(f"attention_paged: {what} {list(t.shape)} must be {dims} "
                                    f"with batch {batch}")
    # Checked on the host before the kernel reads a page (one copy of the table and lengths).
    table = block_table.to("cpu", torch.int64)
    lens = [int(n) for n in seq_lens.to("cpu", torch.int64)]
    for b, n in enumerate(lens):
        if n < 0:
            raise posenc.InvalidValueError(f"attention_paged: seq_lens[{b}] = {n} is negative")
        if n > table.shape[1] * page_size:
            raise posenc.InvalidValueError(
                f"attention_paged: seq_lens[{b}] = {n} exceeds max_pages * page_size = "
                f"{table.shape[1]} * {page_size} = {table.shape[1] * page_size}")
        used = table[b, :(n + page_size - 1) // page_size]
        bad = ((used < 0) | (used >= num_pages)).nonzero()
        if len(bad):
            j = int(bad[0])
            raise posenc.InvalidValueError(
                f"attention_paged: block_table[{b}][{j}] = {int(used[j])} is outside [0, "
                f"num_pages = {num_pages})")
    if settings.get("query_positions_offset") is not None:
        raise _unsupported("an int query_positions offset with paged caches")
    # The pages as [num_pages, page_size, heads_kv, dim] views (head-major pages transposed),
    # read in place by the kernel through the block table.
    kp, vp = ((t.transpose(1, 2) if layout == "head_major" else t) for t in (k_pages, v_pages))
    kp, vp = (t if t.stride(-1) == 1 else t.contiguous() for t in (kp, vp))
    if num_pages == 0:  # no page: every row is empty and nothing is read
        kp, vp = (t.new_zeros(1, 1, *t.shape[2:]) for t in (kp, vp))
    seq_k = max(lens + [1])
    # Stand-ins of the keys' shape [batch, seq_k, heads_kv, dim] for the plan (no copy).
    k_like, v_like = (t[:1, :1].expand(batch, seq_k, *t.shape[2:]) for t in (kp, vp))
    if query_positions is None:  # the last seq_q cached tokens (0 .. seq_q - 1 in an empty row)
        for b, n in enumerate(lens):
            if 0 < n < seq_q:
                raise posenc.InvalidValueError(
                    f"attention_paged: seq_lens[{b}] = {n} is less than seq_q ({seq_q}): the "
                    f"default query positions are the last seq_q cached tokens; pass "
                    f"query_positions")
        counts = torch.tensor([n if n else seq_q for n in lens], dtype=torch.int64)
        query_positions = counts[:, None] - seq_q + torch.arange(seq_q)
    rest = {n: v for n, v in settings.items() if n != "layout"}
    inputs = (("q", q), ("k_pages", k_pages), ("v_pages", v_pages))
    p, _ = plan(q, k_like, v_like, tables, table_names, query_positions.to(q.device), None, {},
                rest)
    _require_runnable(q)
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty((batch, seq_q, p.heads_q, p.v_dim), dtype=torch.float32, device=q.device)
    lse = torch.empty((batch, p.heads_q, seq_q), dtype=torch.float32, device=q.device)
    pages = (table.to(q.device, torch.int32), torch.tensor(lens, dtype=torch.int32,
                                                             device=q.device), page_size)
    _forward.forward(q, kp, vp, p, out, lse, pages=pages)

    def no_key(lse, p):
        b, _, i = (int(x) for x in torch.nonzero(torch.isneginf(lse))[0])
        pos = int(p.query_pos[b if p.query_pos.shape[0] > 1 else 0, i])
        return posenc.InvalidValueError(
            f"attention_paged: query {i} (batch {b}, position {pos}, seq_lens {lens[b]}) sees no "
            f"key under the mask; allow_fully_masked gives 0 for such rows")

    _forward.check_result(lse, p, inputs, settings.get("allow_fully_masked"), no_key)
    return out.to(q.dtype)
