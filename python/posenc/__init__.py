"""posenc: transformer positional encodings for NumPy and PyTorch.

Every encoding of the C++ library (sinusoidal, learned, RoPE with every scaling type, ALiBi, T5
bias, Shaw, Transformer-XL, DeBERTa), fused float32 attention with each of them and its fused
backward, and the float64 reference (``posenc.ref``). PyTorch autograd functions and modules are
in ``posenc.torch`` (imported on demand; needs torch).

Arrays: float32 inputs run the optimized kernels, float64 ones the float64 reference; arrays of
the dtype a function computes in are used in place (any non-negative strides), anything else is
converted once with ``numpy.ascontiguousarray``. Half precision: attention_half and
apply_rope_half (bf16 as np.uint16 bits, f16 as np.float16; bf16_from_float32 and
bf16_to_float32 convert). Errors raise ``posenc.Error`` (a ValueError) or its subclasses
``ShapeError``, ``InvalidValueError``, ``IoError`` with the library's message; wrong argument
types raise TypeError. Kernels run without the GIL.

See docs/python.md.
"""

from collections import namedtuple as _namedtuple

from . import _posenc
from ._posenc import (  # noqa: F401  (the public API)
    Error,
    InvalidValueError,
    IoError,
    LayerRopeFrequencies,
    ModelConfig,
    RopeFrequencies,
    ShapeError,
    __version__,
    add_learned,
    add_sinusoidal,
    alibi_slopes,
    apply_mrope,
    apply_rope,
    apply_rope_qk,
    attention,
    attention_grad,
    attention_merge,
    deberta_bucket,
    deberta_c2p_index,
    deberta_p2c_index,
    describe,
    learned_backward,
    read_model_config,
    rerotate_rope,
    rope_frequencies,
    rope_inverse,
    shaw_index,
    sinusoidal_encode,
    sinusoidal_frequencies,
    sinusoidal_table,
    t5_bucket,
    t5_bucket_map,
    xl_sinusoid,
)
from . import ref  # noqa: F401,E402

from ._posenc import schemes  # noqa: F401,E402  (the registry: one dict per scheme)

SCHEMES = tuple(s["name"] for s in schemes())

CheckRow = _namedtuple("CheckRow", "property scheme measured threshold expect passed")
CheckRow.__doc__ = ("One measured claim of `posenc check`: the property, the scheme, the measured "
                    "value, the threshold, how they compare (expect) and whether it passed.")

RopePrecisionRow = _namedtuple("RopePrecisionRow",
                               "position accurate_error float32_error float32_angle_error")


def check(seed=None):
    """The seeds' claims, measured with the float64 reference (what `posenc check` prints).

    Returns a list of CheckRow(property, scheme, measured, threshold, expect, passed).
    """
    rows = _posenc._run_checks() if seed is None else _posenc._run_checks(int(seed))
    return [CheckRow(*r) for r in rows]


def rope_precision(positions=(1 << 16, 1 << 20, 1 << 24), head_dim=128, base=5e5, seed=1):
    """RoPE angle precision at large positions (`posenc rope-precision`, docs/precision.md).

    Returns RopePrecisionRow(position, accurate_error, float32_error, float32_angle_error) rows:
    max |float32 output - float64 reference| with accurate angles and with the frameworks'
    float32 recipe, and the float32 angle error itself.
    """
    rows = _posenc._rope_precision([int(p) for p in positions], int(head_dim), float(base),
                                   int(seed))
    return [RopePrecisionRow(*r) for r in rows]


# ---- half precision (bf16, f16) ---------------------------------------------------------------

_HALF_DTYPES = ("bfloat16", "float16")


def _half_dtype(dtype):
    if not isinstance(dtype, str) or dtype not in _HALF_DTYPES:
        raise InvalidValueError(f"dtype: {dtype!r} ('bfloat16' or 'float16')")
    return dtype


def _half_in(x, what, dtype):
    """x for the half bindings: bf16 must not come as np.float16 (those bits are f16)."""
    import numpy as np
    if dtype == "bfloat16" and isinstance(x, np.ndarray) and x.dtype == np.float16:
        raise TypeError(f"{what}: a float16 array for dtype='bfloat16' (bf16 travels as uint16 "
                        "bits: posenc.bf16_from_float32(x.astype(np.float32)))")
    return x


def _half_out(bits, dtype):
    """The bindings' uint16 bits as the dtype's NumPy type (float16: a view, no copy)."""
    import numpy as np
    return bits.view(np.float16) if dtype == "float16" and bits.dtype == np.uint16 else bits


def attention_half(q, k, v, scheme=None, *, dtype, **kwargs):
    """Attention in half precision: ``posenc.attention`` on bf16 or f16 arrays.

    dtype: 'float16' (np.float16 arrays in and out) or 'bfloat16' (NumPy has no bfloat16: arrays
    of np.uint16 holding the bf16 bits, in and out; see bf16_from_float32 / bf16_to_float32).
    Any 2-byte array is taken as raw bits (float16, uint16, int16), except that a float16 array
    with dtype='bfloat16' is a TypeError. q float32 with half k and v (a half KV cache) runs the
    mixed kernel and returns float32. Arrays whose strides are non-negative multiples of 2 bytes
    are read in place (no copy); the output is a new C-contiguous array.

    The result is exactly ``posenc.attention`` of the widened (float32) inputs, rounded once to
    the dtype (round to nearest even). Every keyword of posenc.attention applies (scheme
    settings, causal, scale, window, chunk, positions, params, config, layer, num_threads,
    allow_fully_masked) except return_lse and out (TypeError). Tables in params stay float32.
    """
    dtype = _half_dtype(dtype)
    out = _posenc._attention_half(_half_in(q, "q", dtype), _half_in(k, "k", dtype),
                                  _half_in(v, "v", dtype), scheme, dtype=dtype, **kwargs)
    return _half_out(out, dtype)


def apply_rope_half(x, freqs=None, *, dtype, inplace=False, **kwargs):
    """RoPE in half precision: ``posenc.apply_rope`` on a bf16 or f16 array.

    dtype and the array conventions as attention_half: np.float16 for 'float16', np.uint16 bits
    for 'bfloat16'. Keywords: those of apply_rope (style, positions, inverse, num_threads,
    rotary_dim, base, scaling, seq_len, angles, config) except out. Returns a new array, or x
    itself with inplace=True (x must then be a writable 2-byte array with non-negative strides).
    The result is exactly apply_rope of the widened (float32) x, rounded once to the dtype.
    """
    dtype = _half_dtype(dtype)
    y = _posenc._apply_rope_half(_half_in(x, "x", dtype), freqs, dtype=dtype, inplace=inplace,
                                 **kwargs)
    return x if inplace else _half_out(y, dtype)


def attention_paged(q, k_pages, v_pages, block_table, seq_lens, scheme=None, *,
                    layout="token_major", dtype=None, **kwargs):
    """Attention over a paged KV cache (vLLM / FlashInfer style): ``posenc.attention`` of q over
    each row's cached keys, read from their pages in place.

    k_pages, v_pages: layout 'token_major' [num_pages, page_size, heads_kv, head_dim] or
    'head_major' [num_pages, heads_kv, page_size, head_dim]; float32 (dtype=None) or the bits of
    bf16 / f16 pages (dtype='bfloat16' / 'float16', as attention_half takes them). block_table
    [batch, max_pages] and seq_lens [batch] integers: key j of row b is in page
    block_table[b, j // page_size] at slot j % page_size, at position j, for j < seq_lens[b].
    q [batch, seq_q, heads_q, head_dim]: float32 (out float32) or, with half pages, the same half
    type (out half). Default query positions seq_lens[b] - seq_q + i (the new tokens' keys are in
    the cache already). Every keyword of posenc.attention applies (scheme settings, causal, scale,
    window, chunk, query_positions, params, config, layer, num_threads, allow_fully_masked)
    except key_positions, out and return_lse. With scheme='rope' the pages hold unrotated keys;
    pages written by rope_append hold rotated keys: attend them with scheme None and a q rotated
    by apply_rope at its positions. The result equals posenc.attention on the gathered keys.
    """
    if dtype is not None:
        dtype = _half_dtype(dtype)
        q = _half_in(q, "q", dtype)
        k_pages = _half_in(k_pages, "k_pages", dtype)
        v_pages = _half_in(v_pages, "v_pages", dtype)
    out = _posenc._attention_paged(q, k_pages, v_pages, block_table, seq_lens, scheme,
                                   layout=layout, dtype=dtype, **kwargs)
    return _half_out(out, dtype) if dtype is not None else out


def rope_append(k_new, k_pages, block_table, seq_lens, *, v_new=None, v_pages=None,
                layout="token_major", dtype=None, positions=None, **kwargs):
    """Writes new keys, rotated by RoPE, (and values, copied) into their page slots, in place.

    k_new (v_new) [batch, n_new, heads_kv, head_dim]: float32, or with dtype='bfloat16' /
    'float16' also the half bits. seq_lens counts the new tokens: token i of row b goes to cache
    index j = seq_lens[b] - n_new + i (page block_table[b, j // page_size], slot j %
    page_size), at position j unless positions ([n_new] or [batch, n_new]) says otherwise. The
    pages (layout and dtype as attention_paged) must be writable arrays (no copy). Keys are
    rotated as apply_rope rotates them and rounded once to the pages' type. RoPE keywords as
    apply_rope: freqs, style, rotary_dim, base, scaling, seq_len (default: max(seq_lens)),
    angles, config, plus offset (first rotated dim) and num_threads. Returns None.
    """
    if dtype is not None:
        dtype = _half_dtype(dtype)
        k_pages = _half_in(k_pages, "k_pages", dtype)
        if v_pages is not None:
            v_pages = _half_in(v_pages, "v_pages", dtype)
    _posenc._rope_append(k_new, k_pages, block_table, seq_lens, v_new=v_new, v_pages=v_pages,
                         layout=layout, dtype=dtype, positions=positions, **kwargs)


def bf16_from_float32(a):
    """float32 values -> bf16 bits (np.uint16 array of a's shape): round to nearest, ties to
    even; overflow gives infinity; NaN stays NaN (quiet, sign kept). Other dtypes are converted
    to float32 first."""
    import numpy as np
    x = np.ascontiguousarray(a, dtype=np.float32).reshape(-1)  # 1-D: array (not scalar) math
    u = x.view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16  # carries into the exponent: overflow -> inf
    quiet_nan = (u >> 16) | 0x40
    return np.where(np.isnan(x), quiet_nan, rounded).astype(np.uint16).reshape(np.shape(a))


def bf16_to_float32(bits):
    """bf16 bits (np.uint16, or int16 holding the same bits) -> float32 values, exactly."""
    import numpy as np
    b = np.asarray(bits)
    if b.dtype.kind not in "iu":
        raise TypeError(f"bits: an integer array of bf16 bits (uint16), got dtype {b.dtype}")
    if b.dtype.itemsize == 2:
        b = b.view(np.uint16)
    elif b.size and (b.min() < 0 or b.max() > 0xFFFF):
        raise InvalidValueError("bits: values must be in [0, 65535] (16-bit patterns)")
    return (b.astype(np.uint32).reshape(-1) << 16).view(np.float32).reshape(b.shape)


def _cli():
    """The posenc command-line tool shipped with the package (posenc/bin/posenc), else
    $POSENC_CLI, else `posenc` on PATH."""
    import os
    import shutil
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin", "posenc")
    for path in (here, os.environ.get("POSENC_CLI"), shutil.which("posenc")):
        if path and os.access(path, os.X_OK):
            return path
    raise Error("the posenc command-line tool was not found (package built without the CLI; "
                "set POSENC_CLI)")


def demo(out_dir="posenc-demo", *, format="png", seed=None, skip_checks=False, quiet=True):
    """Draws every figure and writes out_dir/index.html (`posenc demo`: the same page, made by
    the CLI shipped in the package); returns index.html's path.

    format: 'png' or 'svg'. quiet=False prints the demo's summary. A failure raises posenc.Error
    with the tool's message.
    """
    import os
    import subprocess
    args = [_cli(), "demo", "--out", os.fspath(out_dir), "--format", format]
    if seed is not None:
        args += ["--seed", str(int(seed))]
    if skip_checks:
        args.append("--skip-checks")
    r = subprocess.run(args, capture_output=True, text=True)
    if not quiet:
        print(r.stdout, end="")
    if r.returncode != 0:
        raise Error(r.stderr.strip() or f"posenc demo: exit status {r.returncode}")
    return os.path.join(os.fspath(out_dir), "index.html")


def bench(*, quick=True, threads=0, filter=""):
    """Times the library against this machine's baselines (`posenc bench`); returns one dict per
    entry (name, median_s, min_s, reps, threads, gbps or gflops, baselines and extra fields such
    as vs_none or peak_mb, ratio against the first baseline when it ran, and vs_fma_peak, a
    GFLOP/s rate over fma_peak's, when fma_peak ran).

    quick=True: seconds (small sizes); quick=False: minutes (L = 4096 attention, ...).
    filter: run only the entries whose name contains this text; comma-separated alternatives run
    the entries that match any of them, and "=NAME" matches that name only (baselines they
    compare with are not run unless they match too).
    """
    from . import _posenc_extras  # the benchmark harness, loaded on demand
    done = {}
    results = []
    for name, run in _posenc_extras._bench_suite(int(threads), bool(quick), str(filter)):
        r = run()
        r["simd_target"] = _posenc_extras._simd_target()
        r["quick"] = bool(quick)
        base = r["baselines"][0] if r["baselines"] else None
        if base in done:
            key = "gbps" if "gbps" in r else "gflops"
            other = done[base].get(key)
            if other:
                r["ratio"] = r[key] / other
        peak = done.get("fma_peak", {}).get("gflops")
        if peak and "gflops" in r and name != "fma_peak":
            r["vs_fma_peak"] = r["gflops"] / peak
        done[name] = r
        results.append(r)
    return results


__all__ = [n for n in dir() if not n.startswith("_")] + ["plot"]

# Subpackages that need torch (and transformers for posenc.hf) load on first use, so
# ``import posenc`` stays NumPy-only and ``posenc.torch.attention`` works after ``import posenc``;
# posenc.plot loads the figures' extension module (cairo) on first use.
_LAZY_SUBMODULES = ("torch", "hf", "testing", "experiments", "plot")


def __getattr__(name):
    if name in _LAZY_SUBMODULES:
        import importlib
        return importlib.import_module("." + name, __name__)
    raise AttributeError(f"module 'posenc' has no attribute {name!r}")

