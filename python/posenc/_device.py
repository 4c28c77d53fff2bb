"""The elementwise ops on tensors of other devices (CUDA): RoPE (``posenc::rope``,
``posenc::rope_half`` and their gradients) and the absolute encodings (``posenc::add_learned``,
``learned_backward``, ``add_sinusoidal``, ``sinusoidal_encode``).

The same numbers as posenc's CPU kernels, by the same recipe: what depends only on the positions
(RoPE's angles, the sinusoidal table) is computed by posenc on the host in float64, from the
positions the call gives, and moved to the tensor's device; the rest is PyTorch operations there.
Accurate RoPE rotates in float64 and rounds once, as the CPU kernel does, so the results agree to
the last bit (float32 angles: the frameworks' float32 recipe, whose cos and sin are the device's).
The ops call these for a tensor that is not on the CPU; the tests call them on CPU tensors and
compare them with the CPU kernels.
"""

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


def rope(x, positions, kw):
    """RoPE of x by posenc.apply_rope's keywords `kw` (freqs, style, rotary_dim, base, scaling,
    seq_len, angles, config, inverse, positions: an int offset)."""
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
    return _rotate(x, ids, freqs, style, bool(kw.get("inverse"))).to(x.dtype)


def _rotate(x, ids, freqs, style, inverse, wide=None):
    """x rotated at the ids by freqs (`wide`: x already widened to the computing dtype), in the
    computing dtype (float64 for accurate angles, float32 for float32 ones), not rounded."""
    rotary = int(freqs.rotary_dim)
    if rotary > x.shape[-1]:
        raise _posenc.ShapeError(f"x: head_dim {x.shape[-1]} is smaller than the rotary dim "
                                 f"{rotary}")
    inv = np.asarray(freqs.inv_freq, dtype=np.float64)
    sign = -1.0 if inverse else 1.0
    if freqs.angles == "float32":
        # The frameworks' recipe: float32 angles, cos and sin, rotation in float32.
        compute = torch.float32
        angle = (torch.from_numpy(ids.astype(np.float32))[..., None]
                 * torch.from_numpy(inv.astype(np.float32))).to(x.device)
        cos, sin = torch.cos(angle), torch.sin(angle)
        factor = torch.tensor(freqs.attention_factor, dtype=torch.float32)
        cos, sin = cos * factor.to(x.device), sin * factor.to(x.device)
    else:
        compute = torch.float64
        angle = ids.astype(np.float64)[..., None] * inv
        cos = torch.from_numpy(np.cos(angle) * freqs.attention_factor).to(x.device)
        sin = torch.from_numpy(np.sin(angle) * freqs.attention_factor).to(x.device)
    cos, sin = cos[:, :, None, :], sign * sin[:, :, None, :]  # [1 or batch, seq, 1, R/2]
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
