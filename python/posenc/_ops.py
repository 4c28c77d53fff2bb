"""posenc's PyTorch operators: ``torch.library`` custom ops in the namespace ``posenc``.

Each op takes tensors and typed keyword arguments (bool, int, float, str, lists of ints or
floats; constants that torch.compile and torch.export keep in the graph), has a fake (shape)
function and, where it has a gradient, an autograd formula, so ``torch.compile(fullgraph=True)``,
``torch.export`` and AOTAutograd see through posenc calls. The public functions and modules of
``posenc.torch`` call these ops; they can also be called directly as ``torch.ops.posenc.<name>``.
``print(torch.ops.posenc.rope.default._schema)`` shows an op's signature::

    posenc::rope(Tensor x, Tensor? positions=None, *, int? positions_offset=None,
                 float[]? freqs_inv_freq=None, float? freqs_attention_factor=None,
                 str? freqs_angles=None, str? style=None, int? rotary_dim=None,
                 float? base=None, str? scaling=None, int? seq_len=None, str? angles=None,
                 str? config=None, str? config_source=None, int num_threads=0,
                 bool inverse=False) -> Tensor

The keyword arguments are those of the NumPy function each op calls, by name, with None meaning
"not given" (the function's default applies). A few keywords whose values are not scalars
travel as plain values: a ``posenc.RopeFrequencies`` ``freqs`` as ``freqs_inv_freq``,
``freqs_attention_factor`` and ``freqs_angles``; a Hugging Face rope_scaling dict ``scaling`` as
its JSON text; a model config ``config`` as its config.json text (``ModelConfig.json``) and
``config_source``, the path it was read from (``ModelConfig.source``: messages name it), so a
graph made in one process runs in another; an int offset of ``positions`` (or
``query_positions``, ``key_positions``) as ``<keyword>_offset`` beside the tensor argument of
explicit ids. The attention ops take their tables as ``tables`` with their names in
``table_names``, each mask tensor (``cu_seqlens_q``, ``cu_seqlens_k``, ``query_documents``,
``key_documents``, ``prefix``, ``mask``) as its own argument, and every scheme setting of the
registry (``posenc.schemes()``) as a keyword argument of its type.

``typed(op, kwargs, fn)`` turns keyword arguments as posenc.torch takes them into an op's typed
arguments: every scalar through the bindings' argument checker (a TypeError naming the argument,
as the NumPy functions raise; ranges are checked by the NumPy function the op calls).

CPU tensors reach the kernels without copies (NumPy views of their memory; a copy is made only
for a tensor whose last dimension is not contiguous, which the kernels require). Outputs are
fresh tensors. A tensor on another device raises one ValueError naming the device.

Ops: attention (forward with the per-row log-sum-exp), attention_backward, attention_half (bf16 /
f16 forward), attention_paged and rope_append (paged KV caches; rope_append writes its pages),
rope (and its inverse: ``inverse=True``), rope_half, rerotate_rope, add_learned,
learned_backward, add_sinusoidal, sinusoidal_encode, attention_merge.
"""

import functools
import json
import math
from typing import NamedTuple

import torch

from . import _device, _posenc

Tensor = torch.Tensor


# ---- keyword arguments -------------------------------------------------------------------------

class _Keyword(NamedTuple):
    """A keyword of a NumPy function as an op takes it: its name, its kind and the default of
    its op argument (None: optional, not given; _REQUIRED: no default)."""
    name: str
    kind: str
    default: object = None


_REQUIRED = object()

# Kinds whose value is one scalar, checked by posenc._posenc._arg as the kind it names.
_SCALARS = {"bool": "bool", "int": "int", "float": "float", "str": "str", "choice": "str",
            "offset": "int"}
# The schema type of each kind's op argument (rope_frequencies: three arguments, below).
_SCHEMA_TYPES = {"bool": "bool", "int": "int", "float": "float", "str": "str", "choice": "str",
                 "offset": "int", "int_list": "int[]", "rope_scaling": "str", "config": "str"}
_FREQUENCY_PARTS = (("inv_freq", "float[]"), ("attention_factor", "float"), ("angles", "str"))


def _arguments(k):
    """[(op argument name, schema type)] of a keyword."""
    if k.kind == "rope_frequencies":
        return [(f"{k.name}_{part}", t) for part, t in _FREQUENCY_PARTS]
    if k.kind == "offset":
        return [(f"{k.name}_offset", "int")]
    if k.kind == "config":  # its config.json text and where it was read from
        return [(k.name, "str"), (f"{k.name}_source", "str")]
    return [(k.name, _SCHEMA_TYPES[k.kind])]


def _schema_arguments(keywords):
    """The schema text of keyword-only op arguments."""
    out = []
    for k in keywords:
        for name, t in _arguments(k):
            if k.default is _REQUIRED:
                out.append(f"{t} {name}")
            elif k.default is None:
                out.append(f"{t}? {name}=None")
            elif isinstance(k.default, str):
                out.append(f'{t} {name}="{k.default}"')
            else:
                out.append(f"{t} {name}={k.default}")
    return out


# ---- registry settings -------------------------------------------------------------------------

def _registry_settings():
    """Every scheme setting of the registry (posenc.schemes()) once, in the registry's order,
    as a _Keyword of its type."""
    out = {}
    for scheme in _posenc.schemes():
        for s in scheme["settings"]:
            kind = s["type"]
            if kind not in _SCHEMA_TYPES and kind != "rope_frequencies":
                raise ValueError(f"posenc: setting '{s['keyword']}' of scheme "
                                 f"'{scheme['name']}' has a type ops cannot take: '{kind}'")
            known = out.setdefault(s["keyword"], _Keyword(s["keyword"], kind))
            if known.kind != kind:
                raise ValueError(f"posenc: setting '{s['keyword']}' has two types, "
                                 f"'{known.kind}' and '{kind}'")
    return tuple(out.values())


def _keywords(*groups):
    """Keywords of several groups, each name once (the first wins)."""
    out = {}
    for group in groups:
        for k in group:
            out.setdefault(k.name, k)
    return tuple(out.values())


# Keywords of posenc.attention beside its tensors and the schemes' settings.
_ATTENTION_COMMON = (
    _Keyword("scheme", "str"), _Keyword("causal", "bool", False), _Keyword("scale", "float"),
    _Keyword("window", "int"), _Keyword("chunk", "int"), _Keyword("softcap", "float"),
    _Keyword("global_positions", "int_list"), _Keyword("layer", "int"),
    _Keyword("allow_fully_masked", "bool", False), _Keyword("num_threads", "int", 0),
    _Keyword("config", "config"),
)
_SETTINGS = _registry_settings()
# The tensor arguments of the attention ops after q, k, v (tables, their names, positions,
# masks); _MASKS are the integer / boolean mask tensors.
_MASKS = ("cu_seqlens_q", "cu_seqlens_k", "query_documents", "key_documents", "prefix", "mask")
# RoPE's keywords (posenc.apply_rope and the functions that rotate).
_ROPE = (_Keyword("freqs", "rope_frequencies"), _Keyword("style", "choice"),
         _Keyword("rotary_dim", "int"), _Keyword("base", "float"),
         _Keyword("scaling", "rope_scaling"), _Keyword("seq_len", "int"),
         _Keyword("angles", "choice"), _Keyword("config", "config"),
         _Keyword("num_threads", "int", 0))
_SINUSOIDAL = (_Keyword("base", "float"), _Keyword("layout", "choice"),
               _Keyword("denominator", "choice"), _Keyword("origin", "int"),
               _Keyword("odd_dim", "choice"))
_POSITIONS = _Keyword("positions", "offset")

# The keyword arguments of each op, by op name.
_KEYWORDS = {
    "attention": _keywords((_Keyword("query_positions", "offset"),
                            _Keyword("key_positions", "offset")), _ATTENTION_COMMON, _SETTINGS),
    "attention_paged": _keywords((_Keyword("query_positions", "offset"),), _ATTENTION_COMMON,
                                 _SETTINGS, (_Keyword("layout", "choice"),)),
    "rope_append": _keywords((_POSITIONS,), _ROPE, (_Keyword("offset", "int"),
                                                    _Keyword("layout", "choice"))),
    "rope": _keywords((_POSITIONS,), _ROPE, (_Keyword("inverse", "bool", False),)),
    "rerotate_rope": (_POSITIONS, _Keyword("from_freqs", "rope_frequencies", _REQUIRED),
                      _Keyword("to_freqs", "rope_frequencies", _REQUIRED),
                      _Keyword("style", "choice", "half")),
    "add_learned": (_POSITIONS,),
    "add_sinusoidal": (_POSITIONS,) + _SINUSOIDAL,
    "sinusoidal_encode": _SINUSOIDAL,
}
# Which kernels compute attention and its gradient: "auto" (posenc's CPU kernels on CPU tensors,
# the Triton kernels of posenc.triton on CUDA tensors), "cpu" or "triton" (on CPU tensors: through
# Triton's interpreter, TRITON_INTERPRET=1).
_BACKEND = _Keyword("backend", "choice", "auto")
_BACKENDS = ("auto", "cpu", "triton")
_KEYWORDS["attention"] = _KEYWORDS["attention_backward"] = _KEYWORDS["attention"] + (_BACKEND,)
# attention_half: the CPU half kernels, or the Triton kernels on q, k, v of one half dtype.
_KEYWORDS["attention_half"] = _KEYWORDS["attention"]
_KEYWORDS["rope_half"] = _KEYWORDS["rope"]
_KEYWORDS["learned_backward"] = _KEYWORDS["add_learned"]

# {op: {op argument name: its _Keyword}}
_OWNERS = {op: {a: k for k in ks for a, _ in _arguments(k)} for op, ks in _KEYWORDS.items()}
# {op: {keyword name: _Keyword}}
_BY_NAME = {op: {k.name: k for k in ks} for op, ks in _KEYWORDS.items()}
# {op: its rope_frequencies keywords}
_FREQUENCIES = {op: tuple(k for k in ks if k.kind == "rope_frequencies")
                for op, ks in _KEYWORDS.items()}


# ---- keyword values to typed arguments (posenc.torch's side) -----------------------------------

def _json_value(value, name):
    """A rope_scaling value as plain JSON data (NumPy scalars as Python numbers; a non-finite
    float is refused by name: JSON has none)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{name}: must be finite (got {value})")
        return value
    if isinstance(value, dict):
        return {str(k): _json_value(v, f"{name}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(v, name) for v in value]
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # a NumPy scalar
        return _json_value(value.item(), name)
    raise TypeError(f"{name}: unsupported value of type {type(value).__name__}")


def _scaling_text(value, name):
    if not isinstance(value, dict):
        raise TypeError(f"{name}: expected a rope_scaling dict, got {type(value).__name__}")
    return json.dumps(_json_value(value, name), sort_keys=True)


def _config_parts(value):
    """config.json text of a config (a path, dict or ModelConfig) and the name of its source (the
    path it was read from, or "config"), for messages."""
    if not isinstance(value, _posenc.ModelConfig):
        value = _posenc.read_model_config(value)
    return value.json, value.source or "config"


def _frequency_parts(value, name):
    if not isinstance(value, _posenc.RopeFrequencies):
        raise TypeError(f"{name}: expected a posenc.RopeFrequencies, got "
                        f"{type(value).__name__}")
    return ([float(x) for x in value.inv_freq], float(value.attention_factor), value.angles)


def _typed_value(k, value):
    """[(op argument, value)] of one keyword's value."""
    if k.kind in _SCALARS:
        return [(_arguments(k)[0][0], _posenc._arg(value, _SCALARS[k.kind], k.name))]
    if k.kind == "rope_frequencies":
        return list(zip((a for a, _ in _arguments(k)), _frequency_parts(value, k.name)))
    if k.kind == "rope_scaling":
        return [(k.name, _scaling_text(value, k.name))]
    if k.kind == "config":
        return list(zip((a for a, _ in _arguments(k)), _config_parts(value)))
    try:  # int_list
        items = list(value)
    except TypeError:
        raise TypeError(f"{k.name}: expected a list of integers, got "
                        f"{type(value).__name__}") from None
    return [(k.name, [_posenc._arg(x, "int", k.name) for x in items])]


def _typed_items(op, fn, names, values):
    """((op argument, value), ...) of keywords' values (None: not given)."""
    known = _BY_NAME[op]
    out = []
    for name, value in zip(names, values):
        k = known.get(name)
        if k is None:
            raise TypeError(f"{fn}() got an unexpected keyword argument '{name}'")
        if value is not None:
            out.extend(_typed_value(k, value))
    return tuple(out)


@torch.compiler.assume_constant_result
def _typed_constant(op, fn, names, *values):
    # torch.compile computes this once while tracing, from constant arguments: the items and the
    # error (its kind and message) or None, returned for the caller to raise as the user's code
    # would (a constant cannot raise).
    try:
        return _typed_items(op, fn, names, values), None
    except TypeError as e:
        return (), ("TypeError", str(e))
    except ValueError as e:
        return (), ("ValueError", str(e))


def typed(op, kwargs, fn):
    """The keyword arguments `kwargs` of posenc.torch's `fn` (None: not given) as typed
    arguments of op `op`: a dict {op argument: value}. TypeError for an unknown keyword or a
    value of the wrong type, naming it."""
    names = tuple(kwargs)
    values = tuple(kwargs[n] for n in names)
    if not torch.compiler.is_compiling():
        return dict(_typed_items(op, fn, names, values))
    items, error = _typed_constant(op, fn, names, *values)
    if error is not None:
        raise (TypeError if error[0] == "TypeError" else ValueError)(error[1])
    return {a: v for a, v in items}


# ---- typed arguments to the NumPy functions' keywords (the ops' side) --------------------------

def _json_object(text, name, what):
    """The dict a JSON text holds; ValueError naming the argument otherwise."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{name}: expected {what} as JSON text ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name}: expected {what} as JSON text (a JSON object), got "
                         f"{type(value).__name__}")
    return value


@functools.lru_cache(maxsize=64)
def _model_config(text, source):
    _json_object(text, "config", "a config.json")  # a ValueError naming config unless JSON
    return _posenc._model_config_from_json(text, source or "config")


@functools.lru_cache(maxsize=256)
def _scaling(text):
    return _json_object(text, "scaling", "a rope_scaling dict")


@functools.lru_cache(maxsize=256)
def _frequencies(inv_freq, attention_factor, angles):
    kw = {}
    if attention_factor is not None:
        kw["attention_factor"] = attention_factor
    if angles is not None:
        kw["angles"] = angles
    return _posenc.RopeFrequencies(list(inv_freq), **kw)


def _binding_kwargs(op, settings):
    """An op's typed keyword arguments as the keywords of the NumPy function it calls (None and
    absent arguments left out: the function's defaults apply)."""
    owners = _OWNERS[op]
    kw = {}
    for arg, value in settings.items():
        k = owners.get(arg)
        if k is None:
            raise TypeError(f"{op}() got an unexpected keyword argument '{arg}'")
        if value is None or k.kind == "rope_frequencies" or arg == f"{k.name}_source" or (
                k is _BACKEND):
            continue
        if k.kind == "rope_scaling":
            value = _scaling(value)
        elif k.kind == "config":
            value = _model_config(value, settings.get(f"{k.name}_source"))
        kw[k.name] = value
    for k in _FREQUENCIES[op]:
        inv, factor, angles = (settings.get(a) for a, _ in _arguments(k))
        if inv is not None:
            kw[k.name] = _frequencies(tuple(inv), factor, angles)
        elif factor is not None or angles is not None:
            raise ValueError(f"{k.name}_inv_freq: required with {k.name}_attention_factor and "
                             f"{k.name}_angles (the frequencies of {k.name})")
    return kw


def _with_positions(kw, name, tensor):
    """kw with positions `name`: the tensor of ids, or the int offset kw holds already."""
    if tensor is not None:
        if name in kw:
            raise ValueError(f"{name}, {name}_offset: give the ids or the offset, not both")
        kw[name] = _np(tensor, name)
    return kw


# ---- tensors -----------------------------------------------------------------------------------

def device_path(t):
    """Whether an elementwise op runs posenc._device's PyTorch form on t (a CUDA tensor) rather
    than the CPU kernels."""
    return isinstance(t, torch.Tensor) and t.device.type == "cuda"


def require_device(t, what):
    """ValueError unless t is a CPU or a CUDA tensor (the devices of the elementwise ops)."""
    if isinstance(t, torch.Tensor) and t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"posenc: {what} is on device '{t.device}'; posenc runs on CPU and CUDA "
                         f"tensors (move it with .cpu())")


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


def _params(tables, table_names):
    """The tables as posenc.attention's params {name: array} (None without tables)."""
    if len(tables) != len(table_names):
        raise ValueError(f"tables, table_names: {len(tables)} tensors and {len(table_names)} "
                         f"names {list(table_names)} (one name for each table)")
    params = {}
    for n, t in zip(table_names, tables):
        if n in params:
            raise ValueError(f"table_names: '{n}' is given twice")
        params[n] = _np(t, n)
    return params or None


def _attention_kwargs(op, tables, table_names, query_positions, key_positions, masks, settings):
    """(posenc.attention's keywords, params) of an attention op's arguments; masks: the six mask
    tensors (or None) in the order of _MASKS."""
    kw = _binding_kwargs(op, settings)
    _with_positions(kw, "query_positions", query_positions)
    _with_positions(kw, "key_positions", key_positions)
    for name, t in zip(_MASKS, masks):
        if t is not None:
            kw[name] = _np(t, name)
    return kw, _params(tables, table_names)


def _out_shape(q, v):
    if q.dim() == 3:  # packed sequences: [total_q, heads_q, v_dim]
        return (q.shape[0], q.shape[1], v.shape[2])
    return (q.shape[0], q.shape[1], q.shape[2], v.shape[3])


def _lse_shape(q):
    if q.dim() == 3:  # packed sequences: [heads_q, total_q]
        return (q.shape[1], q.shape[0])
    return (q.shape[0], q.shape[2], q.shape[1])


def _define(name, impl, tensors, returns, mutates=()):
    """The op posenc::<name>: its tensor arguments (schema text), then its keyword arguments
    (_KEYWORDS[name], keyword-only), returning `returns`."""
    args = list(tensors) + ["*"] + _schema_arguments(_KEYWORDS[name])
    schema = f"({', '.join(args)}) -> {returns}"
    return torch.library.custom_op(f"posenc::{name}", impl, mutates_args=mutates, schema=schema)


def _no_grads(names):
    # The gradient slot of a str[] argument (autograd's structure for it: a leaf unless empty).
    return None if names else []


# ---- attention ---------------------------------------------------------------------------------

_ATTENTION_TENSORS = ["Tensor[] tables", "str[] table_names", "Tensor? query_positions=None",
                      "Tensor? key_positions=None"] + [f"Tensor? {n}=None" for n in _MASKS]


def uses_triton(q, backend):
    """Whether an attention call on q with `backend` runs posenc.triton's kernels (ValueError for
    a backend name that is none of _BACKENDS)."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend: 'auto', 'cpu' or 'triton' (got {backend!r})")
    return backend == "triton" or (backend == "auto" and q.device.type == "cuda")


def _triton_op():
    from .triton import _op  # imports triton: only where the Triton kernels run
    return _op


def _mask_dict(masks):
    return dict(zip(_MASKS, masks))


def attention_impl(q, k, v, tables, table_names, query_positions=None, key_positions=None,
                   cu_seqlens_q=None, cu_seqlens_k=None, query_documents=None,
                   key_documents=None, prefix=None, mask=None, **settings):
    """out [batch, seq_q, heads_q, v_dim] and lse [batch, heads_q, seq_q] (packed sequences:
    [total_q, heads_q, v_dim] and [heads_q, total_q]): posenc.attention with return_lse
    (float32: the fused kernel; float64: the float64 reference); with the Triton backend
    posenc.triton's kernels (out float32 for half inputs, lse float32)."""
    masks = (cu_seqlens_q, cu_seqlens_k, query_documents, key_documents, prefix, mask)
    if uses_triton(q, settings.get("backend", "auto")):
        return _triton_op().forward(q, k, v, list(tables), list(table_names), query_positions,
                                    key_positions, _mask_dict(masks), settings)
    kw, params = _attention_kwargs("attention", tables, table_names, query_positions,
                                   key_positions, masks, settings)
    out, lse = _posenc.attention(_np(q, "q"), _np(k, "k"), _np(v, "v"), params=params,
                                 return_lse=True, **kw)
    return torch.from_numpy(out), torch.from_numpy(lse)


attention = _define("attention", attention_impl, ["Tensor q", "Tensor k", "Tensor v"]
                    + _ATTENTION_TENSORS, "(Tensor, Tensor)")


def _computed_dtype(q):
    """The dtype of out and lse: float32 for half inputs (the Triton kernels' float32 out, which
    the backward reads), q's otherwise."""
    return torch.float32 if q.dtype in _HALF else q.dtype


@attention.register_fake
def _(q, k, v, *args, **settings):
    dtype = _computed_dtype(q)
    return q.new_empty(_out_shape(q, v), dtype=dtype), q.new_empty(_lse_shape(q), dtype=dtype)


def attention_backward_impl(q, k, v, out, lse, dout, tables, table_names, query_positions=None,
                            key_positions=None, cu_seqlens_q=None, cu_seqlens_k=None,
                            query_documents=None, key_documents=None, prefix=None, mask=None,
                            **settings):
    """[dq, dk, dv, d<table> for each table]: the fused backward (FlashAttention-2 recomputation
    from out and lse; float64: the reference; the Triton backend: posenc.triton's kernels)."""
    masks = (cu_seqlens_q, cu_seqlens_k, query_documents, key_documents, prefix, mask)
    if uses_triton(q, settings.get("backend", "auto")):
        grads = _triton_op().backward(q, k, v, out, lse, dout, list(tables), list(table_names),
                                      query_positions, key_positions, _mask_dict(masks),
                                      settings)
        return [g.to(x.dtype) for g, x in zip(grads, [q, k, v, *tables])]
    kw, params = _attention_kwargs("attention_backward", tables, table_names, query_positions,
                                   key_positions, masks, settings)
    g = _posenc.attention_grad(_np(q, "q"), _np(k, "k"), _np(v, "v"), _np(dout, "dout"),
                               params=params, out=_np(out, "out"), lse=_np(lse, "lse"), **kw)
    return [torch.from_numpy(g[n]) for n in ["dq", "dk", "dv"] + ["d" + n for n in table_names]]


attention_backward = _define(
    "attention_backward", attention_backward_impl,
    ["Tensor q", "Tensor k", "Tensor v", "Tensor out", "Tensor lse", "Tensor dout"]
    + _ATTENTION_TENSORS, "Tensor[]")


@attention_backward.register_fake
def _(q, k, v, out, lse, dout, tables, *args, **settings):
    return [x.new_empty(x.shape) for x in [q, k, v, *tables]]


def _attention_setup(ctx, inputs, keyword_only_inputs, output):
    q, k, v, tables, table_names, query_positions, key_positions, *masks = inputs
    out, lse = output
    ctx.settings = keyword_only_inputs
    ctx.table_names = list(table_names)
    ctx.save_for_backward(q, k, v, out, lse, query_positions, key_positions, *masks, *tables)


def _attention_grad(ctx, dout, _dlse):
    # lse carries no gradient: posenc.torch.attention returns it detached.
    q, k, v, out, lse, query_positions, key_positions, *rest = ctx.saved_tensors
    masks, tables = rest[:len(_MASKS)], rest[len(_MASKS):]
    g = attention_backward(q, k, v, out, lse, dout.contiguous(), list(tables), ctx.table_names,
                           query_positions, key_positions, *masks, **ctx.settings)
    return (g[0], g[1], g[2], list(g[3:]), _no_grads(ctx.table_names), None, None,
            *([None] * len(_MASKS)))


attention.register_autograd(_attention_grad, setup_context=_attention_setup)


def _triton_half_dtypes(q, k, v):
    """TypeError unless q, k and v share one half dtype: the Triton kernels take one dtype (a
    float32 q with half k and v is the CPU's mixed kernel; nothing is cast silently)."""
    _half_dtypes("attention_half", q, k, v)
    if q.dtype != k.dtype:
        raise TypeError(f"attention_half: the Triton kernels take q, k and v of one dtype (got q "
                        f"{q.dtype} with {k.dtype} k and v); give q in {k.dtype} (the mixed "
                        f"float32-q kernel is the CPU backend's)")


def attention_half_impl(q, k, v, tables, table_names, query_positions=None, key_positions=None,
                        cu_seqlens_q=None, cu_seqlens_k=None, query_documents=None,
                        key_documents=None, prefix=None, mask=None, **settings):
    """The native half-precision forward: k, v bf16 or f16, q of their dtype (out of that dtype)
    or float32 (the mixed kernel, float32 out). No gradient. With the Triton backend (CUDA
    tensors, or backend='triton'): posenc.triton's kernels on q, k, v of one half dtype, their
    float32 out rounded once to it."""
    masks = (cu_seqlens_q, cu_seqlens_k, query_documents, key_documents, prefix, mask)
    if uses_triton(q, settings.get("backend", "auto")):
        _triton_half_dtypes(q, k, v)
        out, _ = _triton_op().forward(q, k, v, list(tables), list(table_names), query_positions,
                                      key_positions, _mask_dict(masks), settings)
        return out.to(q.dtype)
    kw, params = _attention_kwargs("attention_half", tables, table_names, query_positions,
                                   key_positions, masks, settings)
    _half_dtypes("attention_half", q, k, v)
    half_q = q.dtype in _HALF
    out = _posenc._attention_half(_bits(q, "q") if half_q else _np(q, "q"), _bits(k, "k"),
                                  _bits(v, "v"), params=params, dtype=_HALF[k.dtype], **kw)
    return _from_bits(out, q.dtype) if half_q else torch.from_numpy(out)


attention_half = _define("attention_half", attention_half_impl,
                         ["Tensor q", "Tensor k", "Tensor v"] + _ATTENTION_TENSORS, "Tensor")


@attention_half.register_fake
def _(q, k, v, *args, **settings):
    # Out of q's half dtype, or float32 for a float32 q (the CPU's mixed kernel; the Triton
    # backend refuses it).
    if uses_triton(q, settings.get("backend", "auto")):
        _triton_half_dtypes(q, k, v)
    return q.new_empty(_out_shape(q, v), dtype=q.dtype if q.dtype in _HALF else torch.float32)


# ---- paged KV caches ---------------------------------------------------------------------------

def attention_paged_impl(q, k_pages, v_pages, block_table, seq_lens, tables, table_names,
                         query_positions=None, **settings):
    """posenc.attention_paged on the pages' memory: float32 pages (float32 q and out), or bf16 /
    f16 pages with q of their dtype (out of that dtype) or float32 (float32 out). No gradient.
    CUDA tensors: the Triton forward kernel reading the pages in place through the block table."""
    if q.device.type == "cuda":
        return _triton_op().paged(q, k_pages, v_pages, block_table, seq_lens, list(tables),
                                  list(table_names), query_positions, settings)
    kw = _with_positions(_binding_kwargs("attention_paged", settings), "query_positions",
                         query_positions)
    params = _params(tables, table_names)
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
                                       table, lens, params=params, dtype=_HALF[k_pages.dtype],
                                       **kw)
        return _from_bits(out, q.dtype) if half_q else torch.from_numpy(out)
    out = _posenc._attention_paged(_np(q, "q"), _np(k_pages, "k_pages"), _np(v_pages, "v_pages"),
                                   table, lens, params=params, **kw)
    return torch.from_numpy(out)


attention_paged = _define(
    "attention_paged", attention_paged_impl,
    ["Tensor q", "Tensor k_pages", "Tensor v_pages", "Tensor block_table", "Tensor seq_lens",
     "Tensor[] tables", "str[] table_names", "Tensor? query_positions=None"], "Tensor")


@attention_paged.register_fake
def _(q, *args, **settings):
    return q.new_empty(q.shape, dtype=q.dtype if q.dtype in _HALF else torch.float32)


def _pool(t, what):
    """A page pool rope_append writes: a NumPy view of the tensor's memory (never a copy)."""
    require_cpu(t, what)
    if t.dim() > 0 and t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(f"{what}: rope_append writes in place: the last dimension must be "
                         "contiguous")
    return t.detach().view(torch.int16).numpy() if t.dtype in _HALF else t.detach().numpy()


def rope_append_impl(k_new, v_new, k_pages, v_pages, block_table, seq_lens, positions=None,
                     **settings):
    """posenc.rope_append: the new keys rotated and written (with the values) into the pages, in
    place. CUDA tensors: posenc._device's form, the same slots and bits written on the device
    (block_table, seq_lens and positions may be CPU or CUDA tensors)."""
    kw = _binding_kwargs("rope_append", settings)
    if positions is not None and "positions" in kw:
        raise ValueError("positions, positions_offset: give the ids or the offset, not both")
    _device.append_dtypes(k_new, v_new, k_pages, v_pages)
    if any(device_path(t) for t in (k_new, v_new, k_pages, v_pages)):
        _device.rope_append(k_new, v_new, k_pages, v_pages, block_table, seq_lens, positions, kw)
        return
    _with_positions(kw, "positions", positions)
    half = k_pages.dtype in _HALF

    def new(t, what):
        if t is None:
            return None
        return _bits(t, what) if t.dtype in _HALF else _np(t, what)

    _posenc._rope_append(new(k_new, "k_new"), _pool(k_pages, "k_pages"),
                         _np(block_table, "block_table"), _np(seq_lens, "seq_lens"),
                         v_new=new(v_new, "v_new"),
                         v_pages=None if v_pages is None else _pool(v_pages, "v_pages"),
                         dtype=_HALF[k_pages.dtype] if half else None, **kw)


rope_append = _define(
    "rope_append", rope_append_impl,
    ["Tensor k_new", "Tensor? v_new", "Tensor(a!) k_pages", "Tensor(b!)? v_pages",
     "Tensor block_table", "Tensor seq_lens", "Tensor? positions=None"], "()",
    mutates=("k_pages", "v_pages"))


@rope_append.register_fake
def _(*args, **settings):
    return None


@torch.library.custom_op("posenc::attention_merge", mutates_args=())
def attention_merge(out_a: Tensor, lse_a: Tensor, out_b: Tensor,
                    lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """(out, lse) of the attention over the union of two disjoint key sets from the two partial
    attentions (float32)."""
    if device_path(out_a):
        return _device.attention_merge(out_a, lse_a, out_b, lse_b)
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

def rope_impl(x, positions=None, **settings):
    """posenc.apply_rope (float32: the SIMD kernel; float64: the reference); inverse=True
    rotates back. Its gradient is the opposite rotation (its exact transpose)."""
    if device_path(x):
        return _device.rope(x, positions, _binding_kwargs("rope", settings))
    kw = _with_positions(_binding_kwargs("rope", settings), "positions", positions)
    return torch.from_numpy(_posenc.apply_rope(_np(x, "x"), **kw))


rope = _define("rope", rope_impl, ["Tensor x", "Tensor? positions=None"], "Tensor")


@rope.register_fake
def _(x, *args, **settings):
    return x.new_empty(x.shape)


def _positions_setup(ctx, inputs, keyword_only_inputs, output):
    # (x, positions) and the settings: what the rotations' gradients need.
    ctx.settings = keyword_only_inputs
    ctx.save_for_backward(inputs[1])


def _reverse_rotation(settings):
    """The settings of the opposite rotation (the gradient of a rotation)."""
    return {**settings, "inverse": not settings.get("inverse", False)}


def _rope_grad(ctx, dy):
    (positions,) = ctx.saved_tensors
    return rope(dy.contiguous(), positions, **_reverse_rotation(ctx.settings)), None


rope.register_autograd(_rope_grad, setup_context=_positions_setup)


def rope_half_impl(x, positions=None, **settings):
    """RoPE of a bf16 / f16 tensor by the native half kernel (result of x's dtype)."""
    if device_path(x):
        return _device.rope(x, positions, _binding_kwargs("rope_half", settings))
    kw = _with_positions(_binding_kwargs("rope_half", settings), "positions", positions)
    y = _posenc._apply_rope_half(_bits(x, "x"), dtype=_HALF[x.dtype], **kw)
    return _from_bits(y, x.dtype)


rope_half = _define("rope_half", rope_half_impl, ["Tensor x", "Tensor? positions=None"],
                    "Tensor")


@rope_half.register_fake
def _(x, *args, **settings):
    return x.new_empty(x.shape)


def _rerotate_impl(k, positions=None, **settings):
    """Keys rotated with from_freqs moved to to_freqs (posenc.rerotate_rope, float32 or
    float64). Its gradient is the rerotation back."""
    if device_path(k) or k.dtype == torch.float64:
        # float64 keys (the CPU kernel computes float32) and CUDA keys: posenc._device's form.
        return _device.rerotate_rope(k, positions, _binding_kwargs("rerotate_rope", settings))
    kw = _with_positions(_binding_kwargs("rerotate_rope", settings), "positions", positions)
    from_freqs, to_freqs = kw.pop("from_freqs"), kw.pop("to_freqs")
    return torch.from_numpy(_posenc.rerotate_rope(_np(k, "k"), from_freqs, to_freqs, **kw))


rerotate_rope = _define("rerotate_rope", _rerotate_impl, ["Tensor k", "Tensor? positions=None"],
                        "Tensor")


@rerotate_rope.register_fake
def _(k, *args, **settings):
    return k.new_empty(k.shape)


def _rerotate_grad(ctx, dy):
    (positions,) = ctx.saved_tensors
    s = ctx.settings
    back = dict(s)
    for part, _ in _FREQUENCY_PARTS:
        back[f"from_freqs_{part}"], back[f"to_freqs_{part}"] = (s[f"to_freqs_{part}"],
                                                               s[f"from_freqs_{part}"])
    return rerotate_rope(dy.contiguous(), positions, **back), None


rerotate_rope.register_autograd(_rerotate_grad, setup_context=_positions_setup)


# ---- absolute positions ------------------------------------------------------------------------

def _add_learned_impl(x, table, positions=None, **settings):
    """x + table[position] (float32; positions_offset: an int offset when no tensor)."""
    if device_path(x):
        return _device.add_learned(x, table, positions, _binding_kwargs("add_learned", settings))
    kw = _with_positions(_binding_kwargs("add_learned", settings), "positions", positions)
    return torch.from_numpy(_posenc.add_learned(_np(x, "x"), _np(table, "table"), **kw))


add_learned = _define("add_learned", _add_learned_impl,
                      ["Tensor x", "Tensor table", "Tensor? positions=None"], "Tensor")


@add_learned.register_fake
def _(x, *args, **settings):
    return x.new_empty(x.shape)


def _learned_backward_impl(dy, positions, max_positions, **settings):
    if device_path(dy):
        return _device.learned_backward(dy, positions, max_positions,
                                        _binding_kwargs("learned_backward", settings))
    """dtable [max_positions, dim]: the sum of dy at each position."""
    kw = _with_positions(_binding_kwargs("learned_backward", settings), "positions", positions)
    return torch.from_numpy(_posenc.learned_backward(_np(dy, "dy"), max_positions, **kw))


learned_backward = _define("learned_backward", _learned_backward_impl,
                           ["Tensor dy", "Tensor? positions", "int max_positions"], "Tensor")


@learned_backward.register_fake
def _(dy, positions, max_positions, **settings):
    return dy.new_empty((max_positions, dy.shape[-1]))


def _learned_setup(ctx, inputs, keyword_only_inputs, output):
    x, table, positions = inputs
    ctx.settings = keyword_only_inputs
    ctx.rows = table.shape[0]
    ctx.save_for_backward(positions)


def _learned_grad(ctx, dy):
    (positions,) = ctx.saved_tensors
    dtable = None
    if ctx.needs_input_grad[1]:
        dtable = learned_backward(dy.contiguous(), positions, ctx.rows, **ctx.settings)
    return dy, dtable, None


add_learned.register_autograd(_learned_grad, setup_context=_learned_setup)


def _add_sinusoidal_impl(x, positions=None, **settings):
    """x + PE[position] (float32; the table's settings and positions_offset, an int offset)."""
    if device_path(x):
        return _device.add_sinusoidal(x, positions, _binding_kwargs("add_sinusoidal", settings))
    kw = _with_positions(_binding_kwargs("add_sinusoidal", settings), "positions", positions)
    return torch.from_numpy(_posenc.add_sinusoidal(_np(x, "x"), **kw))


add_sinusoidal = _define("add_sinusoidal", _add_sinusoidal_impl,
                         ["Tensor x", "Tensor? positions=None"], "Tensor")


@add_sinusoidal.register_fake
def _(x, *args, **settings):
    return x.new_empty(x.shape)


add_sinusoidal.register_autograd(lambda ctx, dy: (dy, None),
                                 setup_context=lambda ctx, inputs, keyword_only_inputs,
                                 output: None)


def _sinusoidal_encode_impl(positions, dim, **settings):
    """PE at the positions: float32 [*positions.shape, dim]."""
    if device_path(positions):
        return _device.sinusoidal_encode(positions, dim,
                                         _binding_kwargs("sinusoidal_encode", settings))
    ids = _np(positions, "positions").reshape(-1)
    pe = _posenc.sinusoidal_encode(ids, dim, **_binding_kwargs("sinusoidal_encode", settings))
    return torch.from_numpy(pe).reshape(tuple(positions.shape) + (dim,))


sinusoidal_encode = _define("sinusoidal_encode", _sinusoidal_encode_impl,
                            ["Tensor positions", "int dim"], "Tensor")


@sinusoidal_encode.register_fake
def _(positions, dim, **settings):
    return positions.new_empty(tuple(positions.shape) + (dim,), dtype=torch.float32)


# ---- eager calls -------------------------------------------------------------------------------
# PyTorch's dispatch of a Python custom op costs about 0.1 ms a call. An eager call on plain CPU
# tensors (no compiler, no tracing, dispatch or function mode, no profiler, no tensor subclass)
# runs the same Python implementation directly, through an autograd.Function with the same
# formulas when gradients are wanted; anything else (torch.compile, export, opcheck, FakeTensor)
# goes through the ops.

def _plain(*tensors):
    if torch.compiler.is_compiling() or torch._C._is_torch_function_mode_enabled():
        return False
    if torch._C._len_torch_dispatch_stack() > 0 or torch.autograd._profiler_enabled():
        return False
    return all(t is None or type(t) is torch.Tensor for t in tensors)


def _mask_list(masks):
    """The six mask tensors (or None) in the order of _MASKS from {name: tensor}."""
    return [masks.get(n) for n in _MASKS]


class _EagerAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, table_names, query_positions, key_positions, masks, settings,
                *tables):
        out, lse = attention_impl(q, k, v, list(tables), table_names, query_positions,
                                  key_positions, *masks, **settings)
        ctx.settings = settings
        ctx.table_names = table_names
        ctx.masks = masks
        ctx.save_for_backward(q, k, v, out, lse, query_positions, key_positions, *tables)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, query_positions, key_positions, *tables = ctx.saved_tensors
        g = attention_backward_impl(q, k, v, out, lse, dout.contiguous(), tables,
                                    ctx.table_names, query_positions, key_positions, *ctx.masks,
                                    **ctx.settings)
        return (g[0], g[1], g[2], None, None, None, None, None, *g[3:])


def call_attention(q, k, v, tables, table_names, query_positions, key_positions, masks,
                   settings):
    """posenc::attention, or its implementation directly for an eager call (above). masks:
    {name: tensor} of _MASKS; settings: the op's typed keyword arguments."""
    masks = _mask_list(masks)
    if not _plain(q, k, v, query_positions, key_positions, *tables, *masks):
        return attention(q, k, v, tables, table_names, query_positions, key_positions, *masks,
                         **settings)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, *tables)):
        return _EagerAttention.apply(q, k, v, table_names, query_positions, key_positions, masks,
                                     settings, *tables)
    return attention_impl(q, k, v, tables, table_names, query_positions, key_positions, *masks,
                          **settings)


def call_attention_half(q, k, v, tables, table_names, query_positions, key_positions, masks,
                        settings):
    masks = _mask_list(masks)
    if not _plain(q, k, v, query_positions, key_positions, *tables, *masks):
        return attention_half(q, k, v, tables, table_names, query_positions, key_positions,
                              *masks, **settings)
    return attention_half_impl(q, k, v, tables, table_names, query_positions, key_positions,
                               *masks, **settings)


def call_attention_paged(q, k_pages, v_pages, block_table, seq_lens, tables, table_names,
                         query_positions, settings):
    if not _plain(q, k_pages, v_pages, block_table, seq_lens, query_positions, *tables):
        return attention_paged(q, k_pages, v_pages, block_table, seq_lens, tables, table_names,
                               query_positions, **settings)
    return attention_paged_impl(q, k_pages, v_pages, block_table, seq_lens, tables, table_names,
                                query_positions, **settings)


def call_rope_append(k_new, v_new, k_pages, v_pages, block_table, seq_lens, positions,
                     settings):
    if not _plain(k_new, v_new, k_pages, v_pages, block_table, seq_lens, positions):
        return rope_append(k_new, v_new, k_pages, v_pages, block_table, seq_lens, positions,
                           **settings)
    return rope_append_impl(k_new, v_new, k_pages, v_pages, block_table, seq_lens, positions,
                            **settings)


class _EagerRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, positions, settings):
        ctx.settings = settings
        ctx.save_for_backward(positions)
        return rope_impl(x, positions, **settings)

    @staticmethod
    def backward(ctx, dy):
        (positions,) = ctx.saved_tensors
        dx = rope_impl(dy.contiguous(), positions, **_reverse_rotation(ctx.settings))
        return dx, None, None


def call_rope(x, positions, settings):
    """posenc::rope, or its implementation directly for an eager call."""
    if not _plain(x, positions):
        return rope(x, positions, **settings)
    if torch.is_grad_enabled() and x.requires_grad:
        return _EagerRope.apply(x, positions, settings)
    return rope_impl(x, positions, **settings)


def call_rope_half(x, positions, settings):
    if not _plain(x, positions):
        return rope_half(x, positions, **settings)
    return rope_half_impl(x, positions, **settings)
