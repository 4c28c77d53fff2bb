"""check_bias's diagnosis: the known mistakes of ALiBi (slopes for a head count that is not a
power of two, sign), T5 (bidirectional vs causal buckets, sign, float64 logarithm), DeBERTa
(p2c index, sign, log precision) and of the query positions (KV-cache offset, off by one)."""

import numpy as np

import posenc as _pe

from ._report import _errors_and_failing
from ._oracle import _bias_err, _bias_positions, _bias_reference, _t5_tablefree_err


def _bias_alt_err(case, ctx, variant, shift=0):
    h, ql, kl = case.info["heads"], case.info["q_len"], case.info["k_len"]
    if ql + shift + (kl - ql) < 0:
        return None
    kw = dict(ctx)
    ref, _ = _bias_reference(ctx["scheme"], ql, kl, h, ctx["table"], kw, shift, variant)
    y, mask = case.info["y"], case.info["mask"]
    if ctx["scheme"] == "t5" and ctx["table"] is None:
        return _t5_tablefree_err(y, ref, mask)
    return _bias_err(y, ref, mask, ctx["softmax_invariant"])


def _estimated_slopes(case):
    """Per-head slope the function's ALiBi bias implies (median key-to-key step left of the
    query; works for -m|i-j| and for m·j)."""
    y = case.info["y"]
    ql, kl = case.info["q_len"], case.info["k_len"]
    pq, _ = _bias_positions(ql, kl)
    i = ql - 1
    p = int(pq[i])
    if p < 2:
        return None
    steps = np.diff(y[:, i, :p + 1], axis=-1)
    return np.median(steps, axis=-1)


def _bias_diagnosis(results, ctx):
    out, failing = _errors_and_failing(results)
    if not failing:
        return out
    scheme = ctx["scheme"]

    def matches(variant, shift=0, only=None):
        hits = []
        for c in (failing if only is None else only):
            e = _bias_alt_err(c, ctx, variant, shift)
            if e is None or e > max(c.tolerance, 0) or not e < c.max_error:
                return None
            hits.append(c)
        return hits[0]

    found = []
    if ctx["softmax_invariant"] is False and scheme != "deberta":
        c0 = failing[0]
        saved = ctx["softmax_invariant"]
        ctx["softmax_invariant"] = True
        if all(_bias_alt_err(c, ctx, {}) <= c.tolerance for c in failing):
            found.append("The bias differs from the oracle by a constant per query row (per "
                         "head): softmax does not see it, but the bias is not the reference "
                         "one (BLOOM's slopes·key_index form); " +
                         ("check it with causal=True, softmax_invariant=True (the form equals "
                          "ALiBi only on the keys before the query)" if scheme == "alibi"
                          else "check it with softmax_invariant=True") +
                         f" (seen in '{c0.name}').")
        ctx["softmax_invariant"] = saved
    if scheme == "alibi" and not found:
        bad_heads = sorted({c.info["heads"] for c in failing})
        pow2_pass = any(x.status == "pass" and x.info["heads"] & (x.info["heads"] - 1) == 0
                        for x in results)
        if bad_heads and all(h & (h - 1) for h in bad_heads):
            h = bad_heads[0]
            mine = [c for c in failing if c.info["heads"] == h]
            exp = _pe.alibi_slopes(h, max_bias=ctx["max_bias"])
            B = ctx["max_bias"]
            n = 1 << (h.bit_length() - 1)
            cands = {
                f"2^(-{B:g}·h/H) over all H = {h} heads (the power-of-two formula applied to a "
                "head count that is not a power of two)": 2.0 ** (-B * np.arange(1, h + 1) / h),
                "the first H slopes of the next power of two's set": 2.0 ** (
                    -B * np.arange(1, h + 1) / (2 * n)),
                "the closest power of two's slopes, repeated": np.resize(
                    2.0 ** (-B * np.arange(1, n + 1) / n), h),
            }
            which = None
            for what, sl in cands.items():
                if matches({"slopes": sl}, only=mine) is not None:
                    which = what
                    break
            if which or pow2_pass:
                msg = (f"ALiBi slopes for a head count that is not a power of two are wrong (heads "
                       f"{', '.join(map(str, bad_heads))} fail"
                       + (", powers of two pass" if pow2_pass else "")
                       + f"): ALiBi takes the closest power of two n = {n}, its n slopes "
                       f"2^(-{B:g}h/n), then every other slope of the 2n set, 2^(-{B:g}h/(2n)) for "
                       f"odd h (posenc.alibi_slopes({h})).")
                if which:
                    msg += f" The function uses {which}."
                est = _estimated_slopes(max(mine, key=lambda c: c.info["q_len"]))
                if est is not None and est.shape[0] == h:
                    d = np.flatnonzero(np.abs(np.abs(est) - exp) > 1e-3 * exp)
                    if d.size:
                        msg += (f" First differing head {d[0]}: slope {abs(est[d[0]]):.6g}, "
                                f"expected {exp[d[0]]:.6g}.")
                found.append(msg)
        if not found and matches({"sign": -1.0}) is not None:
            found.append("The bias has the wrong sign: it adds +m·|distance| (ALiBi penalizes "
                         "distance: -m·|pos_q - pos_k|).")
    if scheme == "t5":
        other = not ctx["bidirectional"]
        c = matches({"bidirectional": other})
        if c is not None:
            found.append(
                "T5 buckets are " + ("bidirectional (encoder)" if other else "causal (decoder)")
                + " but the setting is " + ("causal" if other else "bidirectional") +
                ": the encoder's self-attention uses bidirectional buckets (half of them for keys "
                "after the query), the decoder's causal ones (every later key in bucket 0); "
                f"pass bidirectional= accordingly (seen in '{c.name}').")
        c = matches({"flip": True})
        if c is not None and not found:
            found.append("The relative position has the wrong sign: T5 buckets rel = pos_k - "
                         f"pos_q (the key's position minus the query's) (seen in '{c.name}').")
        c = matches({"float64_log": True})
        if c is not None and not found:
            found.append("The bucket's logarithm is evaluated in float64; T5 (and posenc) "
                         "evaluate it in float32, which moves a few distances to the neighbouring "
                         f"bucket (seen in '{c.name}').")
    if scheme == "deberta":
        if ctx["index"] == "p2c":
            c = matches({"p2c": "paper" if ctx["p2c"] == "model" else "model"})
            if c is not None:
                found.append(
                    "DeBERTa's p2c index is "
                    + ("the paper's δ(j, i) = clamp(-ρ + K)" if ctx["p2c"] == "model"
                       else "the checkpoints' clamp(ρ + K) (c2p's row)") +
                    ": trained checkpoints (the authors' code and Hugging Face's, which gather "
                    "with -rel and transpose) read pos_query at row clamp(ρ + K, 0, 2K - 1), "
                    "the same row as c2p; "
                    + ("use p2c='paper' to check the paper's form" if ctx["p2c"] == "model"
                       else "p2c='model' is that form")
                    + f" (seen in '{c.name}').")
        if ctx["index"] == "relative":
            c = matches({"flip": True})
            if c is not None:
                found.append("The relative position has the wrong sign: DeBERTa's ρ is pos_q - "
                             f"pos_k (query minus key) (seen in '{c.name}').")
        if ctx["dkw"]["position_buckets"] > 0:
            c = matches({"dkw": {"float64_log": not ctx["dkw"]["float64_log"]}})
            if c is not None and not found:
                f64 = not ctx["dkw"]["float64_log"]
                found.append("The log buckets are evaluated in "
                             + ("float64 (the authors' code)" if f64 else "float32 (Hugging Face)")
                             + f": pass float64_log={f64} (seen in '{c.name}').")
    # positions: queries at 0..q_len-1 (the KV-cache offset missing) or off by one
    shifted = [c for c in failing if c.info["q_len"] < c.info["k_len"]]
    if not found and shifted and all(c.info["q_len"] < c.info["k_len"] for c in failing):
        ok = True
        for c in failing:
            e = _bias_alt_err(c, ctx, {}, shift=-(c.info["k_len"] - c.info["q_len"]))
            if e is None or e > c.tolerance:
                ok = False
                break
        if ok:
            found.append("Queries are placed at positions 0..q_len-1, but with k_len > q_len (a KV "
                         "cache, or a chunk of a prompt) query i sits at k_len - q_len + i: the "
                         "position offset of the cache is missing (cases with q_len = k_len pass).")
    if not found:
        for shift, word in ((1, "+ 1"), (-1, "- 1")):
            c = matches({}, shift=shift)
            if c is not None:
                found.append(f"Query positions are off by one (the function places query i at "
                             f"k_len - q_len + i {word}): an off-by-one position offset in a KV "
                             f"cache (seen in '{c.name}').")
                break
    if not found:
        found.append("No known mistake matches the error pattern; compare the first failing "
                     "case with the oracle (posenc.alibi_slopes / t5_bucket_map / deberta_bucket).")
    return out + found
