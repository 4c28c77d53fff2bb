"""check_attention's diagnosis: the known mistakes of an attention implementation (RoPE style,
angles, partial rotary and scaling; T5 bucket kind; DeBERTa's p2c; ALiBi slopes; query
positions; GQA head order; causal alignment and scale) recomputed by the oracle."""

import math

import numpy as np

import posenc as _pe

from ._frameworks import EPS, _maxerr
from ._report import _errors_and_failing
from ._oracle import _attn_ref


# Scalings a model may apply by mistake (rope_scaled): the common kinds at common factors.
_COMMON_SCALINGS = (
    {"rope_type": "linear", "factor": 2.0}, {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "linear", "factor": 8.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
)


def _attn_diagnosis(results, scheme, params64, settings, angles):
    out, failing = _errors_and_failing(results)
    if not failing:
        return out
    hyps = []
    if scheme == "rope":
        style = settings.get("style", "half")
        other = "interleaved" if style == "half" else "half"
        hyps.append(({"style": other}, f"RoPE pairs are rotated {other}-style but the setting is "
                     f"{style}-style (half: x[i], x[i+R/2], rotate_half; interleaved: x[2i], "
                     "x[2i+1])."))
        if angles == "accurate":
            hyps.append(("f32", "Float32 angles at long context: the scores equal those of RoPE "
                         "with the float32 angle recipe (float32(position)·float32(inv_freq)), "
                         "whose error grows with the position; compute angles in float64."))
    if scheme == "rope" and "config" not in settings:
        if settings.get("rotary_dim", 0) not in (0, None):
            hyps.append(("rope_full", "All head dims are rotated, but rotary_dim is "
                         f"{settings['rotary_dim']}: partial rotary (the dims past rotary_dim pass "
                         "through) is not applied."))
        else:
            hyps.append(("rope_partial", "Only part of the head dims is rotated (partial rotary, "
                         "rotary_dim < head_dim), but the settings rotate them all: a partial "
                         "rotary factor applied where the model has none."))
        if settings.get("scaling"):
            hyps.append(("rope_noscale", "The RoPE frequency scaling "
                         f"({settings['scaling'].get('rope_type', settings['scaling'].get('type'))})"
                         " is not applied: the function uses the unscaled frequencies."))
        else:
            hyps.append(("rope_scaled", "A RoPE frequency scaling is applied where the settings "
                         "give none (the frequencies match a scaled variant: {}): check "
                         "rope_scaling / rope_parameters."))
    if scheme == "t5":
        hyps.append(("t5flip", "T5 buckets are the other kind (bidirectional vs causal): the "
                     "encoder uses bidirectional buckets, the decoder causal ones; check the "
                     "bidirectional setting."))
    if scheme == "deberta":
        p2c = settings.get("deberta_p2c", "model")
        o = "paper" if p2c == "model" else "model"
        hyps.append(({"deberta_p2c": o}, "DeBERTa's p2c index is " +
                     ("the paper's δ(j, i) = clamp(-ρ + K)" if o == "paper"
                      else "c2p's row clamp(ρ + K)")
                     + "; trained checkpoints (authors' code, Hugging Face) use c2p's row "
                     "clamp(ρ + K, 0, 2K - 1) (deberta_p2c='model')."))
    if scheme == "alibi" and "slopes" not in params64:
        hyps.append(("alibi_geo", "ALiBi slopes for a head count that is not a power of two are "
                     "wrong: the function uses 2^(-8h/H) over all H heads; ALiBi takes the "
                     "closest power of two n and adds every other slope of the 2n set "
                     "(posenc.alibi_slopes)."))
    hyps += [
        ("qzero", "Queries are placed at positions 0..seq_q-1 instead of after the cached keys "
         "(seq_k - seq_q + i): the KV-cache position offset is missing."),
        ("qplus1", "Query positions are off by one (+1): an off-by-one position offset in the "
         "KV cache."),
        ("qminus1", "Query positions are off by one (-1): an off-by-one position offset in the "
         "KV cache."),
        ("gqa_tiled", "GQA heads are grouped in tiled order: query head h reads kv head "
         "h % kv_heads, where Hugging Face, FlashAttention and posenc read kv head "
         "h // (heads_q / kv_heads) (repeat_kv repeats each kv head for consecutive query heads; "
         "a .repeat() instead of .repeat_interleave() tiles them)."),
        ("topleft", "The causal mask is aligned top-left: with fewer queries than keys, query i "
         "sees keys 0..i (SDPA's is_causal rule), where a KV cache's queries are the last seq_q "
         "positions and see keys 0..seq_k - seq_q + i (bottom-right, FlashAttention's rule)."),
        ("causal", "The causal mask is wrong: the result matches the oracle with the other "
         "causal setting (a missing mask, or one applied where the attention is bidirectional)."),
        ("scale1", "The scores are not scaled (scale 1 where the scheme's default is "
         "1/sqrt(head_dim)), or scaled where the scheme (T5) uses 1."),
    ]
    found = {}
    generic = ("causal", "scale1")
    for c in failing:
        y = c.info.get("y")
        if y is None:
            continue
        inp = c.inputs
        q, k, v = inp["q"], inp["k"], inp["v"]
        kw = dict(c.info["kw"])
        for key, sentence in hyps:
            if key in generic and found:
                continue
            okw, okset = dict(kw), dict(settings)
            qa, ka, va = q, k, v
            ang = angles
            sch = scheme
            if isinstance(key, dict):
                okset.update(key)
            elif key == "f32":
                ang = "float32"
            elif key == "t5flip":
                cz = kw["causal"]
                cur = settings.get("bidirectional", not cz)
                okset["bidirectional"] = not cur
            elif key == "alibi_geo":
                Hq = q.shape[2]
                if Hq & (Hq - 1) == 0:
                    continue
                mb = settings.get("max_bias", 8.0)
                params_alt = dict(params64)
                params_alt["slopes"] = 2.0 ** (-mb * np.arange(1, Hq + 1) / Hq)
                okset.pop("max_bias", None)
                try:
                    alt, _ = _attn_ref(q, k, v, sch, params_alt, okw, okset, c.dtype, ang)
                except _pe.Error:
                    continue
                if _maxerr(y, alt) <= 2 * c.tolerance and _maxerr(y, alt) < 0.5 * c.max_error:
                    found.setdefault(sentence, []).append(c)
                continue
            elif key in ("qzero", "qplus1", "qminus1"):
                Lq, Lk = q.shape[1], k.shape[1]
                qp = okw.get("query_positions")
                kp = okw.get("key_positions")
                if qp is None:
                    qp = np.arange(Lq) + Lk - Lq
                    kp = np.arange(Lk)
                if key == "qzero":
                    if Lq == Lk or "query_positions" in kw:
                        continue
                    qp = qp - (Lk - Lq)
                else:
                    qp = qp + (1 if key == "qplus1" else -1)
                if np.min(qp) < 0:
                    continue
                okw["query_positions"], okw["key_positions"] = np.ascontiguousarray(qp), kp
            elif key == "gqa_tiled":
                Hq, Hkv = q.shape[2], k.shape[2]
                if Hkv in (1, Hq):
                    continue
                tiled = np.arange(Hq) % Hkv
                ka, va = k[:, :, tiled], v[:, :, tiled]  # MHA with the tiled kv heads
            elif key == "topleft":
                Lq, Lk = q.shape[1], k.shape[1]
                if not kw["causal"] or Lq >= Lk or any(n in kw or n in settings
                                                        for n in ("window", "chunk")):
                    continue
                qp = okw.get("query_positions")
                kp = okw.get("key_positions")
                if qp is None:
                    qp, kp = np.arange(Lq) + Lk - Lq, np.arange(Lk)
                qp, kp = np.asarray(qp), np.asarray(kp)
                # query i sees the first i + 1 keys of its row (positions unchanged)
                rows = qp.reshape(-1, Lq) if qp.ndim == 2 else qp[None]
                keys = kp.reshape(-1, Lk) if kp.ndim == 2 else kp[None]
                first = keys[:, :1]
                visible = (keys[:, None, :] - first[:, None, :]) <= (
                    rows[:, :, None] - rows[:, :1, None])
                okw["mask"] = np.ascontiguousarray(visible)
                okw["causal"] = False
                okw["allow_fully_masked"] = True
                if scheme == "t5":
                    okset["bidirectional"] = settings.get("bidirectional", False)
            elif key in ("rope_full", "rope_partial", "rope_noscale", "rope_scaled"):
                D = q.shape[-1]
                alts = []
                if key == "rope_full":
                    alts = [dict(okset, rotary_dim=D)]
                elif key == "rope_partial":
                    alts = [dict(okset, rotary_dim=r) for r in sorted(
                        {D // 2 - D // 2 % 2, D // 4 - D // 4 % 2, int(0.4 * D) - int(0.4 * D) % 2})
                        if 2 <= r < D]
                elif key == "rope_noscale":
                    alts = [dict(okset, scaling=None)]
                else:
                    alts = [dict(okset, scaling=sc) for sc in _COMMON_SCALINGS]
                for alt_set in alts:
                    try:
                        alt, _ = _attn_ref(q, k, v, sch, params64, okw, alt_set, c.dtype, ang)
                    except (_pe.Error, TypeError):
                        continue
                    ea = _maxerr(y, alt)
                    if ea <= 2 * c.tolerance and ea < 0.5 * c.max_error:
                        what = sentence
                        if key == "rope_partial":
                            what = sentence.replace("(partial rotary, rotary_dim < head_dim)",
                                                    f"(rotary_dim {alt_set['rotary_dim']} of "
                                                    f"{D})")
                        elif key == "rope_scaled":
                            what = sentence.replace("{}", str(alt_set["scaling"]))
                        found.setdefault(what, []).append(c)
                        break
                continue
            elif key == "causal":
                okw["causal"] = not kw["causal"]
            elif key == "scale1":
                s = settings.get("scale")
                okset["scale"] = (1.0 / math.sqrt(q.shape[-1])
                                  if (s == 1.0 or scheme == "t5") else 1.0)
                if scheme == "deberta":
                    continue
            try:
                alt, _ = _attn_ref(qa, ka, va, sch, params64, okw, okset, c.dtype, ang)
            except (_pe.Error, TypeError):
                continue
            ea = _maxerr(y, alt)
            slack = 4 * EPS["float32"] * (1 + np.max(np.abs(v))) if key == "f32" else 0
            if ea <= 2 * c.tolerance + slack and ea < 0.5 * c.max_error:
                found.setdefault(sentence, []).append(c)
    # A mistake that explains only some of the cases another explains too is that other one seen
    # where the two coincide (one query over many keys: a top-left causal mask leaves it key 0,
    # as queries placed at 0 would): only the wider explanation is reported.
    ids = {sentence: {id(c) for c in cs} for sentence, cs in found.items()}
    found = {sentence: cs for sentence, cs in found.items()
             if not any(other != sentence and ids[sentence] < ids[other] for other in ids)}
    for sentence, cs in found.items():
        c = cs[0]
        out.append(sentence + f" Seen in '{c.name}' (error {c.max_error:.3g}, tolerance "
                   f"{c.tolerance:.3g}).")
    if not found:
        out.append("No known mistake matches the error pattern; compare the first failing case "
                   "with posenc.ref.attention.")
    return out
