"""Property-based differential fuzzing of the Python API (Hypothesis).

Property, for posenc.attention / attention_half / attention_paged / rope_append, their
posenc.torch forms and torch.ops.posenc.attention_half: EITHER the result equals the float64
oracle on the same inputs (posenc.ref.attention on the values the computing dtype holds; paged:
each row's keys gathered first; rope_append: posenc.ref.apply_rope in the call's slots, nothing
else written) within the stated tolerance, OR the call raises a TypeError / ValueError naming an
argument passed. Anything else fails: another exception or a crash, a wrong result, an input
without meaning accepted (complex, negative positions, a page outside the pool, ...), a "fully
masked" refusal where every row sees a key, a rope_append that writes and then refuses.
tests/python/reference.py (PyTorch), with every mask folded into one dense visibility mask,
checks posenc.ref independently, and in float32 is the naive path of conftest.tol32.

Each call carries at most one drawn fault (most carry none), so most calls reach the kernels.
POSENC_FUZZ_EXAMPLES sets the examples per property (default 1000: about a minute for the file
on a 2-core machine). The seed is fixed (derandomize) and the example database is off, so runs
are reproducible; a long run: POSENC_FUZZ_EXAMPLES=5000 pytest tests/python/test_fuzz_api.py
"""

import math
import os
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import posenc
from conftest import SCHEMES, Case, maxerr, tol32

torch = pytest.importorskip("torch")
import posenc.torch as pt  # noqa: E402
import reference  # noqa: E402
from posenc import _ops  # noqa: E402

FUZZ = settings(max_examples=int(os.environ.get("POSENC_FUZZ_EXAMPLES", "1000")),
                derandomize=True, database=None, deadline=None, print_blob=False,
                suppress_health_check=list(HealthCheck))
R = "refuse"       # the meaning of a presented value that has none: the call must raise
MAXPOS = 2 ** 48   # positions lie in [0, 2^48] (docs/attention.md)
HALF = ("bfloat16", "float16")
# Keywords an error message may name as the remedy, whether passed or not.
REMEDIES = {"allow_fully_masked", "query_positions", "key_positions"}
# Messages of the binding machinery or of torch, not of posenc's own validation.
INTERNAL = re.compile(r"pybind11|Unable to cast|incompatible function arguments|got multiple "
                      r"values|unsupported ScalarType|At least one stride|Traceback")


class Refuse(Exception):
    """The oracle's verdict: these inputs have no result, the call must raise."""


def is_refuse(meant):
    return isinstance(meant, str) and meant == R


def faults(draw, *kinds):
    """The call's one fault (None for most calls)."""
    return draw(st.sampled_from((None,) * 2 * len(kinds) + kinds))


def assert_refusal(e, names):
    """A refusal is a TypeError / ValueError (posenc.Error is one) naming an argument."""
    assert isinstance(e, (TypeError, ValueError)), f"{type(e).__name__}: {e}"
    msg = str(e)  # "query positions" names query_positions too
    named = [n for n in set(names) | REMEDIES if re.search(
        r"(?<![A-Za-z0-9_])" + re.escape(n).replace("_", "[_ ]") + r"(?![A-Za-z0-9_])", msg)]
    assert named, f"message names no argument of {sorted(names)}: {type(e).__name__}: {msg}"
    assert not INTERNAL.search(msg), f"an internal error, not a refusal: {type(e).__name__}: {msg}"


def check(call):
    """The property for one call of attention, attention_half or attention_paged."""
    try:
        out = call.run()
    except Exception as e:  # noqa: BLE001 - the property classifies every exception
        assert_refusal(e, call.names)
        # The fuzzer draws finite inputs of moderate size only: nothing is non-finite and no
        # score overflows (garbage read from memory usually surfaces as exactly that).
        assert call.refuse or not re.search(r"non-finite|overflow", str(e)), \
            f"refused finite inputs as non-finite or overflowing: {e}"
        if "sees no key" in str(e) and not call.refuse:
            try:
                call.expected()
            except Refuse:
                return
            raise AssertionError(f"refused, though every query row sees a key: {e}") from None
        return
    if math.prod(out.shape) == 0:
        return  # nothing computed: refusing or returning an empty result are both fine
    assert not call.refuse, f"accepted {call.refuse}, which must be refused"
    try:
        ref64, naive32 = call.expected()
    except Refuse as e:
        raise AssertionError(f"accepted an input without a result: {e}") from None
    got = str(out.dtype).replace("torch.", "")
    assert got == call.out_dtype, f"out dtype {got}, expected {call.out_dtype}"
    assert_close(out, ref64, naive32, call.kind)


# ---- presenting values: dtypes and memory layouts ---------------------------------------------

LAYOUTS = ("contiguous", "sliced", "transposed", "broadcast", "reversed", "strided_last")
TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bf16": torch.bfloat16,
                "f16": torch.float16, "int32": torch.int32, "complex64": torch.complex64}


def lay_out(a, layout):
    """a in memory of another layout with the same values: every other element of a larger
    buffer, reversed axis order, stride 0 (broadcast: index 0 repeated along axis 1), negative
    strides (NumPy only), a last dimension that is not contiguous."""
    if a.ndim < 2 or 0 in a.shape:
        return a
    is_t = isinstance(a, torch.Tensor)
    if layout == "sliced":
        shape = (a.shape[0], 2 * a.shape[1]) + tuple(a.shape[2:])
        buf = torch.zeros(shape, dtype=a.dtype) if is_t else np.zeros(shape, a.dtype)
        buf[:, ::2] = a
        return buf[:, ::2]
    if layout == "transposed":
        axes = tuple(range(a.ndim))[::-1]
        return a.permute(axes).contiguous().permute(axes) if is_t else \
            np.ascontiguousarray(a.transpose(axes)).transpose(axes)
    if layout == "broadcast":
        return a[:, :1].expand(a.shape) if is_t else np.broadcast_to(a[:, :1], a.shape)
    if layout == "reversed" and not is_t:
        return np.ascontiguousarray(a[::-1])[::-1]
    if layout == "strided_last":
        return a.repeat_interleave(2, -1)[..., ::2] if is_t else np.repeat(a, 2, -1)[..., ::2]
    return a


def present(x, dtype, layout, as_torch=False):
    """x (float64 values) as `dtype` in `layout`: (array, the float64 values it holds, None if it
    must be refused). NumPy has no bf16: 'bf16' is its bits as uint16, 'bf16i' as int16,
    'f16bits' float16 bits as uint16; 'int32' holds 2x rounded; complex is never real."""
    x = np.round(2 * x) if dtype == "int32" else x + 0.5j if dtype == "complex64" else x
    if as_torch:
        t = lay_out(torch.from_numpy(np.ascontiguousarray(x)).to(TORCH_DTYPES[dtype]), layout)
        return t, None if t.is_complex() else t.to(torch.float64).numpy()
    if dtype in ("bf16", "bf16i"):
        a = posenc.bf16_from_float32(x).view(np.uint16 if dtype == "bf16" else np.int16)
    else:
        a = x.astype({"f16": "float16", "f16bits": "float16"}.get(dtype, dtype))
        a = a.view(np.uint16) if dtype == "f16bits" else a
    a = lay_out(a, layout)
    if dtype in ("bf16", "bf16i"):
        return a, posenc.bf16_to_float32(a).astype(np.float64)
    if dtype == "f16bits":
        return a, a.view(np.float16).astype(np.float64)
    return a, None if a.dtype.kind == "c" else np.ascontiguousarray(a, np.float64)


def rounded(x, kind):
    """Values as the computing type ('f64', 'f32') or a storage type (bf16 / f16) holds them."""
    if kind == "f64":
        return x
    x32 = np.asarray(x, np.float32)
    if kind == "bfloat16":
        return posenc.bf16_to_float32(posenc.bf16_from_float32(x32)).astype(np.float64)
    return (x32.astype(np.float16) if kind == "float16" else x32).astype(np.float64)


def ulp(x, kind):
    """The spacing of the float32 / bf16 / f16 numbers at |x|."""
    x32 = np.abs(np.asarray(x, np.float32))
    if kind == "float16":
        return np.spacing(x32.astype(np.float16)).astype(np.float64)
    return np.spacing(x32).astype(np.float64) * (2.0 ** 16 if kind == "bfloat16" else 1.0)


def int_array(values, dtype):
    """Integers as a NumPy array of dtype (int64 where they do not fit it; float64 holds them as
    floats, which must be refused)."""
    v = np.asarray(values, np.int64)
    if dtype != "float64" and v.size:
        info = np.iinfo(dtype)
        dtype = dtype if info.min <= v.min() and v.max() <= info.max else "int64"
    return v.astype(dtype)


# ---- keyword values and what they mean -----------------------------------------------------------

CAUSAL = [(False, False), (True, True), (np.bool_(True), True), ("yes", R), (1.5, R)]
WINDOW = [(None, None), (3, 3), (1, 1), (2 ** 40, 2 ** 40), (np.int64(2), 2), (2 ** 70, R),
          (0, R), (-1, R), (2.5, R), ("3", R)]
CHUNK = [(None, None), (2, 2), (1, 1), (5, 5), (2 ** 40, 2 ** 40), (0, R), (-3, R), (1.5, R)]
# Caps that flatten every score (tiny) or none (huge), and scales of 0, hide q: rarer.
SOFTCAP = [(None, None)] * 4 + [(30.0, 30.0), (0.5, 0.5), (np.float32(5), 5.0), (3, 3.0),
                                (1e-300, 1e-300), (1e-50, 1e-50), (1e-40, 1e-40), (1e30, 1e30),
                                (1e300, 1e300), (math.inf, R), (math.nan, R), (0.0, R),
                                (-2.0, R), ("30", R), (True, R)]
SCALE = [(None, None)] * 4 + [(0.25, 0.25), (1.0, 1.0), (-0.5, -0.5), (0.0, 0.0), (1e-300, 1e-300),
                              (math.nan, R), (math.inf, R), ("1", R)]
ALLOW = [(True, True), (True, True), (False, False), ("no", R)]
THREADS = [(None, None), (1, 1), (2, 2), (-1, R), ("2", R)]
KEYWORDS = (("causal", CAUSAL), ("window", WINDOW), ("chunk", CHUNK), ("softcap", SOFTCAP),
            ("scale", SCALE), ("allow_fully_masked", ALLOW), ("num_threads", THREADS))


class Call:
    """One API call: what is passed (args, kw), what it means (sem), why it must raise
    (refuse), the names of its arguments; run() makes it, expected() gives (ref64, naive32)."""

    def __init__(self, fn_name):
        self.fn_name, self.args, self.kw, self.sem, self.refuse = fn_name, (), {}, {}, []
        self.names = set()

    def put(self, name, shown, meant):
        self.kw[name] = shown
        self.names.add(name)
        if is_refuse(meant):
            self.refuse.append(name)
        elif meant is not None:
            self.sem[name] = meant

    def __repr__(self):
        def short(x):
            if isinstance(x, torch.Tensor):
                vals = f"={x.tolist()}" if x.numel() <= 16 and not x.is_floating_point() else ""
                return f"tensor{tuple(x.shape)}:{x.dtype}:strides{tuple(x.stride())}{vals}"
            if isinstance(x, np.ndarray):
                vals = f"={x.tolist()}" if x.size <= 16 and x.dtype.kind in "iub" else ""
                return f"array{x.shape}:{x.dtype}:strides{x.strides}{vals}"
            if isinstance(x, dict):
                return "{" + ", ".join(f"{k!r}: {short(v)}" for k, v in x.items()) + "}"
            return repr(x)
        args = ", ".join([short(a) for a in self.args] +
                         [f"{k}={short(v)}" for k, v in self.kw.items()])
        return f"{self.fn_name}({args})  [must refuse: {self.refuse}]"


@st.composite
def options(draw, call, batch, lq, lk, masks, fault):
    """Mask, cap, scale and thread keywords (fault "keyword": one without meaning); with `masks`
    also documents, prefix, global tokens and a dense mask (fault "masks": float document ids or
    a negative prefix)."""
    bad = draw(st.sampled_from([n for n, _ in KEYWORDS])) if fault == "keyword" else None
    for name, table in KEYWORDS:
        shown, meant = draw(st.sampled_from([e for e in table if is_refuse(e[1]) == (name == bad)]))
        if shown is not None or draw(st.booleans()):  # None: given explicitly or left out
            call.put(name, shown, meant)
    if not masks:
        return
    bad = draw(st.sampled_from(["documents", "prefix"])) if fault == "masks" else None
    if bad == "documents" or draw(st.integers(0, 3)) == 0:  # ids [batch, seq], sorted as packed
        for name, n in (("query_documents", lq), ("key_documents", lk)):
            d = np.sort(np.array(draw(st.lists(st.integers(0, 2), min_size=batch * n,
                                               max_size=batch * n)), np.int64).reshape(batch, n), 1)
            dt = "float64" if bad == "documents" else draw(st.sampled_from(["int32", "int64"]))
            call.put(name, int_array(d, dt), R if dt == "float64" and d.size else d)
    if bad == "prefix" or draw(st.integers(0, 3)) == 0:  # prefix-LM: per row or per document id
        n = draw(st.integers(1, 3)) if "query_documents" in call.kw else batch
        p = np.array(draw(st.lists(st.integers(0, lk + 1), min_size=n, max_size=n)), np.int64)
        p[-1:] = -1 if bad == "prefix" else p[-1:]
        call.put("prefix", p, R if (p < 0).any() else p)
    if draw(st.integers(0, 3)) == 0:  # a negative one matches no token: harmless either way
        g = draw(st.lists(st.sampled_from([0, 1, 2, 5, 2 ** 31, 0, 1, -1]), max_size=3))
        call.put("global_positions", g, np.array(g, np.int64))
    if draw(st.integers(0, 2)) == 0:  # dense mask: nonzero means "may attend", whatever dtype
        rows = draw(st.sampled_from([batch, 1]))
        bits = np.array(draw(st.lists(st.booleans(), min_size=rows * lq * lk,
                                      max_size=rows * lq * lk)), bool).reshape(rows, lq, lk)
        shown = draw(st.sampled_from([bits, bits.astype(np.uint8), bits.astype(np.int32) * 256,
                                      bits * np.float32(0.5), bits * 2.0]))
        shown = lay_out(shown, draw(st.sampled_from(LAYOUTS)))  # broadcast changes the values
        call.put("mask", shown, np.asarray(shown) != 0)


@st.composite
def positions(draw, batch, seq, default_start, as_torch, bad):
    """(presented, meaning [batch, seq] int64 or R): None (the default), an int offset, or ids
    [seq] / [batch, seq] (ascending with gaps or descending) of several integer dtypes, near
    2^31 and 2^48; `bad`: negative, beyond 2^48 or float ids."""
    mode = draw(st.sampled_from(["default", "offset", "shared", "per_row"][bad:]))
    base = draw(st.sampled_from([-4, MAXPOS + 1] if bad else
                                [0, 3, 2 ** 31 - 4, 2 ** 31, 2 ** 32 + 1, MAXPOS - 80]))
    if mode == "default":
        ids = np.broadcast_to(default_start + np.arange(seq), (batch, seq))
        return None, (R if seq and batch and default_start < 0 else ids)
    if mode == "offset":
        ids, shown = base + np.arange(seq), draw(st.sampled_from([base, np.int64(base)]))
    else:
        rows = batch if mode == "per_row" else 1
        steps = draw(st.lists(st.integers(0, 6), min_size=rows * seq, max_size=rows * seq))
        ids = base + np.cumsum(np.array(steps, np.int64).reshape(rows, seq), 1)
        ids = ids[:, ::-1] if draw(st.booleans()) else ids
        dt = draw(st.sampled_from(["int64", "int32", "uint64"] + ["float64"] * bad))
        shown = int_array(ids[0] if mode == "shared" else ids, dt)
        if dt == "float64" and shown.size:  # (an empty float array holds no wrong value)
            return shown, R
        if as_torch:
            shown = torch.from_numpy(shown.astype(np.int64))
    ids = np.ascontiguousarray(np.broadcast_to(ids, (batch, seq)))
    return shown, (R if ids.size and (ids.min() < 0 or ids.max() > MAXPOS) else ids)


def scheme_tables(draw, scheme, seed, hq, hkv, dim, sinks, **shape):
    """(q, k, v, params, scheme keywords, reference keywords) from conftest.Case; RoPE with an
    even rotary_dim drawn here (Case's needs an even head_dim)."""
    c = Case("none" if scheme == "rope" else scheme, seed, heads_q=hq, heads_kv=hkv, dim=dim,
             variant=draw(st.integers(0, 2)), sinks=sinks, **shape)
    skw = {n: x for n, x in c.kw.items() if n != "causal"}
    rkw = {n: x for n, x in c.ref_kw.items() if n != "causal"}
    if scheme == "rope":
        rot = draw(st.sampled_from([0] * (dim % 2 == 0) + list(range(2, dim + 1, 2))))
        base, style = draw(st.sampled_from([1e4, 500.0])), draw(st.sampled_from(["half",
                                                                                   "interleaved"]))
        skw = {"rotary_dim": rot, "base": base, "style": style}
        f = posenc.rope_frequencies(dim, rotary_dim=rot, base=base)
        rkw = {"rope_inv_freq": torch.from_numpy(f.inv_freq), "rope_style": style}
    return c.q, c.k, c.v, c.params, skw, rkw


def with_tables(call, params, skw, as_torch, dtype):
    if params:
        call.names |= set(params) | {"params"}
        call.kw["params"] = {n: torch.tensor(t, dtype=getattr(torch, dtype)) if as_torch else
                             t.astype(dtype) for n, t in params.items()}
    call.kw.update(skw)
    call.names |= set(skw) | {"scheme"}


# ---- the oracles --------------------------------------------------------------------------------

def visible(pq, pk, sem):
    """[batch, seq_q, seq_k]: may query i see key j (docs/attention.md, Masks and Block masks)."""
    rel = pk[:, None, :] - pq[:, :, None]
    vis = np.ones(rel.shape, bool)
    if sem.get("causal"):
        vis &= rel <= 0
    if "window" in sem:
        vis &= np.abs(rel) < sem["window"]
    if "chunk" in sem:
        vis &= (pk // sem["chunk"])[:, None, :] == (pq // sem["chunk"])[:, :, None]
    qd, kd = sem.get("query_documents"), sem.get("key_documents")
    if "global_positions" in sem:  # global tokens see and are seen by all (of their document)
        g = sem["global_positions"]
        vis |= np.isin(pq, g)[:, :, None] | np.isin(pk, g)[:, None, :]
    if "prefix" in sem:  # keys before the prefix length (of the row, or of the key's document)
        p = sem["prefix"]
        if kd is not None and kd.size and kd.max() >= len(p):
            raise Refuse("a key's document has no prefix entry")
        plen = p[kd] if kd is not None else np.broadcast_to(p[:, None], pk.shape)
        vis |= (pk < plen)[:, None, :]
    if qd is not None:
        vis &= qd[:, :, None] == kd[:, None, :]
    return vis & sem["mask"] if "mask" in sem else vis


def oracle(e, q, k, v, params, sem, pq, pk):
    """(ref64, naive32) of one batched problem (float64 values [B, L, H, D], explicit positions):
    posenc.ref.attention, checked against the PyTorch reference, whose float32 run is the naive
    path of tol32. Raises Refuse when the inputs have no result."""
    vis = visible(pq, pk, sem)
    if "sinks" not in params and not sem.get("allow_fully_masked") and (~vis.any(-1)).any():
        raise Refuse("a query row sees no key")
    kw = {n: x for n, x in sem.items() if n != "num_threads"}
    try:
        ref64 = posenc.ref.attention(q, k, v, e["scheme"], params=params or None,
                                     query_positions=pq, key_positions=pk, **e["skw"], **kw)
    except ValueError as err:
        raise Refuse(f"posenc.ref: {err}") from None
    if 0 in q.shape[:2] or k.shape[1] == 0:
        return ref64, None

    def run(dt):
        rk = {n: (x.to(dt) if isinstance(x, torch.Tensor) else x) for n, x in e["rkw"].items()}
        if e["scheme"] == "t5":  # the masks go in as `mask`: T5's direction follows causal
            rk.setdefault("bidirectional", not sem.get("causal"))
        cap = sem.get("softcap")
        if cap is not None and dt == torch.float32:
            # Float32 holds no cap beyond [1e-30, 1e30]: scores capped at 1e-30 are ~0 already
            # and a 1e30 cap is the identity on float32 scores, so the naive path clamps it.
            cap = min(max(cap, 1e-30), 1e30)
        return reference.attention(
            *(torch.tensor(np.ascontiguousarray(x), dtype=dt) for x in (q, k, v)), e["scheme"],
            {n: torch.tensor(t, dtype=dt) for n, t in params.items()}, scale=sem.get("scale"),
            query_positions=torch.tensor(pq), key_positions=torch.tensor(pk),
            mask=torch.tensor(vis), allow_fully_masked=True, softcap=cap, **rk).numpy()
    torch64, naive32 = run(torch.float64), run(torch.float32)
    # The two float64 oracles agree to float64 rounding: 1e-9, plus a thousandth of the float32
    # error where large biases or positions make even float64 lose digits.
    cross = 1e-9 * max(1.0, float(np.abs(torch64).max())) + 1e-3 * maxerr(naive32, torch64)
    assert maxerr(ref64, torch64) <= cross, \
        f"posenc.ref and the PyTorch reference differ by {maxerr(ref64, torch64):.3g}"
    return ref64, naive32


def assert_close(out, ref64, naive32, kind):
    """float64: the reference itself; float32: tol32 (2 max|naive32 - ref| + 2e-6 max(1, |ref|));
    bf16 / f16 out: plus half an ulp of the output type (docs/precision.md)."""
    assert tuple(out.shape) == ref64.shape, f"shape {tuple(out.shape)}, expected {ref64.shape}"
    got = out.to(torch.float64).numpy() if isinstance(out, torch.Tensor) else (
        posenc.bf16_to_float32(out).astype(np.float64) if out.dtype == np.uint16
        else np.asarray(out, np.float64))
    scale = max(1.0, float(np.abs(ref64).max()))
    tol = 1e-10 * scale if kind == "f64" else \
        tol32(ref64, naive32) if naive32 is not None else 2e-6 * scale
    if kind in HALF:
        tol = tol + 0.5 * ulp(np.maximum(np.abs(ref64), np.abs(got)), kind)
    err = np.abs(got - ref64)
    bad = ~(err <= tol)
    assert not bad.any(), (f"{int(bad.sum())} of {err.size} elements off, max error "
                           f"{np.nanmax(np.where(np.isnan(err), np.inf, err)):.3g}, tolerance "
                           f"{np.min(tol):.3g}, first at {np.argwhere(bad)[0].tolist()}")


# ---- posenc.attention, attention_half, posenc.torch.attention, the half op ----------------------

FRONTENDS = ("numpy", "torch", "numpy", "torch", "numpy_half", "torch_op_half")


@st.composite
def qkv_dtypes(draw, front, half, fault):
    """Dtypes of q, k, v (fault "dtype": one complex, or for attention_half one that is not half
    bits). attention_half takes any 2-byte integer array as raw bits; a float16 array is no bf16,
    float64 is refused, float32 is only for q (the mixed kernel). The half op takes half k; q and
    v may be of another type (read as k's type they would be garbage)."""
    hb = {"bfloat16": "bf16", "float16": "f16"}[half]
    if front == "numpy_half":
        bits = (hb, "bf16i") if half == "bfloat16" else (hb, "f16bits", "bf16")
        dts = [draw(st.sampled_from(bits + ("float32",)))] + \
            [draw(st.sampled_from(bits)) for _ in range(2)]
        wrong = ("float64",) + (("f16",) if half == "bfloat16" else ())
    elif front == "torch_op_half":
        return [draw(st.sampled_from((hb, "float32", "bf16", "f16"))), hb,
                draw(st.sampled_from((hb, hb, "bf16", "f16")))], ()
    else:
        plain = ("float32",) * 3 + ("float64", "f16", "int32") + (("bf16",) if
                                                                  front == "torch" else ())
        dts, wrong = [draw(st.sampled_from(plain)) for _ in range(3)], ("complex64",)
    if fault == "dtype":
        i = draw(st.integers(0, 2))
        dts[i] = draw(st.sampled_from(wrong + (("float32",) if i and wrong[0] != "complex64"
                                               else ())))
    return dts, wrong + (("float32",) if front == "numpy_half" else ())


@st.composite
def attention_calls(draw):
    front, half = draw(st.sampled_from(FRONTENDS)), draw(st.sampled_from(HALF))
    fault = faults(draw, "keyword", "positions", "dtype", "heads", "masks", "packing")
    scheme = draw(st.sampled_from(SCHEMES))
    hkv, group = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    hq = hkv * group + (fault == "heads" and hkv > 1)  # heads_kv not dividing heads_q
    dim = draw(st.integers(2 if scheme == "rope" else 1, 40))
    seqs = None
    if front in ("numpy", "torch") and (fault == "packing" or draw(st.integers(0, 5)) == 0):
        # cu_seqlens: sequences of lq_s queries and lk_s keys packed as [total, heads, dim]
        seqs = draw(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 7)), max_size=3))
        b, lq, lk = 1, sum(a for a, _ in seqs), sum(c for _, c in seqs)
    else:
        b, lq, lk = draw(st.integers(0, 3)), draw(st.integers(0, 9)), draw(st.integers(0, 70))
    q, k, v, params, skw, rkw = scheme_tables(draw, scheme, draw(st.integers(0, 2 ** 16)), hq,
                                              hkv, dim, draw(st.integers(0, 3)) == 0, batch=b,
                                              seq_q=lq, seq_k=lk)
    call, as_torch = Call(front), front.startswith("torch")
    draw(options(call, b, lq, lk, front != "torch_op_half" and seqs is None, fault))
    if seqs is None:
        bad = fault == "positions" and draw(st.integers(0, 1))
        for i, (name, n, start) in enumerate((("query_positions", lq, lk - lq),
                                              ("key_positions", lk, 0))):
            call.put(name, *draw(positions(b, n, start, as_torch, fault == "positions" and
                                           i == bad)))
    dts, wrong = draw(qkv_dtypes(front, half, fault))
    shown, meant = [], []
    for i, (x, dt, name) in enumerate(zip((q, k, v), dts, "qkv")):
        a, m = present(x[0] if seqs is not None else x, dt, draw(st.sampled_from(LAYOUTS)),
                       as_torch)
        if front == "numpy_half" and dt in wrong and (i or dt != "float32"):
            m = None
        elif front == "numpy_half" and dt == "bf16" and half == "float16":
            m = a.view(np.float16).astype(np.float64)  # bits are read as the dtype says
        shown.append(a)
        meant.append(m if m is None or seqs is None else m[None])
        call.names.add(name)
        if m is None:
            call.refuse.append(name)
    if seqs is not None:
        cq, ck = (np.cumsum([0] + [s[i] for s in seqs]) for i in (0, 1))
        if fault == "packing" and len(cq) > 2:  # not non-decreasing
            cq[1], cq[2] = cq[2] + 1, cq[1]
            call.refuse.append("cu_seqlens_q")
        dt = draw(st.sampled_from(["int32", "int64"]))
        for name, cu in (("cu_seqlens_q", cq), ("cu_seqlens_k", ck)):
            call.put(name, torch.from_numpy(cu) if as_torch else cu.astype(dt), None)
    # What is computed and returned: NumPy float64 q runs the reference, others float32;
    # attention_half gives the half bits (bf16 as uint16); torch gives q's dtype.
    if front == "numpy":
        call.kind = "f64" if dts[0] == "float64" else "f32"
    elif front == "numpy_half":
        call.kind = "f32" if dts[0] == "float32" else half
    else:
        call.kind = {"float64": "f64", "bf16": "bfloat16", "f16": "float16"}.get(dts[0], "f32")
    call.out_dtype = {"f64": "float64", "f32": "float32"}.get(call.kind, call.kind)
    if front == "numpy_half" and call.kind == "bfloat16":
        call.out_dtype = "uint16"
    comp = "f64" if call.kind == "f64" else "f32"
    with_tables(call, params, skw, as_torch, "float64" if comp == "f64" else "float32")
    call.args = shown
    if front == "numpy":
        call.run = lambda: posenc.attention(*shown, scheme, **call.kw)
    elif front == "numpy_half":
        call.names.add("dtype")
        call.run = lambda: posenc.attention_half(*shown, scheme, dtype=half, **call.kw)
    elif front == "torch":
        call.run = lambda: pt.attention(*shown, scheme, **call.kw)
    else:
        def run_op():  # the op itself: typed arguments (int offsets as <name>_offset, ids as
            # tensors), each scalar through the bindings' checker (posenc._ops.typed)
            kw = {n: x for n, x in call.kw.items() if n != "params"}
            pos = [kw.pop(n, None) for n in ("query_positions", "key_positions")]
            for n, p in zip(("query_positions", "key_positions"), pos):
                if isinstance(p, (int, np.integer)):
                    kw[n] = p
            pos = [torch.from_numpy(p) if isinstance(p, np.ndarray) else
                   p if isinstance(p, torch.Tensor) else None for p in pos]
            names = sorted(call.kw.get("params", {}))
            typed = _ops.typed("attention_half", {**kw, "scheme": scheme}, "attention_half")
            return torch.ops.posenc.attention_half(*shown, [call.kw["params"][n] for n in names],
                                                   names, *pos, **typed)
        call.run = run_op
    e = dict(scheme=scheme, skw=skw, rkw=rkw)
    call.expected = lambda: expect_attention(call, e, [rounded(m, comp) for m in meant],
                                             {n: rounded(t, comp) for n, t in params.items()},
                                             seqs)
    return call


def expect_attention(call, e, qkv, params, seqs):
    sem = dict(call.sem)
    pq, pk = sem.pop("query_positions", None), sem.pop("key_positions", None)
    if seqs is None:
        return oracle(e, *qkv, params, sem, pq, pk)
    q, k, v = qkv  # each packed sequence alone (positions restart), then concatenated
    refs, naives, at_q, at_k = [], [], 0, 0
    for lq, lk in seqs:
        sq, sk = slice(at_q, at_q + lq), slice(at_k, at_k + lk)
        at_q, at_k = at_q + lq, at_k + lk
        if lq == 0:
            continue
        if 0 < lk < lq:
            raise Refuse("a sequence with more queries than keys, default positions")
        r, n = oracle(e, q[:, sq], k[:, sk], v[:, sk], params, sem,
                      np.arange(lk - lq, lk)[None] if lk else np.zeros((1, lq), np.int64),
                      np.arange(lk)[None])
        refs.append(r[0])
        naives.append(r[0] if n is None else n[0])
    ref64 = np.concatenate(refs) if refs else np.zeros((0,) + q.shape[2:])
    return ref64, (np.concatenate(naives) if naives else ref64)


@FUZZ
@given(call=attention_calls())
def test_attention(call):
    """posenc.attention (NumPy and torch, packed or batched), attention_half and the half op."""
    with torch.no_grad():
        check(call)


# ---- paged KV caches: attention_paged and rope_append --------------------------------------------

@st.composite
def block_table(draw, call, rng, need, max_pages, num_pages, as_torch, fault):
    """Distinct pages for the entries in use, anything elsewhere (only used entries are read);
    fault "table": the last used entry outside the pool, negative, 2^32 more (an int32 cast
    wraps it back into the pool), or the table as floats."""
    table = np.full((len(need), max_pages), draw(st.sampled_from([-1, 0, 10 ** 6, -1, 2 ** 40])))
    order, at = rng.permutation(num_pages), 0
    for b, n in enumerate(need):
        table[b, :n] = order[at:at + n]
        at += n
    meant, used = table.copy(), [(b, n - 1) for b, n in enumerate(need) if n]
    bad = draw(st.sampled_from(["outside", "negative", "wrap32", "float"])) if fault else None
    if bad and used:
        b, j = used[-1]
        table[b, j] = {"outside": num_pages, "negative": -1, "wrap32": table[b, j] + 2 ** 32,
                       "float": table[b, j]}[bad]
        meant = R
    dt = "float64" if bad == "float" else draw(st.sampled_from(["int32", "int64", "uint64",
                                                                "int16"]))
    shown = int_array(table, dt)
    if as_torch and draw(st.booleans()):
        shown = torch.from_numpy(shown.astype(np.float64 if dt == "float64" else np.int64))
    call.put("block_table", shown, meant)


@st.composite
def seq_lens(draw, call, lens, capacity, as_torch, fault):
    """seq_lens; fault "lens": the last beyond the table's pages, negative, or 2^32 more."""
    shown, meant = np.array(lens, np.int64), np.array(lens, np.int64)
    if fault and len(lens):
        bad = draw(st.sampled_from(["too_long", "negative", "wrap32"]))
        shown[-1] = {"too_long": capacity + 1, "negative": -1, "wrap32": lens[-1] + 2 ** 32}[bad]
        meant = R
    shown = int_array(shown, draw(st.sampled_from(["int32", "int64", "uint64"])))
    if as_torch and draw(st.booleans()):
        shown = torch.from_numpy(shown.astype(np.int64))
    call.put("seq_lens", shown, meant)


def make_pool(rng, shape, layout, ptype, extra, as_torch):
    """A page pool of token-major shape [num_pages, page_size, heads_kv, head_dim], laid out as
    `layout` and sliced [..., :head_dim] out of a wider buffer (k and v pools get different
    strides): (the pool, the wider buffer, float64 values token-major)."""
    n, ps, h, d = shape
    wide = rng.standard_normal((n, h, ps, d + extra) if layout == "head_major" else
                               (n, ps, h, d + extra))
    base, values = present(wide, {"float32": "float32", "bfloat16": "bf16",
                                  "float16": "f16"}[ptype], "contiguous", as_torch)
    values = values[..., :d]
    return base[..., :d], base, values.transpose(0, 2, 1, 3) if layout == "head_major" else values


@st.composite
def cache(draw, call, as_torch, rng, max_len, fault, min_len=0, min_rows=None):
    """A paged cache's layout, page type and size, row lengths and pool size, with its block
    table and seq_lens put in the call."""
    layout = draw(st.sampled_from(("token_major", "head_major")))
    ptype, ps = draw(st.sampled_from(("float32",) + HALF)), draw(st.integers(1, 5))
    min_rows = draw(st.sampled_from([1, 1, 1, 0])) if min_rows is None else min_rows
    lens = draw(st.lists(st.integers(min_len, max_len), min_size=min_rows, max_size=3))
    need = [-(-n // ps) for n in lens]
    max_pages = max(need, default=0) + draw(st.integers(0, 1)) or 1
    num_pages = sum(need) + draw(st.integers(0, 2)) or 1
    draw(block_table(call, rng, need, max_pages, num_pages, as_torch, fault == "table"))
    draw(seq_lens(call, lens, max_pages * ps, as_torch, fault == "lens"))
    call.names |= {"k_pages", "v_pages", "layout"}
    return layout, ptype, ps, lens, num_pages


@st.composite
def paged_calls(draw):
    front = draw(st.sampled_from(("numpy", "torch")))
    call, as_torch = Call("attention_paged " + front), front == "torch"
    fault = faults(draw, "keyword", "positions", "q", "table", "lens")
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 16)))
    layout, ptype, ps, lens, num_pages = draw(cache(call, as_torch, rng, 13, fault))
    scheme = draw(st.sampled_from(SCHEMES))
    hkv, group, seq_q = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(0, 3))
    dim, batch = draw(st.integers(2 if scheme == "rope" else 1, 20)), len(lens)
    q, _, _, params, skw, rkw = scheme_tables(draw, scheme, int(rng.integers(2 ** 16)),
                                              hkv * group, hkv, dim, draw(st.integers(0, 3)) == 0,
                                              batch=batch, seq_q=seq_q, seq_k=1)
    draw(options(call, batch, seq_q, None, False, fault))
    shown, ids = draw(positions(batch, seq_q, 0, as_torch, fault == "positions"))
    if shown is None:  # default: the last seq_q cached tokens (rows without keys: irrelevant)
        ids = np.maximum(np.array(lens, np.int64)[:, None] - seq_q, 0) + np.arange(seq_q)
        ids = R if [n for n in lens if 0 < n < seq_q] else ids.reshape(batch, seq_q)
    call.put("query_positions", shown, ids)
    kp, _, kvals = make_pool(rng, (num_pages, ps, hkv, dim), layout, ptype,
                             draw(st.integers(0, 3)), as_torch)
    vp, _, vvals = make_pool(rng, (num_pages, ps, hkv, dim), layout, ptype,
                             draw(st.integers(0, 3)), as_torch)
    # q: float32 (float32 out) or the pages' half type (half out); float64 and int32 are float32
    # after rounding (or refused); fault "q": complex, or in NumPy the other half type's bits.
    hb = {"bfloat16": "bf16", "float16": "f16"}.get(ptype, "f16")
    plain = ("float32",) * 6 + ("float64", "int32") + (hb,) * (4 if ptype in HALF else 1)
    qdt = draw(st.sampled_from(("complex64",) + ("f16",) * (not as_torch and hb == "bf16")
                               if fault == "q" else plain + ("bf16", "f16") * as_torch))
    qa, qm = present(q, qdt, draw(st.sampled_from(LAYOUTS)), as_torch)
    qm = None if fault == "q" else qm
    call.kind = {"bf16": "bfloat16", "f16": "float16"}.get(qdt, "f32")
    if not as_torch and (ptype == "float32" or qdt != hb):
        call.kind = "f32"  # NumPy half bits are q's type only with half pages
    call.out_dtype = {"f32": "float32", "bfloat16": "uint16" if not as_torch else "bfloat16",
                      "float16": "float16"}[call.kind]
    call.names.add("q")
    if qm is None:
        call.refuse.append("q")
    with_tables(call, params, skw, as_torch, "float64")
    table, lens_ = call.kw.pop("block_table"), call.kw.pop("seq_lens")
    call.args = (qa, kp, vp, table, lens_)
    if as_torch:
        call.run = lambda: pt.attention_paged(*call.args, scheme, layout=layout, **call.kw)
    else:
        call.names.add("dtype")
        call.run = lambda: posenc.attention_paged(*call.args, scheme, layout=layout, dtype=None
                                                  if ptype == "float32" else ptype, **call.kw)
    e = dict(scheme=scheme, skw=skw, rkw=rkw)

    def expected():  # the oracle on each row's keys gathered from its pages
        sem = dict(call.sem)
        table, pq = sem.pop("block_table"), sem.pop("query_positions")
        q = rounded(qm, "f32")
        tables = {n: rounded(t, "f32") for n, t in params.items()}
        refs, naives = [], []
        for b, n in enumerate(sem.pop("seq_lens")):
            j = np.arange(n)
            pages, slots = table[b, j // ps], j % ps
            r, nv = oracle(e, q[b:b + 1], kvals[pages, slots][None], vvals[pages, slots][None],
                           tables, sem, pq[b:b + 1], j[None])
            refs.append(r)
            naives.append(r if nv is None else nv)
        ref64 = np.concatenate(refs) if refs else np.zeros(q.shape)
        return ref64, (np.concatenate(naives) if naives else ref64)
    call.expected = expected
    return call


@FUZZ
@given(call=paged_calls())
def test_attention_paged(call):
    """posenc.attention_paged and posenc.torch.attention_paged against the gathered keys."""
    with torch.no_grad():
        check(call)


def raw(a):
    """The bits of a pool buffer (NumPy or torch) as a NumPy integer array (a copy)."""
    if isinstance(a, torch.Tensor):
        return a.view({2: torch.int16, 4: torch.int32}[a.element_size()]).numpy().copy()
    return np.array(a).view(f"i{a.itemsize}")


@st.composite
def append_calls(draw):
    front = draw(st.sampled_from(("numpy", "torch")))
    call, as_torch = Call("rope_append " + front), front == "torch"
    fault = faults(draw, "table", "lens", "pool", "k_new", "positions", "n_new")
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 16)))
    n_new = draw(st.sampled_from([1, 2, 3, 0]))  # fault "n_new": rows may hold fewer tokens
    layout, ptype, ps, lens, num_pages = draw(cache(call, as_torch, rng, 10, fault,
                                                    0 if fault == "n_new" else n_new, 1))
    hkv, batch = draw(st.integers(1, 2)), len(lens)
    if any(n < n_new for n in lens):
        call.refuse.append("seq_lens")  # fewer cached tokens than new ones
    dim = draw(st.sampled_from([2, 4, 6, 8, 12, 16, 1, 5]))  # odd: no full rotation
    pools = [make_pool(rng, (num_pages, ps, hkv, dim), layout, ptype, draw(st.integers(0, 2)),
                       as_torch) for _ in range(1 + draw(st.booleans()))]
    if fault == "pool" and not as_torch:  # pages that cannot be written in place
        bad = pools[0][0].astype(np.float64) if ptype == "float32" else pools[0][0].copy()
        bad.flags.writeable = ptype == "float32"
        pools[0] = (bad,) + pools[0][1:]
        call.refuse.append("k_pages")
    hb = {"bfloat16": "bf16", "float16": "f16"}.get(ptype, "float32")
    dt = draw(st.sampled_from(("complex64",) if fault == "k_new" else
                              ("float32",) * 3 + (hb, hb, "float64")))
    new = [present(rng.standard_normal((batch, n_new, hkv, dim)), dt,
                   draw(st.sampled_from(LAYOUTS)), as_torch) for _ in pools]
    call.names |= {"k_new", "v_new"}
    if new[0][1] is None:
        call.refuse.append("k_new")
    if len(pools) == 2:
        call.kw.update(v_new=new[1][0], v_pages=pools[1][0])
    rope = {"base": draw(st.sampled_from([1e4, 500.0])),
            "style": draw(st.sampled_from(["half", "interleaved"]))}
    if draw(st.booleans()):
        rope["rotary_dim"] = draw(st.sampled_from(list(range(0, dim + 1, 2))))
    call.kw.update(rope, layout=layout)
    call.names |= set(rope) | {"rotary_dim"}  # defaulted, an argument all the same
    shown, ids = draw(positions(batch, n_new, 0, as_torch, fault == "positions"))
    if shown is None:  # default: the slots' own indices
        ids = np.array([[max(n - n_new, 0) + i for i in range(n_new)] for n in lens], np.int64)
        ids = ids.reshape(batch, n_new)
    call.put("positions", shown, ids)
    table, lens_ = call.kw.pop("block_table"), call.kw.pop("seq_lens")
    call.args = (new[0][0], pools[0][0], table, lens_)
    if as_torch:
        call.run = lambda: pt.rope_append(*call.args, **call.kw)
    else:
        call.names.add("dtype")
        call.run = lambda: posenc.rope_append(*call.args, dtype=None if ptype == "float32"
                                              else ptype, **call.kw)
    call.pools, call.ptype, call.rope, call.ps, call.layout = pools, ptype, rope, ps, layout
    call.nothing = batch * n_new == 0
    call.new = [rounded(m, "f32") if m is not None else None for _, m in new]
    return call


@FUZZ
@given(call=append_calls())
def test_rope_append(call):
    """rope_append writes the rotated keys and the values into exactly their slots, rounded once
    to the pages' type, and a refused call (or one with nothing to append) writes nothing."""
    bases = [p[1] for p in call.pools]
    before = [raw(b) for b in bases]
    try:
        call.run()
    except Exception as e:  # noqa: BLE001 - the property classifies every exception
        assert_refusal(e, call.names)
        call.nothing = True
    if call.nothing:
        for b, old in zip(bases, before):
            assert np.array_equal(raw(b), old), "refused or had nothing to append, yet wrote"
        return
    assert not call.refuse, f"accepted {call.refuse}, which must be refused"
    table, lens, pos = call.sem["block_table"], call.sem["seq_lens"], call.sem["positions"]
    try:
        rot = posenc.ref.apply_rope(call.new[0], positions=pos, **call.rope)
    except ValueError as e:
        raise AssertionError(f"accepted RoPE settings posenc.ref refuses: {e}") from None
    want = [rot] + [rounded(v, call.ptype) for v in call.new[1:]]  # values: rounded once
    n_new, dim = rot.shape[1], rot.shape[3]
    for base, old, w in zip(bases, before, want):
        vals = (base.to(torch.float64).numpy() if isinstance(base, torch.Tensor) else
                posenc.bf16_to_float32(base).astype(np.float64) if call.ptype == "bfloat16"
                else base.astype(np.float64))
        written = np.zeros(vals.shape, bool)
        for b, n in enumerate(lens):
            for i in range(n_new):
                j = n - n_new + i
                at = (table[b, j // call.ps], j % call.ps, slice(None), slice(dim))
                at = (at[0], at[2], at[1], at[3]) if call.layout == "head_major" else at
                written[at] = True
                got, exact = vals[at], w[b, i]
                # keys: apply_rope's float32 result (within 1 ulp of float64, docs/precision.md)
                # rounded once more to half pages; values: copied, rounded once
                tol = 0.0 if w is not rot else ulp(exact, "f32") + (
                    0.5 * ulp(exact, call.ptype) if call.ptype in HALF else 0.0)
                assert np.all(np.abs(got - exact) <= tol), (
                    f"{'k' if w is rot else 'v'} of row {b} token {i}: max error "
                    f"{np.max(np.abs(got - exact)):.3g} (tolerance {np.max(tol):.3g})")
        assert np.array_equal(raw(base)[~written], old[~written]), "wrote outside its slots"
