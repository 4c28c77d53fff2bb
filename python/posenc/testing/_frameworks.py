"""Dtypes, frameworks and calling the function under test: NumPy arrays or torch tensors in
the dtype of the case, the result back as float64, a raise or a wrong shape recorded on the
case instead of crashing the check."""

import numpy as np

import posenc as _pe


EPS = {"float64": 2.0 ** -52, "float32": 2.0 ** -23, "bfloat16": 2.0 ** -7,
       "float16": 2.0 ** -10}
_HALF = ("bfloat16", "float16")


def _dtype_name(d):
    if isinstance(d, str):
        name = {"bf16": "bfloat16", "f16": "float16", "half": "float16", "f32": "float32",
                "float": "float32", "f64": "float64", "double": "float64"}.get(d, d)
    else:
        name = str(d).replace("torch.", "")
        try:
            name = np.dtype(d).name
        except TypeError:
            pass
    if name not in EPS:
        raise ValueError(f"dtype: {d!r} (float32, float64, bfloat16 or float16)")
    return name


def _round(a, dtype):
    """float64 values rounded to the dtype, as float64."""
    a = np.asarray(a, np.float64)
    if dtype == "float64":
        return a
    if dtype == "bfloat16":
        return _pe.bf16_to_float32(_pe.bf16_from_float32(a.astype(np.float32))).astype(np.float64)
    return a.astype(dtype).astype(np.float64)


def _torch():
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is optional
        return None
    return torch


def _is_tensor(x):
    t = _torch()
    return t is not None and isinstance(x, t.Tensor)


def _is_module(fn):
    t = _torch()
    return t is not None and isinstance(fn, t.nn.Module)


def _to_numpy(y, what="result"):
    if isinstance(y, (tuple, list)) and y and not np.isscalar(y[0]):
        y = y[0]  # (out, lse) and the like: the first element
    if _is_tensor(y):
        return y.detach().cpu().to(_torch().float64).numpy()
    try:
        return np.asarray(y, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise TypeError(f"the function's {what} is not an array or tensor "
                        f"({type(y).__name__})") from e


class _Caller:
    """Calls the user's function with NumPy arrays or torch tensors (framework auto-detected on
    the first call: NumPy first; a raise or a tensor result switches to torch)."""

    def __init__(self, fn, framework):
        if not callable(fn):
            raise TypeError(f"fn: a callable (got {type(fn).__name__})")
        if framework not in ("auto", "torch", "numpy"):
            raise ValueError(f"framework: {framework!r} ('auto', 'torch' or 'numpy')")
        self.fn = fn
        self.framework = framework
        if framework == "auto" and (_is_module(fn)
                                    or getattr(fn, "_posenc_framework", None) == "torch"):
            self.framework = "torch"
        if self.framework == "torch" and _torch() is None:
            raise ValueError("framework='torch' but torch is not installed")

    def convert(self, a, dtype, framework):
        """a: float64 values already in the dtype (or ints)."""
        if a is None or isinstance(a, (int, float, str)):
            return a
        a = np.asarray(a)
        if framework == "numpy":  # always a copy: a function that works in place changes no input
            if a.dtype.kind in "iu":
                return a.astype(np.int64)
            if dtype == "bfloat16":
                raise _Unsupported("bfloat16 needs torch (NumPy has no bfloat16)")
            return a.astype(dtype)
        torch = _torch()
        if a.dtype.kind in "iu":
            return torch.from_numpy(np.array(a, np.int64))
        return torch.from_numpy(np.array(a, np.float64)).to(getattr(torch, dtype))

    def __call__(self, args, kwargs, dtype, float_args):
        """args / kwargs hold NumPy arrays; float_args names which positional args (indices) and
        keyword tables are floating (converted to the dtype)."""
        def run(fw):
            a = [self.convert(x, dtype if i in float_args else None, fw)
                 if isinstance(x, np.ndarray) else x for i, x in enumerate(args)]
            kw = {}
            for k, x in kwargs.items():
                if isinstance(x, dict):
                    kw[k] = {n: self.convert(t, dtype, fw) for n, t in x.items()}
                elif isinstance(x, np.ndarray):
                    kw[k] = self.convert(x, dtype, fw)
                else:
                    kw[k] = x
            return self.fn(*a, **kw)
        if self.framework == "auto":
            try:
                y = run("numpy")
                if not _is_tensor(y) and not (isinstance(y, tuple) and y and _is_tensor(y[0])):
                    self.framework = "numpy"
                    return y
            except _Unsupported:  # bf16: only torch can take it; the function decides
                if _torch() is None:
                    raise
                return run("torch")
            except Exception:
                if _torch() is None:
                    raise
            self.framework = "torch"
        return run(self.framework)


class _Unsupported(Exception):
    pass


def _pick_dtypes(dtype):
    """(list of (dtype, full battery?)): dtype None: float32 fully, bf16 and f16 on a subset."""
    if dtype is None:
        return [("float32", True), ("bfloat16", False), ("float16", False)], True
    ds = dtype if isinstance(dtype, (list, tuple)) else [dtype]
    if not ds:
        raise ValueError("dtype: an empty list")
    return [(_dtype_name(d), True) for d in ds], False


def _skip_bf16(caller, dt, lenient, notes):
    if dt == "bfloat16" and lenient and caller.framework == "numpy":
        notes.append("bfloat16 cases not run: the function is NumPy's (no bfloat16 dtype)")
        return True
    return False


def _run_case(caller, case, args, kwargs, dtype, float_args, shape, optional, lenient_dtype):
    """Calls fn; returns the float64 result or None (case status set)."""
    try:
        y = caller(args, kwargs, dtype, float_args)
        y = _to_numpy(y)
    except _Unsupported as e:
        case.status, case.message = "unsupported", str(e)
        return None
    except Exception as e:  # the user's function raised: report it, do not crash the check
        case.status = "unsupported" if (optional or (lenient_dtype and dtype in _HALF)) else "error"
        case.message = f"{type(e).__name__}: {e}"[:300]
        return None
    y = _squeeze_lead(y, len(shape))
    if y.shape != tuple(shape):  # exact: a broadcast result would hide rows never computed
        case.status = "unsupported" if optional else "error"
        case.message = f"result shape {y.shape}, expected {tuple(shape)}"
        return None
    return y


def _squeeze_lead(y, ndim):
    while y.ndim > ndim and y.shape[0] == 1:
        y = y[0]
    return y


def _maxerr(a, b):
    d = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
    if d.size == 0:
        return 0.0
    if np.isnan(d).any():
        return float("inf")
    return float(d.max())


def _call_text(fn, kw):
    name = getattr(fn, "__name__", None) or type(fn).__name__
    parts = [name] + [f"{k}={v!r}" for k, v in kw.items()
                      if v is not None and not isinstance(v, (np.ndarray, dict))
                      and len(repr(v)) < 60]
    return ", ".join(parts)


# ---- calling an attention function --------------------------------------------------------------

def _run_attn(caller, case, q, k, v, scheme, ukw, params, dt, optional, lenient):
    # tables: the user's own objects (their dtype), converted to the function's framework
    sch = () if scheme is None else (scheme,)  # scheme None: fn(q, k, v, **keywords)
    kw = dict(ukw)
    kw.pop("params", None)

    def conv_params(fw):
        if params is None:
            return None
        out = {}
        for n, t in params.items():
            if fw == "torch" and not _is_tensor(t):
                out[n] = _torch().from_numpy(np.asarray(t, np.float32))
            elif fw == "numpy" and _is_tensor(t):
                out[n] = t.detach().cpu().float().numpy()
            else:
                out[n] = t
        return out
    try:
        if caller.framework == "auto":
            try:
                y = caller.fn(*(caller.convert(a, dt, "numpy") for a in (q, k, v)), *sch,
                              **_kw_for(kw, caller, "numpy", dt), **_pkw(conv_params("numpy")))
                if not _is_tensor(y) and not (isinstance(y, tuple) and y and _is_tensor(y[0])):
                    caller.framework = "numpy"
                else:
                    caller.framework = "torch"
                    y = None
            except _Unsupported:
                caller.framework = "torch"
                y = None
            except Exception:
                caller.framework = "torch"
                y = None
            if y is None:
                y = caller.fn(*(caller.convert(a, dt, "torch") for a in (q, k, v)), *sch,
                              **_kw_for(kw, caller, "torch", dt), **_pkw(conv_params("torch")))
        else:
            fw = caller.framework
            y = caller.fn(*(caller.convert(a, dt, fw) for a in (q, k, v)), *sch,
                          **_kw_for(kw, caller, fw, dt), **_pkw(conv_params(fw)))
        y = _to_numpy(y)
    except _Unsupported as e:
        case.status, case.message = "unsupported", str(e)
        return None
    except Exception as e:
        case.status = "unsupported" if (optional and isinstance(e, TypeError)) or (
            lenient and dt in _HALF) else "error"
        case.message = f"{type(e).__name__}: {e}"[:300]
        return None
    shape = (q.shape[0], q.shape[1], q.shape[2], v.shape[3])
    if y.shape != shape:
        case.status, case.message = "error", f"result shape {y.shape}, expected {shape}"
        return None
    return y


def _pkw(p):
    return {} if p is None else {"params": p}


def _kw_for(kw, caller, fw, dt):
    out = {}
    for n, x in kw.items():
        out[n] = caller.convert(x, dt, fw) if isinstance(x, np.ndarray) else x
    return out
