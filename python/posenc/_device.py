"""The elementwise ops on tensors of other devices (CUDA): RoPE (``posenc::rope``,
``posenc::rope_half`` and their gradients), the absolute encodings (``posenc::add_learned``,
``learned_backward``, ``add_sinusoidal``, ``sinusoidal_encode``), ``rerotate_rope``,
``attention_merge`` and the paged cache's ``rope_append`` (the pages written in place).

The same numbers as posenc's CPU kernels, by the same recipe: what depends only on the positions
(RoPE's angles, the sinusoidal table) is computed by posenc on the host in float64, from the
positions the call gives, and moved to the tensor's device; the rest is PyTorch operations there.
Accurate RoPE rotates in float64 and rounds once, as the CPU kernel does, so the results agree to
the last bit (float32 angles: the frameworks' float32 recipe, whose cos and sin are the device's).
The ops call these for a tensor that is not on the CPU; the tests call them on CPU tensors and
compare them with the CPU kernels.
"""

import math

import numpy as np
import torch

from . import _posenc

# The largest position posenc takes (docs/attention.md).
_MAX_POSITION = 1 << 48


def _ids(positions, offset, batch, seq, what="positions"):
    """Integer positions [1 or batch, seq] on the host (int64): ids given as a tensor ([seq] or
    [batch, seq]), else offset + 0, 1, ... ValueError for a wrong shape or a value outside
    [0, 2^48]."""
    if positions is None:
        start = 0 if offset is None else int(offset)
        ids = np.arange(start, start + seq, dtype=np.int64)[None, :]
    else:
        ids = positions.detach().to("cpu", torch.int64).numpy()
        if ids.ndim == 1:
            ids = ids[None, :]
        if ids.ndim != 2 or ids.shape[1] != seq or ids.shape[0] not in (1, batch):
            raise _posenc.ShapeError(f"{what}: expected [{seq}] or [{batch}, {seq}], got "
                                     f"{list(positions.shape)}")
    if ids.size and (ids.min() < 0 or ids.max() > _MAX_POSITION):
        bad = ids.min() if ids.min() < 0 else ids.max()
        raise _posenc.InvalidValueError(f"{what}: {int(bad)} is outside [0, 2^48]")
    return ids


def _layout(x):
    """(batch, seq) of x [batch, seq, heads, dim] or [seq, heads, dim]."""
    if x.dim() not in (3, 4):
        raise _posenc.ShapeError(f"x: expected [batch, seq, heads, head_dim] or [seq, heads, "
                                 f"head_dim], got {x.dim()} dimensions")
    return (x.shape[0] if x.dim() == 4 else 1), x.shape[-3]


def rope(x, positions, kw, kernel=None):
    """RoPE of x by posenc.apply_rope's keywords `kw` (freqs, style, rotary_dim, base, scaling,
    seq_len, angles, config, inverse, positions: an int offset). kernel: the Triton kernel
    (default on CUDA tensors; under TRITON_INTERPRET=1 on CPU tensors too) rather than PyTorch
    operations; the same numbers."""
    batch, seq = _layout(x)
    ids = _ids(positions, kw.get("positions"), batch, seq)
    config = kw.get("config")
    freqs = kw.get("freqs")
    if freqs is None:
        seq_len = kw.get("seq_len")
        if seq_len is None:
            seq_len = int(ids.max()) + 1 if ids.size else 0
        common = {"seq_len": seq_len, "angles": kw.get("angles", "accurate")}
        if config is not None:
            freqs = _posenc.rope_frequencies(config=config, **common)
        else:
            own = {n: kw[n] for n in ("rotary_dim", "base", "scaling") if n in kw}
            freqs = _posenc.rope_frequencies(x.shape[-1], **own, **common)
    style = kw.get("style") or (config.rope["style"] if config is not None else "half")
    if kernel is None:
        kernel = x.device.type == "cuda"
    if kernel:
        return _rotate_kernel(x, ids, freqs, style, bool(kw.get("inverse")))
    return _rotate(x, ids, freqs, style, bool(kw.get("inverse"))).to(x.dtype)


def _tables(ids, freqs, inverse, device):
    """(computing dtype, cos, sin) of the angles ids * inv_freq, [1 or batch, seq, R/2] on the
    device, the attention factor included and sin negated for the inverse rotation: float64 for
    accurate angles (computed on the host), float32 for float32 ones (the frameworks' recipe:
    float32 angles, cos and sin, the device's own)."""
    inv = np.asarray(freqs.inv_freq, dtype=np.float64)
    sign = -1.0 if inverse else 1.0
    if freqs.angles == "float32":
        angle = (torch.from_numpy(ids.astype(np.float32))[..., None]
                 * torch.from_numpy(inv.astype(np.float32))).to(device)
        cos, sin = torch.cos(angle), torch.sin(angle)
        factor = torch.tensor(freqs.attention_factor, dtype=torch.float32)
        cos, sin = cos * factor.to(device), sin * factor.to(device)
        return torch.float32, cos, sign * sin
    angle = ids.astype(np.float64)[..., None] * inv
    cos = torch.from_numpy(np.cos(angle) * freqs.attention_factor).to(device)
    sin = torch.from_numpy(sign * np.sin(angle) * freqs.attention_factor).to(device)
    return torch.float64, cos, sin


def _check_rotary(x, freqs):
    if int(freqs.rotary_dim) > x.shape[-1]:
        raise _posenc.ShapeError(f"x: head_dim {x.shape[-1]} is smaller than the rotary dim "
                                 f"{int(freqs.rotary_dim)}")


def _rotate(x, ids, freqs, style, inverse, wide=None):
    """x rotated at the ids by freqs (`wide`: x already widened to the computing dtype), in the
    computing dtype (float64 for accurate angles, float32 for float32 ones), not rounded."""
    _check_rotary(x, freqs)
    rotary = int(freqs.rotary_dim)
    compute, cos, sin = _tables(ids, freqs, inverse, x.device)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # [1 or batch, seq, 1, R/2]
    if x.dim() == 3:
        cos, sin = cos[0], sin[0]
    wide = x.to(compute) if wide is None else wide
    half = rotary // 2
    if style == "interleaved":
        a, b = wide[..., 0:rotary:2], wide[..., 1:rotary:2]
        rotated = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
    else:
        a, b = wide[..., :half], wide[..., half:rotary]
        rotated = torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)
    return torch.cat((rotated, wide[..., rotary:]), dim=-1)


def _rotate_kernel(x, ids, freqs, style, inverse):
    """x rotated and rounded to its dtype by the Triton kernel (posenc.triton._rope): one read
    and one write of x, the numbers of _rotate(...).to(x.dtype)."""
    from .triton import _rope
    _check_rotary(x, freqs)
    _, cos, sin = _tables(ids, freqs, inverse, x.device)
    x4 = x if x.dim() == 4 else x[None]
    if x4.stride(-1) != 1:
        x4 = x4.contiguous()
    out = torch.empty(x4.shape, dtype=x.dtype, device=x.device)
    if int(freqs.rotary_dim) == 0:
        return out.copy_(x4).view(x.shape)
    _rope.rotate(x4, cos.contiguous(), sin.contiguous(), int(freqs.rotary_dim),
                 style == "interleaved", out=out)
    return out.view(x.shape)


def rerotate_rope(k, positions, kw):
    """Keys rotated with kw's from_freqs moved to to_freqs: the inverse rotation by from_freqs
    and the rotation by to_freqs in float64, rounded once (accurate angles only, one rotary
    dim), as the CPU kernel does."""
    batch, seq = _layout(k)
    ids = _ids(positions, kw.get("positions"), batch, seq)
    a, b = kw["from_freqs"], kw["to_freqs"]
    if a.rotary_dim != b.rotary_dim:
        raise _posenc.InvalidValueError(f"rerotate_rope: from_freqs and to_freqs need the same "
                                        f"rotary dim (got {a.rotary_dim} and {b.rotary_dim})")
    if a.angles != "accurate" or b.angles != "accurate":
        raise _posenc.InvalidValueError("rerotate_rope: accurate angles only")
    style = kw.get("style") or "half"
    back = _rotate(k, ids, a, style, True)
    return _rotate(k, ids, b, style, False, wide=back).to(k.dtype)


def attention_merge(out_a, lse_a, out_b, lse_b):
    """(out, lse) over the union of two disjoint key sets, in float64 and rounded once, as the
    CPU function computes it: weights exp(lse - max), rows that saw no key 0 and -inf."""
    for t, what in ((lse_a, "lse_a"), (lse_b, "lse_b")):
        if bool((torch.isnan(t) | (t == float("inf"))).any()):
            raise _posenc.InvalidValueError(f"attention_merge: {what} is NaN or +inf")
    la, lb = lse_a.double(), lse_b.double()
    m = torch.maximum(la, lb)
    empty = m == float("-inf")
    safe = torch.where(empty, torch.zeros_like(m), m)
    wa = torch.where(la == float("-inf"), torch.zeros_like(la), torch.exp(la - safe))
    wb = torch.where(lb == float("-inf"), torch.zeros_like(lb), torch.exp(lb - safe))
    total = torch.where(empty, torch.ones_like(m), wa + wb)
    inv = 1.0 / total
    wa4, wb4, inv4 = (w.transpose(1, 2).unsqueeze(-1) for w in (wa, wb, inv))
    out = (wa4 * out_a.double() + wb4 * out_b.double()) * inv4
    out = torch.where(empty.transpose(1, 2).unsqueeze(-1), torch.zeros_like(out), out)
    lse = torch.where(empty, m, safe + torch.log(total))
    return out.float(), lse.float()


def add_learned(x, table, positions, kw):
    """x + table[position] (float32), positions an int offset in kw or ids."""
    seq = x.shape[-2]
    ids = _ids(positions, kw.get("positions"), x.shape[0] if x.dim() == 3 else 1, seq)
    if ids.size and ids.max() >= table.shape[0]:
        raise _posenc.InvalidValueError(f"positions: {int(ids.max())} is outside the table of "
                                        f"{table.shape[0]} positions")
    rows = table[torch.from_numpy(ids).to(table.device)]  # [1 or batch, seq, dim]
    return x + (rows[0] if x.dim() == 2 else rows)


def learned_backward(dy, positions, max_positions, kw):
    """dtable [max_positions, dim]: the sum of dy at each position (float32, summed in
    float64)."""
    seq = dy.shape[-2]
    ids = _ids(positions, kw.get("positions"), dy.shape[0] if dy.dim() == 3 else 1, seq)
    ids = np.broadcast_to(ids, (dy.shape[0] if dy.dim() == 3 else 1, seq)).reshape(-1)
    grad = torch.zeros((max_positions, dy.shape[-1]), dtype=torch.float64, device=dy.device)
    grad.index_add_(0, torch.from_numpy(ids.copy()).to(dy.device),
                    dy.reshape(-1, dy.shape[-1]).double())
    return grad.float()


def sinusoidal_encode(positions, dim, kw):
    """The sinusoidal table at the positions (posenc.sinusoidal_encode on the host), float32 on
    positions' device."""
    ids = positions.detach().to("cpu", torch.int64).numpy().reshape(-1)
    pe = _posenc.sinusoidal_encode(ids, dim, **kw)
    return torch.from_numpy(pe).reshape(tuple(positions.shape) + (dim,)).to(positions.device)


def _sinusoidal64(ids, dim, kw):
    """The float64 table at the ids [n] (posenc.ref.sinusoidal_table, whose row r is the position
    origin + r): one table over the ids' span when it is short, else a row per distinct id."""
    lo, hi = int(ids.min()), int(ids.max())
    if hi - lo < (1 << 16):
        table = _posenc.ref.sinusoidal_table(hi - lo + 1, dim, **dict(kw, origin=lo))
        return table[ids - lo]
    distinct, where = np.unique(ids, return_inverse=True)
    rows = np.stack([_posenc.ref.sinusoidal_table(1, dim, **dict(kw, origin=int(u)))[0]
                     for u in distinct])
    return rows[where]


def add_sinusoidal(x, positions, kw):
    """x + PE[position], the sum formed in float64 and rounded once, as the CPU kernel does;
    positions an int offset in kw (from the config's origin by default) or ids."""
    kw = dict(kw)
    seq = x.shape[-2]
    offset = kw.pop("positions", None)
    if positions is None and offset is None:
        offset = kw.get("origin", 0)
    ids = _ids(positions, offset, x.shape[0] if x.dim() == 3 else 1, seq)
    if ids.size == 0:
        return x.clone()
    table = {n: v for n, v in kw.items() if n != "origin"}
    pe = _sinusoidal64(ids.reshape(-1), x.shape[-1], table).reshape(ids.shape + (x.shape[-1],))
    pe = torch.from_numpy(pe).to(x.device)
    return (x.double() + (pe[0] if x.dim() == 2 else pe)).to(x.dtype)


# ---- paged KV caches: rope_append --------------------------------------------------------------

_PAGE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_LAYOUTS = ("token_major", "head_major")
_MAX_OFFSET = 1 << 32  # the largest offset and rotary_dim the CPU binding takes
_MAX_THREADS = 1024  # posenc's kMaxThreads (num_threads means nothing here; checked alike)


def _shape_str(shape):
    return "[" + ", ".join(str(int(n)) for n in shape) + "]"


def _numpy_name(dtype):
    """A torch dtype as NumPy names it (the CPU binding's messages name NumPy dtypes)."""
    return str(dtype).replace("torch.", "")


def append_dtypes(k_new, v_new, k_pages, v_pages):
    """TypeError unless the pages are float32, bf16 or f16 (both of one dtype) and k_new, v_new
    share one dtype, float32 or the pages': the dtype rules of posenc::rope_append on every
    device (a float32 k_new with half v_new would have v_new's bits read as numbers)."""
    if k_pages.dtype not in _PAGE_DTYPES:
        raise TypeError(f"rope_append: k_pages must be torch.float32, torch.bfloat16 or "
                        f"torch.float16 (got {k_pages.dtype})")
    if v_pages is not None and v_pages.dtype != k_pages.dtype:
        raise TypeError(f"rope_append: k_pages and v_pages must share one dtype (got "
                        f"{k_pages.dtype} and {v_pages.dtype})")
    for t, what in ((k_new, "k_new"), (v_new, "v_new")):
        if t is not None and t.dtype not in (torch.float32, k_pages.dtype):
            raise TypeError(f"rope_append: {what} must be torch.float32 or the pages' dtype "
                            f"{k_pages.dtype} (got {t.dtype})")
    if v_new is not None and v_new.dtype != k_new.dtype:
        raise TypeError(f"rope_append: k_new and v_new must share one dtype (got {k_new.dtype} "
                        f"and {v_new.dtype})")


def _host_ints(t, what, ndim=None, int32=False):
    """An integer tensor (block_table, seq_lens, positions) as an int64 NumPy array on the host,
    checked as the CPU binding checks it: integers only (an empty float tensor passes), int32
    values for the tables, its number of dimensions."""
    if t.dtype == torch.bool or t.dtype.is_complex or (t.dtype.is_floating_point
                                                       and t.numel() > 0):
        raise TypeError(f"{what}: expected integers, got dtype {_numpy_name(t.dtype)}")
    a = t.detach().to("cpu", torch.int64).numpy()
    if int32 and a.size:
        lo, hi = int(a.min()), int(a.max())
        if lo < -(1 << 31) or hi > (1 << 31) - 1:
            raise _posenc.InvalidValueError(
                f"{what}: value {lo if lo < -(1 << 31) else hi} is out of range for int32 "
                f"[{-(1 << 31)}, {(1 << 31) - 1}]")
    if ndim is not None and a.ndim != ndim:
        raise _posenc.ShapeError(
            f"{what}: expected {ndim} " + ("dimensions [batch, max_pages]" if ndim == 2
                                           else "dimension [batch]") + f", got {a.ndim}")
    return a


def _append_positions(ids, start, lens, batch, n_new):
    """The key positions [1 or batch, n_new] of rope_append: the ids given (checked as the CPU
    kernel checks them, with its messages), an int offset start + i, else each token's slot."""
    what = "rope_append: positions"
    if start is not None:
        if n_new > 0 and start + n_new - 1 > _MAX_POSITION:
            raise _posenc.InvalidValueError(f"{what}: positions up to {start + n_new - 1} "
                                            f"exceed the maximum 2^48")
        return np.arange(start, start + n_new, dtype=np.int64)[None, :]
    if ids is None:
        return lens[:, None] - n_new + np.arange(n_new, dtype=np.int64)[None, :]
    if ids.ndim == 1 and ids.shape[0] != n_new:
        raise _posenc.ShapeError(f"{what}: {ids.shape[0]} position ids given for a sequence of "
                                 f"{n_new}")
    if ids.ndim == 2 and ids.shape != (batch, n_new):
        raise _posenc.ShapeError(f"{what}: position ids of shape {_shape_str(ids.shape)} given "
                                 f"for [batch, seq] = [{batch}, {n_new}]")
    flat = ids.reshape(-1)
    bad = np.flatnonzero((flat < 0) | (flat > _MAX_POSITION))
    if bad.size:
        i = int(bad[0])
        raise _posenc.InvalidValueError(f"{what}: position id {int(flat[i])} at index {i} is "
                                        f"outside [0, 2^48]")
    return ids if ids.ndim == 2 else ids[None, :]


def rope_append(k_new, v_new, k_pages, v_pages, block_table, seq_lens, positions, kw):
    """posenc::rope_append on the pages' device, in place: token i of row b (k_new, v_new
    [batch, n_new, heads_kv, head_dim]) goes to cache index j = seq_lens[b] - n_new + i (page
    block_table[b][j // page_size], slot j % page_size), its key rotated at position j (or
    positions[b][i], or the int offset kw["positions"] + i) by kw's RoPE keywords (freqs,
    style, rotary_dim, base, scaling, seq_len (default max(seq_lens)), angles, config; dims
    [offset, offset + rotary_dim)) and its value copied. As the CPU kernel computes it: the key
    rotated in float64 and rounded to float32 (the CPU kernel's float32 rotation, to the last
    bit), then to the pages' dtype; the value rounded once from float32. Both page layouts
    (kw["layout"]). Everything is checked first, with the CPU op's messages, so a refused call
    writes nothing; only block_table, seq_lens and positions are read on the host."""
    fn = "rope_append"
    layout = kw.get("layout", "token_major")
    if layout not in _LAYOUTS:
        raise _posenc.InvalidValueError(f"layout: unknown page layout '{layout}' (token_major, "
                                        f"head_major)")
    # The scalar keywords' ranges, as the CPU binding checks them before anything else.
    for name, top in (("rotary_dim", _MAX_OFFSET), ("seq_len", _MAX_POSITION),
                      ("offset", _MAX_OFFSET), ("num_threads", _MAX_THREADS)):
        if kw.get(name) is not None and not 0 <= int(kw[name]) <= top:
            raise _posenc.InvalidValueError(f"{name}: {int(kw[name])} is outside [0, {top}]")
    base = kw.get("base")
    if base is not None:
        if not math.isfinite(base):
            raise _posenc.InvalidValueError(f"base: must be finite (got {base!r})")
        if not base > 0:
            raise _posenc.InvalidValueError(f"base: must be > 0 (got {base!r})")
    offset = int(kw.get("offset", 0))
    start = kw.get("positions")
    if start is not None:
        start = int(start)
        if not 0 <= start <= _MAX_POSITION:
            raise _posenc.InvalidValueError(f"positions: {start} is outside [0, "
                                            f"{_MAX_POSITION}]")
        if positions is not None:
            raise ValueError("positions, positions_offset: give the ids or the offset, not both")
    if (v_new is None) != (v_pages is None):
        raise TypeError("rope_append(): give both v_new and v_pages, or neither")
    append_dtypes(k_new, v_new, k_pages, v_pages)
    device = k_pages.device
    for t, what in ((k_new, "k_new"), (v_new, "v_new"), (v_pages, "v_pages")):
        if t is not None and t.device != device:
            raise ValueError(f"posenc: {what} is on device '{t.device}', k_pages on '{device}'; "
                             "the tensors of one call share its device")
    token = layout == "token_major"
    want = ("[num_pages, page_size, heads_kv, head_dim] (layout='token_major')" if token
            else "[num_pages, heads_kv, page_size, head_dim] (layout='head_major')")
    pools = ((k_pages, "k_pages"),) + (() if v_pages is None else ((v_pages, "v_pages"),))
    for t, what in pools:
        if t.dim() != 4:
            raise _posenc.ShapeError(f"{what}: expected 4 dimensions {want}, got {t.dim()}")
    for t, what in pools:
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            raise ValueError(f"{what}: rope_append writes in place: the last dimension must be "
                             "contiguous")
    table = _host_ints(block_table, "block_table", 2, int32=True)
    lens = _host_ints(seq_lens, "seq_lens", 1, int32=True)
    if k_new.dim() != 4:
        raise _posenc.ShapeError(f"k_new: expected 4 dimensions [batch, n_new, heads_kv, "
                                 f"head_dim], got {k_new.dim()}")
    ids = None
    if positions is not None:
        ids = _host_ints(positions, "positions")
        if ids.ndim not in (1, 2):
            raise _posenc.ShapeError(f"positions: positions must be [seq] or [batch, seq], got "
                                     f"{ids.ndim} dimensions")
    # RoPE's settings as the CPU op reads them (length-dependent scalings at the longest row).
    config, freqs = kw.get("config"), kw.get("freqs")
    head_dim = k_new.shape[-1]
    if freqs is None:
        seq_len = kw.get("seq_len")
        if seq_len is None:
            seq_len = max(int(lens.max()) if lens.size else 0, 1)
        common = {"seq_len": seq_len, "angles": kw.get("angles", "accurate")}
        if config is not None:
            freqs = _posenc.rope_frequencies(config=config, **common)
        else:
            own = {n: kw[n] for n in ("rotary_dim", "base", "scaling") if n in kw}
            freqs = _posenc.rope_frequencies(head_dim, **own, **common)
    style = kw.get("style") or (config.rope["style"] if config is not None else "half")
    if style not in ("half", "interleaved"):
        raise _posenc.InvalidValueError(f"style: '{style}' (half or interleaved)")

    # The kernel's checks, on the pools as token-major shapes (the CPU binding hands the kernel
    # the token-major view of a head-major pool).
    def tok(t):
        s = tuple(t.shape)
        return s if token else (s[0], s[2], s[1], s[3])

    num_pages, page_size, heads_kv, dim = tok(k_pages)
    if page_size < 1 or heads_kv < 1 or dim < 1:
        raise _posenc.ShapeError(f"{fn}: k_pages {_shape_str(tok(k_pages))} must be [num_pages, "
                                 f"page_size, heads_kv, head_dim] (token_major) with page_size, "
                                 f"heads_kv and head_dim >= 1")
    batch, n_new = k_new.shape[0], k_new.shape[1]
    if k_new.shape[2] != heads_kv or k_new.shape[3] != dim:
        raise _posenc.ShapeError(f"{fn}: k_new {_shape_str(k_new.shape)} must be [batch, n_new, "
                                 f"heads_kv, head_dim] with the heads and head_dim of k_pages "
                                 f"{_shape_str(tok(k_pages))}")
    if v_new is not None:
        if v_new.shape != k_new.shape:
            raise _posenc.ShapeError(f"{fn}: v_new {_shape_str(v_new.shape)} must have k_new's "
                                     f"shape {_shape_str(k_new.shape)}")
        if tok(v_pages) != tok(k_pages):
            raise _posenc.ShapeError(f"{fn}: v_pages {_shape_str(tok(v_pages))} must have "
                                     f"k_pages' shape {_shape_str(tok(k_pages))}")
    rot = int(freqs.rotary_dim)
    if offset + rot > dim:
        raise _posenc.ShapeError(f"{fn}: rope offset ({offset}) + rotary_dim ({rot}) exceeds "
                                 f"head_dim ({dim})")
    if table.shape[0] != batch:
        raise _posenc.ShapeError(f"{fn}: block_table {_shape_str(table.shape)} must be [batch, "
                                 f"max_pages] with batch {batch}")
    if lens.shape[0] != batch:
        raise _posenc.ShapeError(f"{fn}: seq_lens {_shape_str(lens.shape)} must be [batch] with "
                                 f"batch {batch}")
    max_pages = table.shape[1]
    cap = max_pages * page_size
    for b in range(batch):
        n = int(lens[b])
        if n < 0:
            raise _posenc.InvalidValueError(f"{fn}: seq_lens[{b}] = {n} is negative")
        if n > cap:
            raise _posenc.InvalidValueError(f"{fn}: seq_lens[{b}] = {n} exceeds max_pages * "
                                            f"page_size = {max_pages} * {page_size} = {cap}")
        if n < n_new:
            raise _posenc.InvalidValueError(f"{fn}: seq_lens[{b}] = {n} is less than the number "
                                            f"of new tokens ({n_new}): seq_lens counts them")
        used = table[b, :(n + page_size - 1) // page_size]
        bad = np.flatnonzero((used < 0) | (used >= num_pages))
        if bad.size:
            p = int(bad[0])
            raise _posenc.InvalidValueError(f"{fn}: block_table[{b}][{p}] = {int(used[p])} is "
                                            f"outside [0, num_pages = {num_pages})")
    key_ids = _append_positions(ids, start, lens, batch, n_new)
    if batch == 0 or n_new == 0:
        return

    # The slots of the new tokens, on the host (small), then one indexed write per pool.
    j = lens[:, None] - n_new + np.arange(n_new, dtype=np.int64)[None, :]  # [batch, n_new]
    pages = np.take_along_axis(table, j // page_size, axis=1).reshape(-1)
    slots = (j % page_size).reshape(-1)
    pages, slots = (torch.from_numpy(np.ascontiguousarray(a)).to(device) for a in (pages, slots))
    with torch.no_grad():
        keys = k_new.detach()
        if rot > 0:
            # The CPU kernel rotates the widened keys with apply_rope's float32 kernel (float64
            # arithmetic, rounded once to float32), then rounds that to the pages' type.
            turned = _rotate(keys[..., offset:], key_ids, freqs, style, False)
            keys = torch.cat((keys[..., :offset].to(turned.dtype), turned), dim=-1)
        keys = keys.to(torch.float32).to(k_pages.dtype).reshape(-1, heads_kv, dim)
        writes = [(k_pages, keys)]
        if v_new is not None:
            writes.append((v_pages, v_new.detach().to(v_pages.dtype).reshape(-1, heads_kv, dim)))
        for pool, rows in writes:
            pool = pool.detach()
            if token:
                pool[pages, slots] = rows
            else:
                pool[pages, :, slots] = rows
