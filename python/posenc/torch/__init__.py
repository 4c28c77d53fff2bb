"""posenc.torch: PyTorch operators, functions and modules over posenc's kernels (CPU tensors).

``attention(q, k, v, scheme=..., **kwargs)`` takes the keywords of ``posenc.attention``; the
forward runs the fused kernel and keeps its per-row log-sum-exp, the backward runs the fused
backward (FlashAttention-2 recomputation), giving gradients for q, k, v and every parameter table
passed in ``params`` (tensors with requires_grad). float64 tensors run the float64 reference
end to end, so ``torch.autograd.gradcheck`` applies to every scheme. ``rope(x, ...)`` is RoPE
with its exact transpose as backward; ``rerotate_rope``, ``attention_merge``, ``add_learned``
and ``add_sinusoidal`` are differentiable too.

Every function calls a ``torch.library`` custom operator (``torch.ops.posenc.*``, defined in
posenc._ops) with a shape function and its gradient, so ``torch.compile(fullgraph=True)`` and
``torch.export`` keep posenc calls in their graphs. A tensor on another device raises
ValueError naming it (posenc has no GPU path).

Half precision: torch.bfloat16 / torch.float16 tensors give results of their dtype. Without
gradients they run the native half kernels on the tensors' memory (float32 q with a half k, v:
the mixed kernel, float32 out); with gradients the float32 path runs on the widened tensors and
the output is cast to q's dtype (autograd casts the gradients back). Either way the result is
the float32 result of the widened inputs rounded once.

Layout: q [batch, seq_q, heads_q, head_dim], k and v [batch, seq_k, heads_kv, head_dim]; any
strides whose last dimension is contiguous are used without a copy (so ``x.transpose(1, 2)`` of
a [batch, heads, seq, head_dim] tensor works as is).

Modules own their learnable tables and can be made from a model's config.json:
SinusoidalPositions, LearnedPositions, Rope, Alibi, T5RelativeBias, ShawRelative, XLRelative,
DebertaRelative, and PositionalAttention(scheme, heads, kv_heads, head_dim, ...), which a
transformer layer calls in place of softmax(QK^T)V.
"""

import math

import numpy as np
import torch
from torch import nn

from .. import _ops, _posenc
from ._keywords import MASK_KEYWORDS as _MASK_KEYWORDS

__all__ = [
    "attention", "attention_paged", "rope_append", "rope", "apply_rope", "rerotate_rope",
    "attention_merge", "add_learned",
    "add_sinusoidal", "SinusoidalPositions", "LearnedPositions", "Rope", "Alibi",
    "T5RelativeBias", "ShawRelative", "XLRelative", "DebertaRelative", "NoPositions",
    "PositionalAttention",
]

# Submodules loaded on first use: posenc.torch.flex (FlexAttention) and posenc.torch.distributed
# (context parallelism).
_LAZY_SUBMODULES = ("flex", "distributed")


def __getattr__(name):
    if name in _LAZY_SUBMODULES:
        import importlib
        return importlib.import_module("." + name, __name__)
    raise AttributeError(f"module 'posenc.torch' has no attribute {name!r}")


_HALF = _ops._HALF
_require_cpu = _ops.require_cpu


def _widen(t):
    """A half tensor as float32 (differentiable; others unchanged): NumPy has no bfloat16."""
    return t.float() if t.dtype in _HALF else t


def _require_on(t, what, device=None):
    """ValueError unless the tensor t is on `device` (None: the CPU, where posenc's own kernels
    run)."""
    if device is None:
        _require_cpu(t, what)
    elif isinstance(t, torch.Tensor) and t.device != device:
        raise ValueError(f"posenc: {what} is on device '{t.device}', q on '{device}'; the "
                         "tensors of one call share its device")


def _device_of(x):
    """The device other tensors of an elementwise call must share: None for a CPU x (the CPU
    kernels' rule), else x's (CUDA: posenc._device's forms)."""
    return None if x.device.type == "cpu" else x.device


def _on_call_device(value, what, device):
    """An index tensor (positions, documents, prefix lengths, a dense mask, cu_seqlens) of a call
    on `device`: a CPU tensor of a CUDA call is moved there (it describes the call, and callers
    such as transformers' masks build it on the CPU); a tensor on a third device is refused."""
    if device is not None and value.device.type == "cpu":
        return value.to(device)
    _require_on(value, what, device)
    return value


def _tensor_arg(value, what, device=None):
    """A positions argument: a tensor (an int64 tensor on the call's device for the op), or None /
    an int (an int offset: a keyword argument of the op)."""
    if value is None or isinstance(value, (int, np.integer)):
        return None
    if isinstance(value, torch.Tensor):
        return _on_call_device(value, what, device)
    t = _as_tensor(value, what)
    return t if device is None else t.to(device)


def _as_tensor(value, what):
    """A NumPy array (or anything NumPy converts) as a tensor holding the same values: one
    contiguous copy, so that negative strides and read-only (broadcast) arrays are taken too."""
    try:
        return torch.from_numpy(np.array(value, copy=True, order="C"))
    except (TypeError, ValueError) as e:
        raise TypeError(f"{what}: expected an array of numbers ({e})") from None


def _int_tensor(value, what, device=None):
    """An integer argument (block_table, seq_lens) as an integer tensor, values unchanged: the
    bindings check that each fits (a cast here would truncate floats and wrap large values).
    device: the call's CUDA device (the tensor may be there or on the CPU), None: the CPU."""
    if isinstance(value, torch.Tensor):
        if device is None or value.device.type != "cpu":
            _require_on(value, what, device)
        t = value
    else:
        try:
            t = _as_tensor(value, what)
        except (TypeError, ValueError) as e:
            raise TypeError(f"{what}: expected an integer tensor ({e})") from None
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise TypeError(f"{what}: expected an integer tensor, got {t.dtype}")
    return t


def _real_tensors(*named):
    """TypeError unless each tensor is a real floating-point tensor (a complex q would lose its
    imaginary part in a cast, an integer one be rounded)."""
    for t, what in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{what}: expected a floating-point tensor, got {t.dtype}")


def _split_positions(kwargs, *names, device=None):
    """Moves tensor-valued positions out of kwargs: (kwargs without them, [tensor or None])."""
    kw = dict(kwargs)
    tensors = []
    for n in names:
        t = _tensor_arg(kw.get(n), n, device)
        if t is not None:
            del kw[n]
        tensors.append(t)
    return kw, tensors


def _split_masks(kw, device=None):
    """Moves the mask keywords' values out of kw: {name: tensor} (the ops' mask arguments)."""
    masks = {}
    for n in _MASK_KEYWORDS:
        value = kw.pop(n, None)
        if value is None:
            continue
        if isinstance(value, torch.Tensor):
            value = _on_call_device(value, n, device)
        else:
            value = _as_tensor(value, n)
            value = value if device is None else value.to(device)
        masks[n] = value
    return masks


def _split_params(params):
    """params dict -> (names, tensors) in a fixed order."""
    if params is None:
        return (), ()
    if isinstance(params, dict):
        names = tuple(sorted(params))
        tensors = tuple(params[n] if isinstance(params[n], torch.Tensor)
                        else _as_tensor(params[n], n) for n in names)
        return names, tensors
    raise TypeError("params: a dict {name: tensor}")


def _prepared(kwargs, scheme=None, params=None, base=None, device=None):
    """An attention call's arguments as its op takes them: (table_names, tables, query
    positions, key positions, {mask name: tensor}, typed settings). base: typed settings made
    earlier (a module's, outside any compiled region) that kwargs extend or override. device: the
    call's device (None: the CPU kernels')."""
    kw, (qpos, kpos) = _split_positions(kwargs, "query_positions", "key_positions",
                                        device=device)
    masks = _split_masks(kw, device)
    if scheme is not None:
        kw["scheme"] = scheme
    names, tables = _split_params(params)
    for n, t in zip(names, tables):
        _require_on(t, n, device)
        if t.is_complex():  # a cast to a real dtype would drop the imaginary part
            raise TypeError(f"{n}: expected a real tensor, got {t.dtype}")
    settings = _ops.typed("attention", kw, "attention")
    if base:
        settings = {**base, **settings}
    return list(names), list(tables), qpos, kpos, masks, settings


def attention(q, k, v, scheme=None, *, params=None, return_lse=False, _base_args=None, **kwargs):
    """Attention with a positional scheme, differentiable (see posenc.attention for keywords).

    params: {name: tensor} (docs/attention.md, Parameter names); tables with requires_grad get
    gradients. Returns out [batch, seq_q, heads_q, v_dim] (and lse [batch, heads_q, seq_q],
    float32, not differentiable, with return_lse=True). q's dtype decides: float32 runs the fused
    kernels, float64 the float64 reference. Tensors must be on the CPU or, for the Triton
    kernels (backend, below), on one CUDA device (another device raises ValueError naming it).
    The op is torch.ops.posenc.attention (torch.compile keeps it in the graph; its backward is
    torch.ops.posenc.attention_backward).

    Half precision: a torch.bfloat16 / torch.float16 q gives out of q's dtype (lse float32), the
    float32 result of the widened inputs rounded once. Without gradients, q, k, v of one half
    dtype run the native half kernel on their memory (no copies, torch.ops.posenc.attention_half),
    and a float32 q with half k, v the mixed kernel (float32 out); with gradients (or return_lse)
    the inputs are widened to float32 (differentiably), the float32 path runs and out is cast to
    q's dtype, so gradients come back in each input's dtype. Tables may be half too (widened).

    backend: which kernels run: "auto" (default: posenc's CPU kernels on CPU tensors,
    posenc.triton's fused Triton kernels on CUDA tensors), "cpu", "triton" (CUDA tensors; CPU
    tensors under TRITON_INTERPRET=1, through Triton's interpreter) or "flex"
    (posenc.torch.flex.attention: PyTorch's FlexAttention on the tensors' device, the same
    keywords). The Triton kernels take q, k, v of one dtype (float32, float16, bfloat16; out of
    that dtype, lse float32), every scheme, model configs, packed sequences and block masks;
    what they lack (Llama 4's query temperature, DeepSeek's RoPE offset) is a ValueError naming
    it. FlexAttention cannot express Transformer-XL or Shaw's rel_v (UnsupportedScheme) nor
    take a model config.

    Packed sequences: q [total_q, heads_q, D], k and v [total_k, heads_kv, D] with cu_seqlens_q
    and cu_seqlens_k (int tensors [num_seqs + 1]) give out [total_q, heads_q, v_dim] and lse
    [heads_q, total_q]; positions restart in each sequence. Block masks: query_documents,
    key_documents, prefix, global_positions, mask (see posenc.attention). Mask tensors travel to
    the op as its arguments of those names (no gradient).
    """
    for bad in ("out", "lse"):
        if bad in kwargs:
            raise TypeError(f"attention() got an unexpected keyword argument '{bad}'")
    if not isinstance(q, torch.Tensor):
        raise TypeError("q: a torch.Tensor (use posenc.attention for NumPy arrays)")
    _real_tensors((q, "q"), (k, "k"), (v, "v"))
    backend = kwargs.get("backend", (_base_args or {}).get("backend", "auto"))
    if not isinstance(backend, str):
        raise TypeError(f"backend: expected a string, got {type(backend).__name__}")
    if backend == "flex":
        if _base_args:
            raise ValueError("backend='flex': call posenc.torch.attention with the scheme's "
                             "keywords (a module passes them itself)")
        return _flex_attention(q, k, v, scheme, params, return_lse, kwargs)
    if _ops.uses_triton(q, backend):
        return _attention_triton(q, k, v, scheme, params, return_lse, _base_args, kwargs)
    for t, what in ((q, "q"), (k, "k"), (v, "v")):
        _require_cpu(t, what)
    names, tables, qpos, kpos, masks, settings = _prepared(kwargs, scheme, params, _base_args)
    tables = [_widen(t) for t in tables]
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                        or any(t.requires_grad for t in tables))
    half_q = q.dtype in _HALF
    if (not grad and not return_lse and k.dtype in _HALF and v.dtype == k.dtype
            and q.dtype in (k.dtype, torch.float32)):
        tables = [t.float() if t.dtype != torch.float32 else t for t in tables]
        return _ops.call_attention_half(q, k, v, tables, names, qpos, kpos, masks, settings)
    out_dtype = q.dtype
    dtype = q.dtype if q.dtype in (torch.float32, torch.float64) else torch.float32
    q, k, v = (x if x.dtype == dtype else x.to(dtype) for x in (q, k, v))
    tables = [t if t.dtype == dtype else t.to(dtype) for t in tables]
    out, lse = _ops.call_attention(q, k, v, tables, names, qpos, kpos, masks, settings)
    if half_q:
        out = out.to(out_dtype)  # rounded once (autograd casts the gradient back to float32)
    lse = lse.detach()
    return (out, lse) if return_lse else out


def _flex_attention(q, k, v, scheme, params, return_lse, kwargs):
    """posenc.torch.attention with backend="flex": posenc.torch.flex.attention (FlexAttention,
    on the tensors' device) with the same keywords; what it cannot compute (Transformer-XL,
    Shaw's rel_v, a model config) is refused by name."""
    from . import flex
    kw = {n: x for n, x in kwargs.items() if n != "backend"}
    for name in ("config", "layer"):
        if kw.pop(name, None) is not None:  # None: not given, as the other backends take it
            raise ValueError(f"backend='flex': '{name}' is not taken by posenc.torch.flex (give "
                             "the scheme's settings, or use backend='cpu' / 'triton')")
    # The scheme settings' types, as posenc's ops check them (TypeError naming the keyword): a
    # string where a bool is expected must not become True.
    owned = {n for names in flex._SETTINGS.values() for n in names}
    _ops.typed("attention", {n: x for n, x in kw.items() if n in owned}, "attention")
    if isinstance(params, dict):  # flex moves tables to q's device; a meta tensor has no data
        for name, t in params.items():
            if isinstance(t, torch.Tensor) and t.is_meta:
                raise ValueError(f"{name}: on device 'meta' (no data), q on '{q.device}'")
    return flex.attention(q, k, v, scheme, params=params, return_lse=return_lse, **kw)


def _attention_triton(q, k, v, scheme, params, return_lse, base, kwargs):
    """posenc.torch.attention on posenc.triton's kernels (backend "triton", or "auto" on CUDA
    tensors): q, k, v of one dtype (float32, float16 or bfloat16) on one device, out of that
    dtype, lse float32."""
    for t, what in ((k, "k"), (v, "v")):
        _require_on(t, what, q.device)
        if t.dtype != q.dtype:
            raise TypeError(f"{what}: the Triton kernels take q, k and v of one dtype (q "
                            f"{q.dtype}, {what} {t.dtype})")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"q: the Triton kernels take float32, float16 or bfloat16 (got "
                        f"{q.dtype}; backend='cpu' computes float64)")
    names, tables, qpos, kpos, masks, settings = _prepared(kwargs, scheme, params, base,
                                                           device=q.device)
    out, lse = _ops.call_attention(q, k, v, tables, names, qpos, kpos, masks, settings)
    out = out.to(q.dtype)  # the kernels' float32 out of half inputs, rounded once
    lse = lse.detach()
    return (out, lse) if return_lse else out


def attention_paged(q, k_pages, v_pages, block_table, seq_lens, scheme=None, *, params=None,
                    **kwargs):
    """Attention over a paged KV cache (see posenc.attention_paged for the layouts, the keywords
    and the semantics), on the tensors' memory: torch.ops.posenc.attention_paged. Pages float32
    (q float32), or bf16 / f16 (q of their dtype, out too, or float32 q and out). No gradient
    (a cache is inference state). block_table [batch, max_pages], seq_lens [batch]: integer
    tensors."""
    for bad in ("out", "lse", "return_lse", "key_positions", "dtype"):
        if bad in kwargs:
            raise TypeError(f"attention_paged() got an unexpected keyword argument '{bad}'")
    for t, what in ((q, "q"), (k_pages, "k_pages"), (v_pages, "v_pages")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: a torch.Tensor (use posenc.attention_paged for NumPy)")
    # CUDA tensors: the Triton forward kernel reads the pages in place through the block table.
    device = q.device if q.device.type == "cuda" else None
    for t, what in ((q, "q"), (k_pages, "k_pages"), (v_pages, "v_pages")):
        _require_on(t, what, device)
    kw, (qpos,) = _split_positions(kwargs, "query_positions", device=device)
    if scheme is not None:
        kw["scheme"] = scheme
    names, tables = _split_params(params)
    settings = _ops.typed("attention_paged", kw, "attention_paged")
    tables = [t.float() if t.dtype != torch.float32 else t for t in tables]
    for n, t in zip(names, tables):
        _require_on(t, n, device)
    table = _int_tensor(block_table, "block_table", device)
    lens = _int_tensor(seq_lens, "seq_lens", device)
    return _ops.call_attention_paged(q, k_pages, v_pages, table, lens, tables, list(names), qpos,
                                     settings)


def rope_append(k_new, k_pages, block_table, seq_lens, *, v_new=None, v_pages=None,
                positions=None, **kwargs):
    """Writes new keys, rotated by RoPE, and their values into their page slots, in place (see
    posenc.rope_append): torch.ops.posenc.rope_append, which mutates k_pages and v_pages.
    Pages float32, bf16 or f16; k_new, v_new float32 or the pages' dtype. Returns None. CUDA
    pages: every tensor on their device (block_table, seq_lens and positions may stay on the
    CPU), written by posenc._device's form, bit for bit what the CPU kernel writes."""
    for t, what in ((k_new, "k_new"), (k_pages, "k_pages")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: a torch.Tensor (use posenc.rope_append for NumPy)")
    device = k_pages.device if k_pages.device.type == "cuda" else None
    for t, what in ((k_new, "k_new"), (k_pages, "k_pages"), (v_new, "v_new"),
                    (v_pages, "v_pages")):
        if t is not None:
            _require_on(t, what, device)
    kw, (pos,) = _split_positions({**kwargs, "positions": positions}, "positions",
                                  device=device)
    settings = _ops.typed("rope_append", kw, "rope_append")
    table = _int_tensor(block_table, "block_table", device)
    lens = _int_tensor(seq_lens, "seq_lens", device)
    _ops.call_rope_append(k_new, v_new, k_pages, v_pages, table, lens, pos, settings)


def rope(x, freqs=None, *, _base_args=None, **kwargs):
    """RoPE of x [batch, seq, heads, head_dim] (or [seq, heads, head_dim]), differentiable: the
    keywords of posenc.apply_rope (style, positions, inverse, rotary_dim, base, scaling, seq_len,
    angles, config). The backward is the inverse rotation (its exact transpose). float32 runs
    the SIMD kernel, float64 the reference (torch.ops.posenc.rope).

    Half precision: a torch.bfloat16 / torch.float16 x gives a result of x's dtype, the float32
    rotation of the widened x rounded once; without gradients by the native half kernel on x's
    memory (torch.ops.posenc.rope_half), with gradients through the float32 path on the widened
    x, cast back (the gradient comes back in x's dtype)."""
    for bad in ("inplace", "out"):
        if bad in kwargs:
            raise TypeError(f"rope() got an unexpected keyword argument '{bad}'")
    _ops.require_device(x, "x")
    kw, (positions,) = _split_positions(kwargs, "positions", device=_device_of(x))
    if freqs is not None:
        kw["freqs"] = freqs
    settings = _ops.typed("rope", kw, "rope")
    if _base_args:
        settings = {**_base_args, **settings}
    if x.dtype in _HALF:
        if not (torch.is_grad_enabled() and x.requires_grad):
            return _ops.call_rope_half(x, positions, settings)
        return _ops.call_rope(x.float(), positions, settings).to(x.dtype)
    if x.dtype not in (torch.float32, torch.float64):
        x = x.float()
    return _ops.call_rope(x, positions, settings)


apply_rope = rope


def rerotate_rope(k, from_freqs, to_freqs, *, style="half", positions=None):
    """Keys cached as rope(k, p; from_freqs) moved to rope(k, p; to_freqs) exactly (dynamic NTK
    growth, LongRoPE crossing its original length), differentiable (the gradient rotates back).
    k [batch, seq, heads, head_dim]: float32 (the CPU kernel, or its CUDA form), float64 (both
    rotations in float64), others through float32 (torch.ops.posenc.rerotate_rope)."""
    _ops.require_device(k, "k")
    kw, (pos,) = _split_positions({"positions": positions}, "positions", device=_device_of(k))
    kw.update(from_freqs=from_freqs, to_freqs=to_freqs, style=style)
    settings = _ops.typed("rerotate_rope", kw, "rerotate_rope")
    if k.dtype not in (torch.float32, torch.float64):
        return _ops.rerotate_rope(k.float(), pos, **settings).to(k.dtype)
    return _ops.rerotate_rope(k, pos, **settings)


def attention_merge(out_a, lse_a, out_b, lse_b):
    """(out, lse): the attention over the union of two disjoint key sets from two partial
    attentions over them (out [batch, seq_q, heads, v_dim], lse [batch, heads, seq_q] as
    attention(..., return_lse=True) gives them), differentiable in all four (float32;
    torch.ops.posenc.attention_merge)."""
    _ops.require_device(out_a, "out_a")
    for t, what in ((lse_a, "lse_a"), (out_b, "out_b"), (lse_b, "lse_b")):
        _require_on(t, what, _device_of(out_a))
    return _ops.attention_merge(out_a.float(), lse_a.float(), out_b.float(), lse_b.float())


def add_learned(x, table, positions=None):
    """x + table[position] (learned absolute positions), differentiable in x and table; x
    [batch, seq, dim] or [seq, dim], table [max_positions, dim]; positions None (0, 1, ...), an
    int offset, or ids [seq] / [batch, seq]. A position outside the table raises ValueError (a
    learned table cannot extrapolate). Computed in float32, returned in x's dtype
    (torch.ops.posenc.add_learned)."""
    _ops.require_device(x, "x")
    _require_on(table, "table", _device_of(x))
    kw, (pos,) = _split_positions({"positions": positions}, "positions", device=_device_of(x))
    y = _ops.add_learned(x.float(), table.float(), pos, **_ops.typed("add_learned", kw,
                                                                     "add_learned"))
    return y.to(x.dtype)


def add_sinusoidal(x, positions=None, *, base=1e4, layout="interleaved", denominator="dim",
                   origin=0, odd_dim="error"):
    """x + PE[position] (fixed sinusoidal positions), differentiable in x; the table's settings as
    posenc.add_sinusoidal. float32 x: one fused pass (torch.ops.posenc.add_sinusoidal); other
    dtypes add the float32 table (torch.ops.posenc.sinusoidal_encode) in x's dtype."""
    _ops.require_device(x, "x")
    cfg = dict(base=base, layout=layout, denominator=denominator, origin=origin, odd_dim=odd_dim)
    kw, (pos,) = _split_positions({"positions": positions}, "positions", device=_device_of(x))
    if x.dtype == torch.float32:
        return _ops.add_sinusoidal(x, pos, **_ops.typed("add_sinusoidal", {**cfg, **kw},
                                                        "add_sinusoidal"))
    if pos is None:
        start = origin if positions is None else int(positions)
        pos = torch.arange(start, start + x.shape[-2], dtype=torch.int64, device=x.device)
    pe = _ops.sinusoidal_encode(pos.to(torch.int64), x.shape[-1],
                                **_ops.typed("sinusoidal_encode", cfg, "add_sinusoidal"))
    return x + pe.to(x.dtype)


# ---- modules ----------------------------------------------------------------------------------

def _config(config):
    return None if config is None else _posenc.read_model_config(config)


class _Scheme(nn.Module):
    """A positional scheme for attention: its settings and its (learnable) tables."""

    scheme = "none"
    _table_names = ()

    def __init__(self):
        super().__init__()
        self._settings = {}

    # The settings and, made when they are set, the typed op arguments they give
    # (posenc._ops.typed): the forward passes those, so a compiled graph holds the settings as
    # constants and no setting is converted inside it.
    @property
    def _settings(self):
        return self.__dict__["_settings_dict"]

    @_settings.setter
    def _settings(self, value):
        self.__dict__["_settings_dict"] = dict(value)
        self.__dict__["_settings_args"] = _ops.typed("attention", self.settings(),
                                                     type(self).__name__)

    def settings(self):
        """Keyword arguments for posenc attention (scheme settings, not tables)."""
        return dict(self._settings)

    def tables(self):
        """The parameter tables by name (docs/attention.md, Parameter names)."""
        return {n: getattr(self, n) for n in self._table_names if getattr(self, n) is not None}

    def forward(self, q, k, v, *, params=None, **kwargs):
        """attention(q, k, v) with this scheme; kwargs: causal, scale, window, chunk, positions,
        ...; params: extra tensors by name (e.g. sinks) beside the scheme's tables."""
        tables = self.tables()
        tables.update(params or {})
        if kwargs.get("backend") == "flex":  # FlexAttention takes the settings as keywords
            return _flex_attention(q, k, v, self.scheme, tables or None, False,
                                   {**self.settings(), **kwargs})
        return attention(q, k, v, self.scheme, params=tables or None,
                         _base_args=self.__dict__["_settings_args"], **kwargs)

    def extra_repr(self):
        return ", ".join(f"{k}={v!r}" for k, v in self._settings.items())


class NoPositions(_Scheme):
    """Attention without positional information."""

    @classmethod
    def _for_attention(cls, cfg, heads, head_dim, options):
        return cls(**options)


class Rope(_Scheme):
    """RoPE: rotates q and k inside attention (scheme 'rope'), or tensors with rotate().

    Rope(head_dim, rotary_dim=0, base=1e4, style='half', scaling=None) or Rope.from_config(
    config): the model's theta, rotary dim, style and scaling (frequencies at the sequence's
    length, the largest position + 1: dynamic NTK and LongRoPE follow the positions; computed
    inside the op, so a compiled graph follows them too).
    """

    scheme = "rope"

    def __init__(self, head_dim, rotary_dim=0, base=1e4, style="half", scaling=None, *,
                 angles="accurate", config=None):
        super().__init__()
        self.head_dim = head_dim
        if config is not None:
            self._settings = {"config": _config(config), "angles": angles}
        else:
            s = {"rotary_dim": rotary_dim, "base": base, "style": style, "angles": angles}
            if scaling is not None:
                s["scaling"] = dict(scaling)
            self._settings = s
        # apply_rope's keywords for rotate(): a config's style named (attention takes it from the
        # config); made into the op's typed arguments now, outside any compiled region.
        s = self.settings()
        if "config" in s:
            s["style"] = s["config"].rope["style"]
        self.__dict__["_rotate_args"] = _ops.typed("rope", s, "Rope")

    @classmethod
    def from_config(cls, config, **kwargs):
        cfg = _config(config)
        return cls(cfg.head_dim, config=cfg, **kwargs)

    def rotate(self, x, positions=None, *, inverse=False):
        """RoPE of x [batch, seq, heads, head_dim], differentiable."""
        if "config" not in self._settings and self.head_dim != x.shape[-1]:
            raise ValueError(f"x: head_dim {x.shape[-1]}, this Rope was made for "
                             f"{self.head_dim}")
        return rope(x, positions=positions, inverse=inverse,
                    _base_args=self.__dict__["_rotate_args"])

    @classmethod
    def _for_attention(cls, cfg, heads, head_dim, options):
        return cls.from_config(cfg, **options) if cfg is not None else cls(head_dim, **options)


class Alibi(_Scheme):
    """ALiBi: linear biases with slopes for `heads` heads (docs/alibi.md), or the model's slopes.

    learnable=True makes the slopes a Parameter (gradients through the fused backward).
    """

    scheme = "alibi"
    _table_names = ("slopes",)

    def __init__(self, heads, max_bias=8.0, *, learnable=False, config=None):
        super().__init__()
        if config is not None:
            cfg = _config(config)
            heads, max_bias = cfg.alibi["heads"], cfg.alibi["max_bias"]
        slopes = torch.from_numpy(_posenc.alibi_slopes(heads, max_bias=max_bias))
        if learnable:
            self.slopes = nn.Parameter(slopes)
        else:
            self.register_buffer("slopes", slopes)
        self.heads = heads

    @classmethod
    def from_config(cls, config, **kwargs):
        return cls(0, config=config, **kwargs)

    @classmethod
    def _for_attention(cls, cfg, heads, head_dim, options):
        return cls.from_config(cfg, **options) if cfg is not None else cls(heads, **options)


class T5RelativeBias(_Scheme):
    """T5's bucketed relative bias: table relative_attention_bias [num_buckets, heads] (docs/t5.md).

    Score scale 1 by default, as T5 (pass scale= to override). bidirectional: None follows the
    mask (encoder: bidirectional, causal decoder: causal buckets).
    """

    scheme = "t5"
    _table_names = ("relative_attention_bias",)

    def __init__(self, heads, num_buckets=32, max_distance=128, bidirectional=None, *,
                 scale=1.0, init_std=0.02):
        super().__init__()
        self.relative_attention_bias = nn.Parameter(torch.randn(num_buckets, heads) * init_std)
        s = {"max_distance": max_distance, "scale": scale}
        if bidirectional is not None:
            s["bidirectional"] = bidirectional
        self._settings = s

    @classmethod
    def from_config(cls, config, **kwargs):
        cfg = _config(config)
        return cls(cfg.heads_q, cfg.t5["num_buckets"], cfg.t5["max_distance"], **kwargs)

    @classmethod
    def _for_attention(cls, cfg, heads, head_dim, options):
        return cls.from_config(cfg, **options) if cfg is not None else cls(heads, **options)


class ShawRelative(_Scheme):
    """Shaw et al.'s clipped relative representations: rel_k, rel_v [2K+1, head_dim] shared by
    the heads, or [2K+1, heads, head_dim] with heads= (docs/shaw.md). value=False: no rel_v."""

    scheme = "shaw"
    _table_names = ("rel_k", "rel_v")

    def __init__(self, head_dim, max_relative_position, heads=None, *, value=True,
                 init_std=0.02):
        super().__init__()
        shape = (2 * max_relative_position + 1,) + ((heads,) if heads else ()) + (head_dim,)
        self.rel_k = nn.Parameter(torch.randn(*shape) * init_std)
        self.rel_v = nn.Parameter(torch.randn(*shape) * init_std) if value else None

    @classmethod
    def _for_attention(cls, cfg, heads, head_dim, options):
        opts = dict(options)
        k = opts.pop("max_relative_position", 16)
        shared = opts.pop("shared", True)  # default: tables shared by the heads
        return cls(head_dim, k, None if shared else heads, **opts)


class XLRelative(_Scheme):
    """Transformer-XL's relative attention: r_w_bias (u), r_r_bias (v) [heads, head_dim] and the
    projection r_net [heads * head_dim, d_model] of the distance sinusoid
    (docs/transformer-xl.md)."""

    scheme = "xl"
    _table_names = ("r_w_bias", "r_r_bias", "r_net")

    def __init__(self, heads, head_dim, d_model, base=1e4, *, init_std=0.02):
        super().__init__()
        self.r_w_bias = nn.Parameter(torch.randn(heads, head_dim) * init_std)
        self.r_r_bias = nn.Parameter(torch.randn(heads, head_dim) * init_std)
        self.r_net = nn.Parameter(torch.randn(heads * head_dim, d_model) / math.sqrt(d_model))
        self._settings = {"base": base}

    @classmethod
    def _for_attention(cls, cfg, heads, head_dim, options):
        opts = dict(options)
        d_model = opts.pop("d_model", heads * head_dim)
        return cls(heads, head_dim, d_model, **opts)


class DebertaRelative(_Scheme):
    """DeBERTa's disentangled attention: projected tables pos_key, pos_query [2K, heads,
    head_dim] (docs/deberta.md; in the model they are the layer's key / query projections of its
    relative embeddings). K = position_buckets if > 0, else max_relative_positions."""

    scheme = "deberta"
    _table_names = ("pos_key", "pos_query")

    def __init__(self, heads, head_dim, max_relative_positions=512, position_buckets=0, *,
                 p2c="model", float64_log=False, init_std=0.02, config=None):
        super().__init__()
        if config is not None:
            cfg = _config(config)
            d = cfg.deberta
            max_relative_positions, position_buckets = (d["max_relative_positions"],
                                                        d["position_buckets"])
            p2c, float64_log = d["p2c"], d["float64_log"]
        span = position_buckets if position_buckets > 0 else max_relative_positions
        self.pos_key = nn.Parameter(torch.randn(2 * span, heads, head_dim) * init_std)
        self.pos_query = nn.Parameter(torch.randn(2 * span, heads, head_dim) * init_std)
        self._settings = {"max_relative_positions": max_relative_positions,
                          "position_buckets": position_buckets, "deberta_p2c": p2c,
                          "deberta_float64_log": float64_log}

    @classmethod
    def from_config(cls, config, **kwargs):
        cfg = _config(config)
        return cls(cfg.heads_q, cfg.head_dim, config=cfg, **kwargs)

    @classmethod
    def _for_attention(cls, cfg, heads, head_dim, options):
        return (cls.from_config(cfg, **options) if cfg is not None
                else cls(heads, head_dim, **options))


class LearnedPositions(nn.Module):
    """Learned absolute positions (GPT-2 wpe, BERT): x + weight[position], weight
    [max_positions, dim]. A position outside the table raises (no silent clamp)."""

    def __init__(self, max_positions, dim, *, init_std=0.02):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(max_positions, dim) * init_std)

    @classmethod
    def from_config(cls, config, **kwargs):
        cfg = _config(config)
        return cls(cfg.max_position_embeddings, cfg.hidden_size, **kwargs)

    def forward(self, x, positions=None):
        """x [batch, seq, dim] or [seq, dim]; positions None (0, 1, ...), an int offset, or ids."""
        return add_learned(x, self.weight, positions)


class SinusoidalPositions(nn.Module):
    """Fixed sinusoidal positions: x + PE[position] (docs/sinusoidal.md; layout 'interleaved' as
    the paper, 'concat' as Transformer-XL / Marian; denominator, origin and odd_dim as
    posenc.add_sinusoidal). Differentiable in x (the table is fixed)."""

    def __init__(self, dim, base=1e4, layout="interleaved", *, denominator="dim", origin=0,
                 odd_dim="error"):
        super().__init__()
        self.dim = dim
        self._cfg = dict(base=base, layout=layout, denominator=denominator, origin=origin,
                         odd_dim=odd_dim)

    def encodings(self, positions):
        """PE at the given positions: float32 [n, dim]."""
        pos = torch.as_tensor(positions, dtype=torch.int64).reshape(-1)
        return _ops.sinusoidal_encode(pos, self.dim, **_ops.typed("sinusoidal_encode", self._cfg,
                                                                  "SinusoidalPositions"))

    def forward(self, x, positions=None):
        """x [batch, seq, dim] or [seq, dim]; positions None (origin, origin + 1, ...), an int
        offset, ids [seq] or [batch, seq]."""
        if x.shape[-1] != self.dim:
            raise ValueError(f"x: last dimension {x.shape[-1]}, expected dim {self.dim}")
        return add_sinusoidal(x, positions, **self._cfg)

    def extra_repr(self):
        return f"dim={self.dim}, " + ", ".join(f"{k}={v!r}" for k, v in self._cfg.items())


_MODULES = {"none": NoPositions, "rope": Rope, "alibi": Alibi, "t5": T5RelativeBias,
            "shaw": ShawRelative, "xl": XLRelative, "deberta": DebertaRelative}
# The module of each scheme of the registry (posenc.schemes()), in its order; None for a scheme
# without one (posenc.torch.attention computes it with the tables given as params=).
_SCHEMES = {s["name"]: _MODULES.get(s["name"]) for s in _posenc.schemes()}


class PositionalAttention(nn.Module):
    """softmax(QK^T)V with a positional scheme, in place of a layer's attention core.

    PositionalAttention(scheme, heads, kv_heads=None, head_dim=64, *, causal=False,
    layout='blhd', config=None, **scheme options) owns the scheme's module (`.positions`: its
    learnable tables) and calls posenc.torch.attention: q [batch, seq, heads, head_dim], k and v
    [batch, seq_k, kv_heads, head_dim] (layout='bhld': [batch, heads, seq, head_dim], PyTorch's
    SDPA order, taken as strided views without copies). Scheme options: rope rotary_dim, base,
    style, scaling; alibi max_bias, learnable; t5 num_buckets, max_distance, bidirectional; shaw
    max_relative_position, value, shared (default True: tables shared by the heads); xl d_model,
    base; deberta max_relative_positions, position_buckets, p2c. config (a config.json path, dict
    or ModelConfig) gives the scheme and its settings. sinks=True: a learnable attention sink per
    query head (gpt-oss), the Parameter `.sinks` [heads] (initialised to 0), added to every row's
    softmax denominator. chunk: chunked local attention (Llama 4) for every call. backend: the
    kernels of every call, as posenc.torch.attention's ("auto": posenc's CPU kernels on CPU
    tensors, posenc.triton's on CUDA tensors; "cpu"; "triton"; "flex": FlexAttention through
    posenc.torch.flex, the module's settings as its keywords).
    """

    def __init__(self, scheme=None, heads=None, kv_heads=None, head_dim=None, *, causal=False,
                 layout="blhd", config=None, sinks=False, chunk=None, backend="auto",
                 **options):
        super().__init__()
        cfg = _config(config)
        if cfg is not None:
            scheme = scheme or cfg.scheme
            heads = heads or cfg.heads_q
            kv_heads = kv_heads or cfg.heads_kv
            head_dim = head_dim or cfg.head_dim
        if scheme not in _SCHEMES:
            raise ValueError(f"scheme: '{scheme}' ({', '.join(_SCHEMES)})")
        if heads is None or head_dim is None:
            raise TypeError("PositionalAttention: heads and head_dim are required (or config=)")
        if layout not in ("blhd", "bhld"):
            raise ValueError(f"layout: '{layout}' (blhd or bhld)")
        self.scheme, self.heads, self.head_dim = scheme, heads, head_dim
        self.kv_heads = kv_heads or heads
        self.causal, self.layout = causal, layout
        self.chunk = chunk
        if backend not in _ops._BACKENDS + ("flex",):
            raise ValueError(f"backend: 'auto', 'cpu', 'triton' or 'flex' (got {backend!r})")
        self.backend = backend
        self.sinks = nn.Parameter(torch.zeros(heads)) if sinks else None
        module = _SCHEMES[scheme]
        if module is None:
            raise ValueError(f"scheme: '{scheme}' has no posenc.torch module; call "
                             f"posenc.torch.attention(q, k, v, '{scheme}', params=...) with its "
                             "tables")
        self.positions = module._for_attention(cfg, heads, head_dim, options)

    def forward(self, q, k, v, *, causal=None, **kwargs):
        """Attention output in the module's layout. kwargs: scale, window, query_positions,
        key_positions, allow_fully_masked, num_threads, seq_len, chunk."""
        if self.layout == "bhld":
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.chunk is not None:
            kwargs.setdefault("chunk", self.chunk)
        if self.backend != "auto":
            kwargs.setdefault("backend", self.backend)
        params = {"sinks": self.sinks} if self.sinks is not None else None
        out = self.positions(q, k, v, causal=self.causal if causal is None else causal,
                             params=params, **kwargs)
        return out.transpose(1, 2) if self.layout == "bhld" else out

    def extra_repr(self):
        return (f"scheme={self.scheme!r}, heads={self.heads}, kv_heads={self.kv_heads}, "
                f"head_dim={self.head_dim}, causal={self.causal}, layout={self.layout!r}, "
                f"sinks={self.sinks is not None}, chunk={self.chunk!r}, backend={self.backend!r}")
