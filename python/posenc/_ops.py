"""posenc's PyTorch operators: ``torch.library`` custom ops in the namespace ``posenc``.

Each op takes tensors plus one ``options`` string (the keyword arguments of the NumPy function it
calls, as a Python dict literal: a constant that torch.compile keeps in the graph) and has a fake (shape) function
and, where it has a gradient, an autograd formula, so ``torch.compile(fullgraph=True)``,
``torch.export`` and AOTAutograd see through posenc calls. The public functions and modules of
``posenc.torch`` call these ops; they can also be called directly as ``torch.ops.posenc.<name>``.

CPU tensors reach the kernels without copies (NumPy views of their memory; a copy is made only
for a tensor whose last dimension is not contiguous, which the kernels require). Outputs are
fresh tensors. A tensor on another device raises one ValueError naming the device.

Ops: attention (forward with the per-row log-sum-exp), attention_backward, attention_half (bf16 /
f16 forward), attention_paged and rope_append (paged KV caches; rope_append writes its pages),
rope (and its inverse: options' ``inverse``), rope_half, rerotate_rope, add_learned,
learned_backward, add_sinusoidal, sinusoidal_encode, attention_merge.
"""

import ast
import functools
import itertools
from typing import Optional

import torch

from . import _posenc

Tensor = torch.Tensor

# Objects that are not JSON (a ModelConfig): registered once, named in options by a key that no
# file path can spell (it starts with a NUL character).
_OBJECTS = {}
_OBJECT_KEYS = {}
_OBJECT_IDS = itertools.count()
_OBJECT_PREFIX = "\x00posenc-object:"


def register_object(obj):
    """The options key of a non-JSON argument (a ModelConfig), registered for this process."""
    key = _OBJECT_KEYS.get(id(obj))
    if key is None or _OBJECTS.get(key) is not obj:
        key = f"{_OBJECT_PREFIX}{next(_OBJECT_IDS)}"
        _OBJECTS[key] = obj
        _OBJECT_KEYS[id(obj)] = key
    return key


def _literal(value, name):
    """value as a Python literal (plain code: torch.compile traces it on constants)."""
    if value is None or isinstance(value, (bool, int, str)):
        return repr(value)
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"{name}: must be finite (got {value})")
        return repr(value)
    if isinstance(value, dict):
        items = [_literal(str(k), name) + ": " +
                 _literal(value[k], f"{name}[{k!r}]" if name else str(k))
                 for k in sorted(value, key=str)]
        return "{" + ", ".join(items) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_literal(v, name) for v in value) + "]"
    if isinstance(value, _posenc.RopeFrequencies):
        return _literal({"\x00freqs": {"inv_freq": [float(x) for x in value.inv_freq],
                                        "attention_factor": float(value.attention_factor),
                                        "angles": value.angles}}, name)
    if isinstance(value, _posenc.ModelConfig):
        return repr(register_object(value))
    if hasattr(value, "__fspath__"):
        return repr(str(value.__fspath__()))
    if hasattr(value, "item") and hasattr(value, "ndim") and value.ndim == 0:  # NumPy scalar
        return _literal(value.item(), name)
    raise TypeError(f"{name}: unsupported argument of type {type(value).__name__}")


_ENCODED = {}


def _encode_cached(kwargs):
    # Eager calls repeat the same keywords: their strings are kept (hashable values only).
    try:
        # The type is part of the key: 1, 1.0 and True hash alike, but are different arguments
        # (causal=1 must reach the checker as the int it is).
        key = tuple(sorted((k, type(v).__name__, v if not isinstance(v, list) else tuple(v))
                           for k, v in kwargs.items()))
        hash(key)
    except TypeError:
        return _literal(dict(kwargs), "")
    text = _ENCODED.get(key)
    if text is None:
        text = _literal(dict(kwargs), "")
        if len(_ENCODED) < 4096:
            _ENCODED[key] = text
    return text


def encode(kwargs, base=None):
    """Keyword arguments as an options string (a Python dict literal, keys sorted). base: an
    options string made earlier (a module's settings, encoded once outside any compiled region,
    where its floats are plain constants) whose keywords `kwargs` extend or override."""
    if torch.compiler.is_compiling():
        text = _literal(dict(kwargs), "")
    else:
        text = _encode_cached(kwargs)
    if not base or base == "{}":
        return text
    if text == "{}":
        return base
    return base[:-1] + ", " + text[1:]  # a repeated key: the later one wins


def _resolve(value):
    if isinstance(value, str) and value.startswith(_OBJECT_PREFIX):
        try:
            return _OBJECTS[value]
        except KeyError:
            raise ValueError("posenc: options name an object this process has not registered "
                             "(a graph made in another process?)") from None
    if isinstance(value, dict):
        if set(value) == {"\x00freqs"}:
            f = value["\x00freqs"]
            return _posenc.RopeFrequencies(f["inv_freq"], attention_factor=f["attention_factor"],
                                           angles=f["angles"])
        return {k: _resolve(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(v) for v in value]
    return value


@functools.lru_cache(maxsize=4096)
def _decode_cached(options):
    if not isinstance(options, str):
        raise TypeError(f"options: expected a str (a dict literal), got {type(options).__name__}")
    try:
        d = ast.literal_eval(options)
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError) as e:
        raise ValueError(f"options: not a Python dict literal ({e})") from None
    if not isinstance(d, dict) or not all(isinstance(k, str) for k in d):
        raise ValueError("options: must be a dict literal with string keys")
    return d


def decode(options):
    """An options string as keyword arguments (a fresh dict)."""
    return {k: _resolve(v) for k, v in _decode_cached(options).items()}


def with_option(options, **changes):
    """The options string with some keywords changed."""
    d = dict(_decode_cached(options))
    d.update(changes)
    return _literal(d, "")


def require_cpu(t, what):
    """ValueError unless t is a CPU tensor (posenc has no GPU path)."""
    if isinstance(t, torch.Tensor) and not t.is_cpu:
        raise ValueError(f"posenc: {what} is on device '{t.device}'; posenc's kernels run on the "
                         f"CPU only (move it with .cpu())")


def _np(t, what):
    """A CPU tensor as a NumPy array on its memory (a copy only if its last dimension is not
    contiguous)."""
    require_cpu(t, what)
    if t.dim() > 0 and t.stride(-1) != 1 and t.shape[-1] > 1:
        t = t.contiguous()
    return t.detach().numpy() if t.requires_grad else t.numpy()


def _bits(t, what):
    """A bf16 / f16 CPU tensor's bits as an int16 NumPy array on its memory."""
    require_cpu(t, what)
    if t.dim() > 0 and t.stride(-1) != 1 and t.shape[-1] > 1:
        t = t.contiguous()
    return t.detach().view(torch.int16).numpy()


def _from_bits(a, dtype):
    return torch.from_numpy(a.view("int16")).view(dtype)


_HALF = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _half_dtypes(fn, q, k, v, names=("q", "k", "v")):
    """TypeError unless k and v share one half dtype and q is of it or float32: each tensor's
    bits are read as that dtype, so a mix would be read wrongly."""
    if k.dtype not in _HALF or v.dtype != k.dtype:
        raise TypeError(f"{fn}: {names[1]} and {names[2]} must share one dtype, bfloat16 or "
                        f"float16 (got {k.dtype} and {v.dtype})")
    if q.dtype not in (k.dtype, torch.float32):
        raise TypeError(f"{fn}: {names[0]} must be {k.dtype} or torch.float32 with {k.dtype} "
                        f"{names[1]} and {names[2]} (got {q.dtype})")


def _positions(t, what):
    return None if t is None else _np(t, what)


def _params(names, tables):
    return {n: _np(t, n) for n, t in zip(names, tables)} or None


def _attention_kwargs(options, query_positions, key_positions, masks=(), tables=()):
    kw = decode(options)
    names = kw.pop("\x00names", [])
    mask_names = kw.pop("\x00masks", [])
    # Every tensor is named by the options: one without a name would be ignored.
    if len(names) != len(tables):
        raise ValueError(f"tables: {len(tables)} tensors, but options name {len(names)} "
                         f"({names})")
    if len(mask_names) != len(masks):
        raise ValueError(f"masks: {len(masks)} tensors, but options name {len(mask_names)} "
                         f"({mask_names})")
    # Mask tensors (cu_seqlens, documents, prefix, dense mask): named by options' "\x00masks".
    for name, t in zip(mask_names, masks):
        kw[name] = _np(t, name)
    if query_positions is not None:
        kw["query_positions"] = _positions(query_positions, "query_positions")
    if key_positions is not None:
        kw["key_positions"] = _positions(key_positions, "key_positions")
    return kw, names


def _out_shape(q, v):
    if q.dim() == 3:  # packed sequences: [total_q, heads_q, v_dim]
        return (q.shape[0], q.shape[1], v.shape[2])
    return (q.shape[0], q.shape[1], q.shape[2], v.shape[3])


def _lse_shape(q):
    if q.dim() == 3:  # packed sequences: [heads_q, total_q]
        return (q.shape[1], q.shape[0])
    return (q.shape[0], q.shape[2], q.shape[1])


# ---- attention ---------------------------------------------------------------------------------

def attention_impl(q: Tensor, k: Tensor, v: Tensor, tables: list[Tensor],
                   query_positions: Optional[Tensor], key_positions: Optional[Tensor],
                   masks: list[Tensor], options: str) -> tuple[Tensor, Tensor]:
    """out [batch, seq_q, heads_q, v_dim] and lse [batch, heads_q, seq_q] (packed sequences:
    [total_q, heads_q, v_dim] and [heads_q, total_q]): posenc.attention with return_lse
    (float32: the fused kernel; float64: the float64 reference). masks: the integer / boolean
    mask arguments named by the options."""
    kw, names = _attention_kwargs(options, query_positions, key_positions, masks, tables)
    out, lse = _posenc.attention(_np(q, "q"), _np(k, "k"), _np(v, "v"),
                                 params=_params(names, tables), return_lse=True, **kw)
    return torch.from_numpy(out), torch.from_numpy(lse)


attention = torch.library.custom_op("posenc::attention", attention_impl, mutates_args=())


@attention.register_fake
def _(q, k, v, tables, query_positions, key_positions, masks, options):
    return q.new_empty(_out_shape(q, v)), q.new_empty(_lse_shape(q))


def attention_backward_impl(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor,
                       tables: list[Tensor], query_positions: Optional[Tensor],
                       key_positions: Optional[Tensor], masks: list[Tensor],
                       options: str) -> list[Tensor]:
    """[dq, dk, dv, d<table> for each table]: the fused backward (FlashAttention-2 recomputation
    from out and lse; float64: the reference)."""
    kw, names = _attention_kwargs(options, query_positions, key_positions, masks, tables)
    g = _posenc.attention_grad(_np(q, "q"), _np(k, "k"), _np(v, "v"), _np(dout, "dout"),
                               params=_params(names, tables), out=_np(out, "out"),
                               lse=_np(lse, "lse"), **kw)
    return [torch.from_numpy(g[n]) for n in ["dq", "dk", "dv"] + ["d" + n for n in names]]


attention_backward = torch.library.custom_op("posenc::attention_backward",
                                             attention_backward_impl, mutates_args=())


@attention_backward.register_fake
def _(q, k, v, out, lse, dout, tables, query_positions, key_positions, masks, options):
    return [x.new_empty(x.shape) for x in [q, k, v, *tables]]


def _attention_setup(ctx, inputs, output):
    q, k, v, tables, query_positions, key_positions, masks, options = inputs
    out, lse = output
    ctx.options = options
    ctx.ntables = len(tables)
    ctx.save_for_backward(q, k, v, out, lse, query_positions, key_positions, *tables, *masks)


def _attention_grad(ctx, dout, _dlse):
    # lse carries no gradient: posenc.torch.attention returns it detached.
    q, k, v, out, lse, query_positions, key_positions, *rest = ctx.saved_tensors
    tables, masks = rest[:ctx.ntables], rest[ctx.ntables:]
    dout = dout.contiguous()
    g = attention_backward(q, k, v, out, lse, dout, tables, query_positions, key_positions,
                           masks, ctx.options)
    return g[0], g[1], g[2], list(g[3:]), None, None, [None] * len(masks), None


attention.register_autograd(_attention_grad, setup_context=_attention_setup)


def attention_half_impl(q: Tensor, k: Tensor, v: Tensor, tables: list[Tensor],
                   query_positions: Optional[Tensor], key_positions: Optional[Tensor],
                   masks: list[Tensor], options: str) -> Tensor:
    """The native half-precision forward: k, v bf16 or f16, q of their dtype (out of that dtype)
    or float32 (the mixed kernel, float32 out). No gradient."""
    kw, names = _attention_kwargs(options, query_positions, key_positions, masks, tables)
    _half_dtypes("attention_half", q, k, v)
    half_q = q.dtype in _HALF
    out = _posenc._attention_half(_bits(q, "q") if half_q else _np(q, "q"), _bits(k, "k"),
                                  _bits(v, "v"), params=_params(names, tables),
                                  dtype=_HALF[k.dtype], **kw)
    return _from_bits(out, q.dtype) if half_q else torch.from_numpy(out)


attention_half = torch.library.custom_op("posenc::attention_half", attention_half_impl,
                                         mutates_args=())


@attention_half.register_fake
def _(q, k, v, tables, query_positions, key_positions, masks, options):
    return q.new_empty(_out_shape(q, v), dtype=q.dtype if q.dtype in _HALF else torch.float32)


# ---- paged KV caches ---------------------------------------------------------------------------

def attention_paged_impl(q: Tensor, k_pages: Tensor, v_pages: Tensor, block_table: Tensor,
                         seq_lens: Tensor, tables: list[Tensor],
                         query_positions: Optional[Tensor], options: str) -> Tensor:
    """posenc.attention_paged on the pages' memory: float32 pages (float32 q and out), or bf16 /
    f16 pages with q of their dtype (out of that dtype) or float32 (float32 out). No gradient."""
    kw, names = _attention_kwargs(options, query_positions, None, (), tables)
    table, lens = _np(block_table, "block_table"), _np(seq_lens, "seq_lens")
    if k_pages.dtype not in _HALF and v_pages.dtype not in _HALF:
        for t, what in ((q, "q"), (k_pages, "k_pages"), (v_pages, "v_pages")):
            if t.dtype != torch.float32:
                raise TypeError(f"attention_paged: {what} must be torch.float32 with float32 "
                                f"pages (or all of one half dtype; q may stay float32), got "
                                f"{t.dtype}")
    if k_pages.dtype in _HALF or v_pages.dtype in _HALF:
        _half_dtypes("attention_paged", q, k_pages, v_pages, ("q", "k_pages", "v_pages"))
        half_q = q.dtype in _HALF
        out = _posenc._attention_paged(_bits(q, "q") if half_q else _np(q, "q"),
                                       _bits(k_pages, "k_pages"), _bits(v_pages, "v_pages"),
                                       table, lens, params=_params(names, tables),
                                       dtype=_HALF[k_pages.dtype], **kw)
        return _from_bits(out, q.dtype) if half_q else torch.from_numpy(out)
    out = _posenc._attention_paged(_np(q, "q"), _np(k_pages, "k_pages"), _np(v_pages, "v_pages"),
                                   table, lens, params=_params(names, tables), **kw)
    return torch.from_numpy(out)


attention_paged = torch.library.custom_op("posenc::attention_paged", attention_paged_impl,
                                          mutates_args=())


@attention_paged.register_fake
def _(q, k_pages, v_pages, block_table, seq_lens, tables, query_positions, options):
    return q.new_empty(q.shape, dtype=q.dtype if q.dtype in _HALF else torch.float32)


def _pool(t, what):
    """A page pool rope_append writes: a NumPy view of the tensor's memory (never a copy)."""
    require_cpu(t, what)
    if t.dim() > 0 and t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(f"{what}: rope_append writes in place: the last dimension must be "
                         "contiguous")
    return t.detach().view(torch.int16).numpy() if t.dtype in _HALF else t.detach().numpy()


def rope_append_impl(k_new: Tensor, v_new: Optional[Tensor], k_pages: Tensor,
                     v_pages: Optional[Tensor], block_table: Tensor, seq_lens: Tensor,
                     positions: Optional[Tensor], options: str) -> None:
    """posenc.rope_append: the new keys rotated and written (with the values) into the pages, in
    place."""
    kw = decode(options)
    half = k_pages.dtype in _HALF
    if v_pages is not None and v_pages.dtype != k_pages.dtype:
        raise TypeError(f"rope_append: k_pages and v_pages must share one dtype (got "
                        f"{k_pages.dtype} and {v_pages.dtype})")
    for t, what in ((k_new, "k_new"), (v_new, "v_new")):
        if t is not None and t.dtype not in (torch.float32, k_pages.dtype):
            raise TypeError(f"rope_append: {what} must be torch.float32 or the pages' dtype "
                            f"{k_pages.dtype} (got {t.dtype})")

    def new(t, what):
        if t is None:
            return None
        return _bits(t, what) if t.dtype in _HALF else _np(t, what)

    _posenc._rope_append(new(k_new, "k_new"), _pool(k_pages, "k_pages"),
                         _np(block_table, "block_table"), _np(seq_lens, "seq_lens"),
                         v_new=new(v_new, "v_new"),
                         v_pages=None if v_pages is None else _pool(v_pages, "v_pages"),
                         dtype=_HALF[k_pages.dtype] if half else None,
                         positions=(_positions(positions, "positions") if positions is not None
                                    else kw.pop("positions", None)), **kw)


rope_append = torch.library.custom_op("posenc::rope_append", rope_append_impl,
                                      mutates_args=("k_pages", "v_pages"))


@rope_append.register_fake
def _(k_new, v_new, k_pages, v_pages, block_table, seq_lens, positions, options):
    return None


@torch.library.custom_op("posenc::attention_merge", mutates_args=())
def attention_merge(out_a: Tensor, lse_a: Tensor, out_b: Tensor,
                    lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """(out, lse) of the attention over the union of two disjoint key sets from the two partial
    attentions (float32)."""
    out, lse = _posenc.attention_merge(_np(out_a, "out_a"), _np(lse_a, "lse_a"),
                                       _np(out_b, "out_b"), _np(lse_b, "lse_b"))
    return torch.from_numpy(out), torch.from_numpy(lse)


@attention_merge.register_fake
def _(out_a, lse_a, out_b, lse_b):
    return out_a.new_empty(out_a.shape), lse_a.new_empty(lse_a.shape)


def _merge_setup(ctx, inputs, output):
    out_a, lse_a, out_b, lse_b = inputs
    out, lse = output
    ctx.save_for_backward(out_a, lse_a, out_b, lse_b, out, lse)


def _merge_grad(ctx, dout, dlse):
    # out = wa out_a + wb out_b, wa = exp(lse_a - lse), lse = log(exp(lse_a) + exp(lse_b)):
    # d out_a = wa dout; d lse_a = wa (dlse + sum_d dout (out_a - out)); b alike. A row that saw
    # no key in either part (lse = -inf) has weights 0.
    out_a, lse_a, out_b, lse_b, out, lse = ctx.saved_tensors
    finite = torch.isfinite(lse)
    safe = torch.where(finite, lse, torch.zeros_like(lse))
    wa = torch.where(finite, torch.exp(lse_a - safe), torch.zeros_like(lse))
    wb = torch.where(finite, torch.exp(lse_b - safe), torch.zeros_like(lse))
    if dout is None:
        dout = torch.zeros_like(out)
    if dlse is None:
        dlse = torch.zeros_like(lse)
    wa4 = wa.transpose(1, 2).unsqueeze(-1)
    wb4 = wb.transpose(1, 2).unsqueeze(-1)
    ra = (dout * (out_a - out)).sum(-1).transpose(1, 2)
    rb = (dout * (out_b - out)).sum(-1).transpose(1, 2)
    return wa4 * dout, wa * (dlse + ra), wb4 * dout, wb * (dlse + rb)


attention_merge.register_autograd(_merge_grad, setup_context=_merge_setup)


# ---- RoPE --------------------------------------------------------------------------------------

def rope_impl(x: Tensor, positions: Optional[Tensor], options: str) -> Tensor:
    """posenc.apply_rope (float32: the SIMD kernel; float64: the reference); options' inverse
    rotates back. Its gradient is the opposite rotation (its exact transpose)."""
    kw = decode(options)
    if positions is not None:
        kw["positions"] = _positions(positions, "positions")
    return torch.from_numpy(_posenc.apply_rope(_np(x, "x"), **kw))


rope = torch.library.custom_op("posenc::rope", rope_impl, mutates_args=())


@rope.register_fake
def _(x, positions, options):
    return x.new_empty(x.shape)


def _positions_setup(ctx, inputs, output):
    # (x, positions, options): what the rotations' gradients need.
    _, positions, options = inputs
    ctx.options = options
    ctx.save_for_backward(positions)


def _reverse_rotation(options):
    """The options of the opposite rotation (the gradient of a rotation)."""
    return with_option(options, inverse=not bool(_decode_cached(options).get("inverse")))


def _rope_grad(ctx, dy):
    (positions,) = ctx.saved_tensors
    return rope(dy.contiguous(), positions, _reverse_rotation(ctx.options)), None, None


rope.register_autograd(_rope_grad, setup_context=_positions_setup)


def rope_half_impl(x: Tensor, positions: Optional[Tensor], options: str) -> Tensor:
    """RoPE of a bf16 / f16 tensor by the native half kernel (result of x's dtype)."""
    kw = decode(options)
    if positions is not None:
        kw["positions"] = _positions(positions, "positions")
    y = _posenc._apply_rope_half(_bits(x, "x"), dtype=_HALF[x.dtype], **kw)
    return _from_bits(y, x.dtype)


rope_half = torch.library.custom_op("posenc::rope_half", rope_half_impl, mutates_args=())


@rope_half.register_fake
def _(x, positions, options):
    return x.new_empty(x.shape)


@torch.library.custom_op("posenc::rerotate_rope", mutates_args=())
def rerotate_rope(k: Tensor, positions: Optional[Tensor], options: str) -> Tensor:
    """Keys rotated with options' from_freqs moved to to_freqs (posenc.rerotate_rope, float32 or
    float64). Its gradient is the rerotation back."""
    kw = decode(options)
    from_freqs, to_freqs = kw.pop("from_freqs"), kw.pop("to_freqs")
    if positions is not None:
        kw["positions"] = _positions(positions, "positions")
    return torch.from_numpy(_posenc.rerotate_rope(_np(k, "k"), from_freqs, to_freqs, **kw))


@rerotate_rope.register_fake
def _(k, positions, options):
    return k.new_empty(k.shape)


def _rerotate_grad(ctx, dy):
    (positions,) = ctx.saved_tensors
    d = _decode_cached(ctx.options)
    back = with_option(ctx.options, from_freqs=d["to_freqs"], to_freqs=d["from_freqs"])
    return rerotate_rope(dy.contiguous(), positions, back), None, None


rerotate_rope.register_autograd(_rerotate_grad, setup_context=_positions_setup)


# ---- absolute positions ------------------------------------------------------------------------

@torch.library.custom_op("posenc::add_learned", mutates_args=())
def add_learned(x: Tensor, table: Tensor, positions: Optional[Tensor], options: str) -> Tensor:
    """x + table[position] (float32; options' positions: an int offset when no tensor)."""
    kw = decode(options)
    if positions is not None:
        kw["positions"] = _positions(positions, "positions")
    return torch.from_numpy(_posenc.add_learned(_np(x, "x"), _np(table, "table"), **kw))


@add_learned.register_fake
def _(x, table, positions, options):
    return x.new_empty(x.shape)


@torch.library.custom_op("posenc::learned_backward", mutates_args=())
def learned_backward(dy: Tensor, positions: Optional[Tensor], max_positions: int,
                     options: str) -> Tensor:
    """dtable [max_positions, dim]: the sum of dy at each position."""
    kw = decode(options)
    if positions is not None:
        kw["positions"] = _positions(positions, "positions")
    return torch.from_numpy(_posenc.learned_backward(_np(dy, "dy"), max_positions, **kw))


@learned_backward.register_fake
def _(dy, positions, max_positions, options):
    return dy.new_empty((max_positions, dy.shape[-1]))


def _learned_setup(ctx, inputs, output):
    x, table, positions, options = inputs
    ctx.options = options
    ctx.rows = table.shape[0]
    ctx.save_for_backward(positions)


def _learned_grad(ctx, dy):
    (positions,) = ctx.saved_tensors
    dtable = None
    if ctx.needs_input_grad[1]:
        dtable = learned_backward(dy.contiguous(), positions, ctx.rows, ctx.options)
    return dy, dtable, None, None


add_learned.register_autograd(_learned_grad, setup_context=_learned_setup)


@torch.library.custom_op("posenc::add_sinusoidal", mutates_args=())
def add_sinusoidal(x: Tensor, positions: Optional[Tensor], options: str) -> Tensor:
    """x + PE[position] (float32; options: the table's settings and an int offset)."""
    kw = decode(options)
    if positions is not None:
        kw["positions"] = _positions(positions, "positions")
    return torch.from_numpy(_posenc.add_sinusoidal(_np(x, "x"), **kw))


@add_sinusoidal.register_fake
def _(x, positions, options):
    return x.new_empty(x.shape)


add_sinusoidal.register_autograd(lambda ctx, dy: (dy, None, None),
                                 setup_context=lambda ctx, inputs, output: None)


@torch.library.custom_op("posenc::sinusoidal_encode", mutates_args=())
def sinusoidal_encode(positions: Tensor, dim: int, options: str) -> Tensor:
    """PE at the positions: float32 [*positions.shape, dim]."""
    ids = _np(positions, "positions").reshape(-1)
    pe = _posenc.sinusoidal_encode(ids, dim, **decode(options))
    return torch.from_numpy(pe).reshape(tuple(positions.shape) + (dim,))


@sinusoidal_encode.register_fake
def _(positions, dim, options):
    return positions.new_empty(tuple(positions.shape) + (dim,), dtype=torch.float32)


# ---- eager calls -------------------------------------------------------------------------------
# PyTorch's dispatch of a Python custom op costs about 0.1 ms a call. An eager call on plain CPU
# tensors (no compiler, no tracing, dispatch or function mode, no profiler, no tensor subclass)
# runs the same Python implementation directly, through an autograd.Function with the same formulas when gradients
# are wanted; anything else (torch.compile, export, opcheck, FakeTensor) goes through the ops.

def _plain(*tensors):
    if torch.compiler.is_compiling() or torch._C._is_torch_function_mode_enabled():
        return False
    if torch._C._len_torch_dispatch_stack() > 0 or torch.autograd._profiler_enabled():
        return False
    return all(t is None or type(t) is torch.Tensor for t in tensors)


class _EagerAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, query_positions, key_positions, masks, options, *tables):
        out, lse = attention_impl(q, k, v, list(tables), query_positions, key_positions, masks,
                                  options)
        ctx.options = options
        ctx.masks = masks
        ctx.save_for_backward(q, k, v, out, lse, query_positions, key_positions, *tables)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, query_positions, key_positions, *tables = ctx.saved_tensors
        g = attention_backward_impl(q, k, v, out, lse, dout.contiguous(), tables,
                                    query_positions, key_positions, ctx.masks, ctx.options)
        return (g[0], g[1], g[2], None, None, None, None, *g[3:])


def call_attention(q, k, v, tables, query_positions, key_positions, options, masks=()):
    """posenc::attention, or its implementation directly for an eager call (above)."""
    masks = list(masks)
    if not _plain(q, k, v, query_positions, key_positions, *tables, *masks):
        return attention(q, k, v, tables, query_positions, key_positions, masks, options)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, *tables)):
        return _EagerAttention.apply(q, k, v, query_positions, key_positions, masks, options,
                                     *tables)
    return attention_impl(q, k, v, tables, query_positions, key_positions, masks, options)


def call_attention_half(q, k, v, tables, query_positions, key_positions, options, masks=()):
    masks = list(masks)
    if not _plain(q, k, v, query_positions, key_positions, *tables, *masks):
        return attention_half(q, k, v, tables, query_positions, key_positions, masks, options)
    return attention_half_impl(q, k, v, tables, query_positions, key_positions, masks, options)


def call_attention_paged(q, k_pages, v_pages, block_table, seq_lens, tables, query_positions,
                         options):
    if not _plain(q, k_pages, v_pages, block_table, seq_lens, query_positions, *tables):
        return attention_paged(q, k_pages, v_pages, block_table, seq_lens, tables,
                               query_positions, options)
    return attention_paged_impl(q, k_pages, v_pages, block_table, seq_lens, tables,
                                query_positions, options)


def call_rope_append(k_new, v_new, k_pages, v_pages, block_table, seq_lens, positions, options):
    if not _plain(k_new, v_new, k_pages, v_pages, block_table, seq_lens, positions):
        return rope_append(k_new, v_new, k_pages, v_pages, block_table, seq_lens, positions,
                           options)
    return rope_append_impl(k_new, v_new, k_pages, v_pages, block_table, seq_lens, positions,
                            options)


class _EagerRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, positions, options):
        ctx.options = options
        ctx.save_for_backward(positions)
        return rope_impl(x, positions, options)

    @staticmethod
    def backward(ctx, dy):
        (positions,) = ctx.saved_tensors
        return rope_impl(dy.contiguous(), positions, _reverse_rotation(ctx.options)), None, None


def call_rope(x, positions, options):
    """posenc::rope, or its implementation directly for an eager call."""
    if not _plain(x, positions):
        return rope(x, positions, options)
    if torch.is_grad_enabled() and x.requires_grad:
        return _EagerRope.apply(x, positions, options)
    return rope_impl(x, positions, options)


def call_rope_half(x, positions, options):
    if not _plain(x, positions):
        return rope_half(x, positions, options)
    return rope_half_impl(x, positions, options)
