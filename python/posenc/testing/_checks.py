"""The public checks: check_rope, check_bias and check_attention run their battery of cases
on the function, compare with the oracle and return a Report; assert_* raise AssertionError
with it."""

import numpy as np

import posenc as _pe

from ._frameworks import (EPS, _Caller, _call_text, _is_module, _maxerr, _pick_dtypes, _round,
                          _run_attn, _run_case, _skip_bf16, _squeeze_lead, _to_numpy)
from ._report import Case, Report, _case_name, _case_seed
from ._oracle import (_RopeSettings, _attn_dims, _attn_ref, _bias_err, _bias_reference, _bias_tol,
                      _f32_allowance, _result_dtype, _rope_apply, _t5_tablefree_err, _visible)
from ._adapters import hf_rope
from ._diagnose_rope import _rope_diagnosis
from ._diagnose_bias import _bias_diagnosis
from ._diagnose_attention import _attn_diagnosis


# ---- RoPE ---------------------------------------------------------------------------------------

def _rope_battery(st, full):
    """(name, batch, seq, heads, positions, optional, layout) of the RoPE battery."""
    cases = [
        ("prefill L=33", 2, 33, 3, np.arange(33), False, None),
        ("odd sizes B=1 L=7 H=1", 1, 7, 1, np.arange(7), False, None),
        ("KV-cache decode: 1 token at 4097", 2, 1, 2, np.array([4097]), False, None),
        ("KV-cache chunk: L=5 at offset 1000", 2, 5, 2, 1000 + np.arange(5), False, None),
    ]
    if full:
        cases += [
            ("positions near 2^12", 1, 8, 2, 4092 + np.arange(8), False, None),
            ("positions near 2^16", 1, 8, 2, 65532 + np.arange(8), False, None),
            ("positions near 2^20", 1, 8, 2, (1 << 20) - 4 + np.arange(8), False, None),
            ("non-contiguous x (a [B,H,L,D] view)", 2, 9, 3, 17 + np.arange(9), False, "bhld"),
            ("per-row positions [batch, seq]", 2, 5, 2,
             np.stack([np.arange(5), 3000 + 2 * np.arange(5)]), True, None),
        ]
        if st.original:
            lo = st.original
            cases += [(f"{st.scaling_type} below original_max_position_embeddings ({lo})", 1, 6, 2,
                       lo - 6 + np.arange(6), False, None),
                      (f"{st.scaling_type} beyond original_max_position_embeddings ({lo})", 1, 6, 2,
                       lo + 94 + np.arange(6), False, None)]
    return cases


def check_rope(fn, *, head_dim=None, base=None, style=None, rotary_dim=None, scaling=None,
               config=None, layer=None, dtype=None, angles="accurate", framework="auto", seed=0,
               cases=None):
    """Checks a RoPE implementation against posenc's float64 oracle; returns a Report.

    fn(x, positions) -> rotated x, x [batch, seq, heads, head_dim] (torch tensor or NumPy array),
    positions int64 [seq] (a Hugging Face rotary-embedding module is adapted with hf_rope).
    Settings: head_dim, base (1e4), style ('half' or 'interleaved'), rotary_dim (partial rotary;
    default head_dim), scaling (a Hugging Face rope_scaling dict), or config= (a config.json path,
    dict or ModelConfig; layer=N for a model whose layers differ) instead of them.
    dtype: the dtype of x (a name, NumPy or torch dtype, or a list); None: the battery in float32
    plus bfloat16 and float16 cases (a function that rejects a half dtype is then noted, not
    failed). angles='float32' compares with the float32-angle recipe of Hugging Face (posenc's
    angles='float32' frequencies) instead of the accurate rotation. seed: the cases' inputs;
    cases: names of the cases to run (default all).

    Battery: prefill, odd sizes, KV-cache decoding and chunks at offsets, positions near 2^12,
    2^16 and 2^20, a non-contiguous x, per-row positions [batch, seq] (optional), both sides of
    original_max_position_embeddings for a scaling that has it. Tolerance: see the module
    docstring (af·max|x|·(4·eps_d + 8·eps_64·(1 + a_max))).
    """
    if angles not in ("accurate", "float32"):
        raise ValueError(f"angles: {angles!r} ('accurate' or 'float32')")
    st = _RopeSettings(head_dim, base, style, rotary_dim, scaling, config, layer)
    if _is_module(fn) and not hasattr(fn, "_posenc_canonical") and (
            "Rotary" in type(fn).__name__ or hasattr(fn, "inv_freq")):
        fn = hf_rope(fn)
    caller = _Caller(fn, framework)
    dtypes, lenient = _pick_dtypes(dtype)
    results, notes = [], []
    want = None if cases is None else set([cases] if isinstance(cases, str) else cases)
    D = st.head_dim
    for dt, full in dtypes:
        if _skip_bf16(caller, dt, lenient, notes):
            continue
        for name, B, L, H, pos, optional, layout in _rope_battery(st, full):
            cname = _case_name(name, dt, dtype, dtypes)
            if want is not None and cname not in want and name not in want:
                continue
            cseed = _case_seed(seed, cname)
            rng = np.random.default_rng(cseed)
            x = _round(rng.standard_normal((B, L, H, D)), dt)
            pos = np.asarray(pos, np.int64)
            case = Case(cname, dt, cseed)
            seq_len = int(pos.max()) + 1
            fr = st.freqs(seq_len)
            if angles == "float32":
                ref = _round(_rope_apply(x.astype(np.float32), pos, st.freqs(seq_len, "float32"),
                                         st.style), dt)
            else:
                ref = _rope_apply(x, pos, fr, st.style)
            a_max = float(np.abs(pos).max()) * float(np.max(fr.inv_freq))
            af = float(fr.attention_factor)
            mx = float(np.abs(x).max())
            case.tolerance = af * mx * (4 * EPS[dt] + 8 * EPS["float64"] * (1 + a_max))
            if angles == "float32":  # one float32 rounding of the recipe, one ulp of inv_freq
                case.tolerance += _f32_allowance(af, mx, a_max)
            xin = x
            if layout == "bhld":  # hand over a transposed view of [B, H, L, D] memory
                xin = np.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
            case.info = {"positions": pos, "a_max": a_max, "max_x": mx, "af": af,
                         "seq_len": seq_len}
            y = _run_case(caller, case, [xin, pos], {}, dt, {0}, x.shape, optional, lenient)
            if y is not None:
                case.max_error = _maxerr(y, ref)
                case.status = "pass" if case.max_error <= case.tolerance else "fail"
                case.info["y"] = y
                case.info["ref"] = ref
            if not case.ok or case.status == "fail":
                case.inputs = {"x": x, "positions": pos}
            if case.status == "unsupported":
                notes.append(f"'{cname}' not run: {case.message}")
            results.append(case)
    if not results:
        raise ValueError(f"cases: no case named {sorted(want)}")
    diag = _rope_diagnosis(st, results, angles)
    call = _call_text(fn, {"head_dim": head_dim, "base": base, "style": style,
                           "rotary_dim": rotary_dim,
                           "config": config if isinstance(config, str) else None})
    return Report("check_rope", results, diag, notes, seed, call)


def assert_rope(fn, **kwargs):
    """check_rope(fn, **kwargs); raises AssertionError with the report when it is not ok.
    Returns the report."""
    r = check_rope(fn, **kwargs)
    if not r.ok:
        raise AssertionError("\n" + str(r))
    return r


# ---- biases -------------------------------------------------------------------------------------

_BIAS_SHAPES = ((1, 1), (6, 6), (1, 33), (5, 23), (33, 33), (3, 300))


def check_bias(fn, scheme, *, heads=None, params=None, causal=False, softmax_invariant=False,
               max_bias=8.0, num_buckets=32, max_distance=128, bidirectional=None,
               max_relative_positions=512, position_buckets=0, float64_log=False, p2c="model",
               index="relative", shapes=None, framework="auto", seed=0, cases=None):
    """Checks an additive position bias (ALiBi, T5) or DeBERTa's relative positions / indices
    against posenc's float64 oracle; returns a Report.

    fn(q_len, k_len, heads) -> [heads, q_len, k_len] (torch or NumPy), query i at position
    k_len - q_len + i, key j at j. scheme:

    - 'alibi': bias -m_h·|pos_q - pos_k|, m = posenc.alibi_slopes(heads, max_bias=). heads: the
      head count to check (default a battery of counts, powers of two and not).
      causal=True compares only the keys at or before the query; softmax_invariant=True allows
      a constant per (head, query row) (BLOOM's slopes·key_index form).
    - 't5': table[bucket(pos_k - pos_q), h], buckets of posenc.t5_bucket (num_buckets,
      max_distance, bidirectional: default not causal). params={'relative_attention_bias':
      [num_buckets, heads]} is the table the function uses; without it the check is table-free
      (the result must be constant on each bucket of each head; heads defaults to 1, 3 and 8).
    - 'deberta': index='relative' (default: the bucketed relative position pos_q - pos_k,
      posenc.deberta_bucket), 'c2p' or 'p2c' (the table rows, posenc.deberta_c2p_index /
      deberta_p2c_index with p2c='model' (the checkpoints') or 'paper'), with
      max_relative_positions, position_buckets, float64_log; [q_len, k_len] results are taken for
      every head.

    shapes: the (q_len, k_len) pairs to run (default (1,1), (6,6), (1,33), (5,23), (33,33),
    (3,300), plus (2, 65537) for ALiBi: distances up to 2^16). Tolerance: 2·eps_d·max|bias| for
    a float result of dtype d, exact for integers.
    """
    if scheme not in ("alibi", "t5", "deberta"):
        raise ValueError(f"scheme: {scheme!r} ('alibi', 't5' or 'deberta')")
    if index not in ("relative", "c2p", "p2c"):
        raise ValueError(f"index: {index!r} ('relative', 'c2p' or 'p2c')")
    if p2c not in ("model", "paper"):
        raise ValueError(f"p2c: {p2c!r} ('model' or 'paper')")
    caller = _Caller(fn, framework)
    table = None
    if params is not None:
        if not isinstance(params, dict):
            raise TypeError("params: a dict of tables")
        if scheme != "t5" or set(params) - {"relative_attention_bias"}:
            raise ValueError(f"params: {sorted(params)} (only scheme 't5' takes "
                             "{'relative_attention_bias': [num_buckets, heads]})")
        table = np.asarray(_to_numpy(params["relative_attention_bias"]), np.float64)
        if table.ndim != 2:
            raise ValueError("params['relative_attention_bias']: [num_buckets, heads], got "
                             f"shape {table.shape}")
        num_buckets = table.shape[0]
        if heads is not None and int(heads) != table.shape[1]:
            raise ValueError(f"heads={heads} but the table has {table.shape[1]} heads")
        heads = table.shape[1]
    if scheme == "t5":
        bidi = (not causal) if bidirectional is None else bool(bidirectional)
        _pe.t5_bucket(0, num_buckets=num_buckets, max_distance=max_distance, bidirectional=bidi)
    if scheme == "deberta":
        dkw = dict(max_relative_positions=max_relative_positions,
                   position_buckets=position_buckets, float64_log=float64_log)
        _pe.deberta_bucket(0, **dkw)
    if heads is not None:
        if int(heads) < 1:
            raise ValueError(f"heads: {heads} (at least 1)")
        head_list = [int(heads)]
    elif scheme == "alibi":
        head_list = [1, 2, 3, 4, 5, 6, 8, 12, 16, 20]
    elif scheme == "t5":
        head_list = [1, 3, 8]
    else:
        head_list = [2]
    shape_list = [tuple(map(int, s)) for s in shapes] if shapes is not None else list(_BIAS_SHAPES)
    for s in shape_list:
        if len(s) != 2 or s[0] < 1 or s[1] < s[0]:
            raise ValueError(f"shapes: {s} (pairs (q_len, k_len) with 1 <= q_len <= k_len)")
    want = None if cases is None else set([cases] if isinstance(cases, str) else cases)
    plan = [(h, s) for h in head_list for s in shape_list]
    if scheme == "alibi" and shapes is None:
        plan += [(h, (2, 65537)) for h in head_list if h <= 4][:2]
    ctx = dict(scheme=scheme, table=table, softmax_invariant=softmax_invariant, causal=causal,
               max_bias=max_bias, num_buckets=num_buckets, max_distance=max_distance,
               bidirectional=(not causal) if bidirectional is None else bool(bidirectional),
               index=index, p2c=p2c, dkw=dict(max_relative_positions=max_relative_positions,
                                             position_buckets=position_buckets,
                                             float64_log=float64_log))
    results, notes = [], []
    for h, (ql, kl) in plan:
        name = f"heads={h} q_len={ql} k_len={kl}"
        if want is not None and name not in want:
            continue
        cseed = _case_seed(seed, name)
        case = Case(name, "float64", cseed)
        ref, mask = _bias_reference(scheme, ql, kl, h, table, ctx)
        case.info = {"heads": h, "q_len": ql, "k_len": kl}
        if causal and scheme in ("alibi", "t5"):
            mask = _visible(ql, kl)
        try:
            raw = caller.fn(ql, kl, h)
            case.dtype = _result_dtype(raw) or "int"
            y = _to_numpy(raw)
            y = _squeeze_lead(y, 3)
            if y.ndim == 2:
                y = y[None]
            try:
                y = np.broadcast_to(y, (h, ql, kl))
            except ValueError:
                raise ValueError(f"result shape {tuple(np.shape(_to_numpy(raw)))}, expected "
                                 f"[heads, q_len, k_len] = {(h, ql, kl)}") from None
        except Exception as e:
            case.status, case.message = "error", f"{type(e).__name__}: {e}"[:300]
            case.inputs = {"q_len": ql, "k_len": kl, "heads": h}
            results.append(case)
            continue
        ydt = None if case.dtype == "int" else case.dtype
        if scheme == "t5" and table is None:
            case.max_error = _t5_tablefree_err(y, ref, mask)
            case.tolerance = _bias_tol(ydt, y)
        else:
            case.max_error = _bias_err(y, ref, mask, softmax_invariant)
            case.tolerance = _bias_tol(ydt, ref)
        case.status = "pass" if case.max_error <= case.tolerance else "fail"
        case.info.update(y=y, mask=mask)
        if case.status == "fail":
            case.inputs = {"q_len": ql, "k_len": kl, "heads": h}
        results.append(case)
    if not results:
        raise ValueError(f"cases: no case named {sorted(want)}")
    diag = _bias_diagnosis(results, ctx)
    call = _call_text(fn, {"scheme": scheme, "heads": heads, "causal": causal or None,
                           "softmax_invariant": softmax_invariant or None})
    return Report("check_bias", results, diag, notes, seed, call)


def assert_bias(fn, scheme, **kwargs):
    """check_bias(fn, scheme, **kwargs); raises AssertionError with the report when it is not
    ok. Returns the report."""
    r = check_bias(fn, scheme, **kwargs)
    if not r.ok:
        raise AssertionError("\n" + str(r))
    return r


# ---- attention ----------------------------------------------------------------------------------

def check_attention(fn, scheme=None, *, params=None, causal=None, dtype=None, head_dim=None,
                    heads=None, angles="accurate", framework="auto", seed=0, cases=None,
                    **settings):
    """Checks an attention implementation with a positional scheme against posenc's float64
    oracle (posenc.ref.attention); returns a Report.

    fn has posenc.torch.attention's signature: fn(q, k, v, scheme, *, params=..., causal=...,
    query_positions=..., key_positions=..., **settings) -> out [batch, seq_q, heads_q, D]
    (scheme positional; left out when None; causal passed only when True, params only when
    given, positions only in the explicit-position cases)
    (q [batch, seq_q, heads_q, D], k, v [batch, seq_k, heads_kv, D]; from_bhld adapts
    [batch, heads, seq, D] functions). params (tables by posenc's parameter names, NumPy or
    torch) and settings (base, style, rotary_dim, max_bias, num_buckets, max_distance,
    bidirectional, deberta_p2c, scale, window, config, ...) are passed to fn as given and to the
    oracle. causal: True / False, or None for both. head_dim (default 16, or the tables') and
    heads (default 6 query heads: ALiBi's non-power-of-two case; or the tables') set the shapes.
    dtype, angles ('float32': RoPE queries and keys rotated by the float32-angle recipe before
    the oracle), framework, seed, cases: as check_rope.

    Battery: MHA, GQA and MQA head ratios, seq_q = seq_k and seq_q != seq_k (decoding one token
    over a cache, a chunk of 5 over 23 keys), explicit positions at an offset of 1000 and near
    2^20 (optional: a function without query_positions / key_positions keywords is noted, not
    failed), per-row positions [batch, seq] (optional), bf16 / f16 inputs. Tolerance:
    2·eps_d·max|v|·(1 + max|score|) (module docstring).
    """
    if angles not in ("accurate", "float32"):
        raise ValueError(f"angles: {angles!r} ('accurate' or 'float32')")
    if params is not None and not isinstance(params, dict):
        raise TypeError("params: a dict {name: table}")
    params64 = {n: np.asarray(_to_numpy(t), np.float64) for n, t in (params or {}).items()}
    D, H, Hkv_cfg = _attn_dims(params64, settings, head_dim, heads)
    H = H or 6
    if angles == "float32" and scheme != "rope":
        raise ValueError("angles='float32' applies to scheme 'rope'")
    caller = _Caller(fn, framework)
    dtypes, lenient = _pick_dtypes(dtype)
    kv_ratios = [d for d in (1, 2, 3, H) if H % d == 0]
    kv_heads = sorted({H // r for r in kv_ratios}, reverse=True) if Hkv_cfg is None else [Hkv_cfg]
    hkv_gqa = kv_heads[1] if len(kv_heads) > 1 else kv_heads[0]
    hkv_mqa = kv_heads[-1]
    causals = [False, True] if causal is None else [bool(causal)]
    battery = []
    for cz in causals:
        tag = " causal" if cz else ""
        battery += [
            (f"MHA L=17{tag}", 2, 17, 17, H if Hkv_cfg is None else Hkv_cfg, cz, None, False, True),
            (f"GQA {H}:{hkv_gqa} L=19{tag}", 2, 19, 19, hkv_gqa, cz, None, False, True),
            (f"decode 1 query over 37 keys{tag}", 2, 1, 37, hkv_mqa, cz, None, False, True),
            (f"chunk 5 queries over 23 keys{tag}", 2, 5, 23, hkv_gqa, cz, None, False, False),
            (f"positions offset 1000{tag}", 1, 6, 11, hkv_gqa, cz, 1000, True, False),
            (f"positions near 2^20{tag}", 1, 6, 11, hkv_gqa, cz, (1 << 20) - 16, True, False),
            (f"per-row positions [batch, seq]{tag}", 2, 5, 9, hkv_gqa, cz, "rows", True, False),
        ]
    want = None if cases is None else set([cases] if isinstance(cases, str) else cases)
    results, notes = [], []
    for dt, full in dtypes:
        if _skip_bf16(caller, dt, lenient, notes):
            continue
        for name, B, Lq, Lk, Hkv, cz, pos, optional, in_half in battery:
            if not full and not in_half:
                continue
            cname = _case_name(name, dt, dtype, dtypes)
            if want is not None and cname not in want and name not in want:
                continue
            cseed = _case_seed(seed, cname)
            rng = np.random.default_rng(cseed)
            q = _round(rng.standard_normal((B, Lq, H, D)), dt)
            k = _round(rng.standard_normal((B, Lk, Hkv, D)), dt)
            v = _round(rng.standard_normal((B, Lk, Hkv, D)), dt)
            kw = {"causal": cz}
            if pos == "rows":
                kp = np.stack([np.arange(Lk), 500 + 3 * np.arange(Lk)]).astype(np.int64)
                kw["query_positions"] = np.ascontiguousarray(kp[:, Lk - Lq:])
                kw["key_positions"] = kp
            elif pos is not None:
                kw["query_positions"] = (pos + Lk - Lq + np.arange(Lq)).astype(np.int64)
                kw["key_positions"] = (pos + np.arange(Lk)).astype(np.int64)
            case = Case(cname, dt, cseed)
            case.info = {"kw": kw, "B": B, "Lq": Lq, "Lk": Lk, "Hkv": Hkv}
            try:
                ref, tol = _attn_ref(q, k, v, scheme, params64, kw, settings, dt, angles)
            except _pe.Error as e:
                raise ValueError(f"check_attention: the oracle rejects the case '{cname}': "
                                 f"{e}") from e
            case.tolerance = tol
            ukw = dict(kw)
            if not cz:  # posenc's default: a function without a causal keyword still runs
                del ukw["causal"]
            ukw.update(settings)
            y = _run_attn(caller, case, q, k, v, scheme, ukw, params, dt, optional, lenient)
            if y is not None:
                case.max_error = _maxerr(y, ref)
                case.status = "pass" if case.max_error <= case.tolerance else "fail"
                case.info["y"] = y
            if case.status in ("fail", "error"):
                case.inputs = {"q": q, "k": k, "v": v, **kw}
            if case.status == "unsupported":
                notes.append(f"'{cname}' not run: {case.message}")
            results.append(case)
    if not results:
        raise ValueError(f"cases: no case named {sorted(want)}")
    diag = _attn_diagnosis(results, scheme, params64, settings, angles)
    call = _call_text(fn, {"scheme": scheme, "causal": causal})
    return Report("check_attention", results, diag, notes, seed, call)


def assert_attention(fn, scheme=None, **kwargs):
    """check_attention(fn, scheme, **kwargs); raises AssertionError with the report when it is
    not ok. Returns the report."""
    r = check_attention(fn, scheme, **kwargs)
    if not r.ok:
        raise AssertionError("\n" + str(r))
    return r
