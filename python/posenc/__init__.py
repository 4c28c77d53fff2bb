"""posenc: transformer positional encodings for NumPy and PyTorch.

Every encoding of the C++ library (sinusoidal, learned, RoPE with every scaling type, ALiBi, T5
bias, Shaw, Transformer-XL, DeBERTa), fused float32 attention with each of them and its fused
backward, and the float64 reference (``posenc.ref``). PyTorch autograd functions and modules are
in ``posenc.torch`` (imported on demand; needs torch).

Arrays: float32 inputs run the optimized kernels, float64 ones the float64 reference; arrays of
the dtype a function computes in are used in place (any non-negative strides), anything else is
converted once with ``numpy.ascontiguousarray``. Errors raise ``posenc.Error`` (a ValueError) or
its subclasses ``ShapeError``, ``InvalidValueError``, ``IoError`` with the library's message;
wrong argument types raise TypeError. Kernels run without the GIL.

See docs/python.md.
"""

from collections import namedtuple as _namedtuple

from . import _posenc
from ._posenc import (  # noqa: F401  (the public API)
    Error,
    InvalidValueError,
    IoError,
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
from . import plot, ref  # noqa: F401,E402

SCHEMES = ("none", "rope", "alibi", "t5", "shaw", "xl", "deberta")

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
    """RoPE angle precision at large positions (`posenc rope-precision`, SPEC §10).

    Returns RopePrecisionRow(position, accurate_error, float32_error, float32_angle_error) rows:
    max |float32 output - float64 reference| with accurate angles and with the frameworks'
    float32 recipe, and the float32 angle error itself.
    """
    rows = _posenc._rope_precision([int(p) for p in positions], int(head_dim), float(base),
                                   int(seed))
    return [RopePrecisionRow(*r) for r in rows]


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
    as vs_none or peak_mb, ratio against the first baseline when it ran).

    quick=True: seconds (small sizes); quick=False: minutes (L = 4096 attention, ...).
    filter: run only the entries whose name contains this text (baselines they compare with are
    not run unless they match too).
    """
    done = {}
    results = []
    for name, run in _posenc._bench_suite(int(threads), bool(quick), str(filter)):
        r = run()
        r["simd_target"] = _posenc._simd_target()
        r["quick"] = bool(quick)
        base = r["baselines"][0] if r["baselines"] else None
        if base in done:
            key = "gbps" if "gbps" in r else "gflops"
            other = done[base].get(key)
            if other:
                r["ratio"] = r[key] / other
        done[name] = r
        results.append(r)
    return results


__all__ = [n for n in dir() if not n.startswith("_")]
