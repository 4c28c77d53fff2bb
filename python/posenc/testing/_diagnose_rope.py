"""check_rope's diagnosis: the known RoPE mistakes (pair layout, rotation direction,
off-by-one or ignored positions, partial rotary, scaling, base, positions rounded to the
dtype, float32 angles) recomputed by the oracle and compared with the failing results."""

import numpy as np

from ._frameworks import EPS, _HALF, _maxerr, _round
from ._oracle import _f32_allowance, _rope_apply


def _rope_diagnosis(st, results, angles):
    failing = [c for c in results if c.status == "fail"]
    out = []
    errors = [c for c in results if c.status == "error"]
    if errors:
        out.append(f"The function raised or returned a wrong shape in {len(errors)} case(s), first "
                   f"'{errors[0].name}': {errors[0].message}.")
    if not failing:
        return out
    other = "interleaved" if st.style == "half" else "half"
    hyps = [
        ("style", f"Pairs are rotated {other}-style "
         + ("(x[2i], x[2i+1]: GPT-J / Meta's original layout)" if other == "interleaved"
            else "(x[i], x[i+R/2]: rotate_half, GPT-NeoX / Hugging Face layout)")
         + f", but the settings say {st.style}-style: a checkpoint's q/k projection rows only "
         "match one of them (convert the weights' permutation or switch the style)."),
        ("inverse", "The rotation turns the wrong way (the sign of sin is flipped): the function "
         "applies the inverse (transpose) rotation."),
        ("plus1", "Positions are off by one (the function rotates at position + 1): an off-by-one "
         "position offset, e.g. a KV cache's length counted after appending the new tokens."),
        ("minus1", "Positions are off by one (the function rotates at position - 1): an off-by-one "
         "position offset in the KV-cache bookkeeping."),
        ("zero", "The function ignores the positions it is given and rotates token i at position "
         "i (0, 1, ...): with a KV cache the new tokens must be rotated at their absolute "
         "positions (cache length + i)."),
        ("full", f"All {st.head_dim} dims are rotated, but rotary_dim is {st.rotary_dim}: partial "
         f"rotary (the last {st.head_dim - st.rotary_dim} dims pass through unrotated) is not "
         "applied."),
        ("partial_hd", "The rotary pairs are formed over head_dim instead of rotary_dim (the half "
         "split at head_dim/2 rather than rotary_dim/2)."),
        ("noscale", f"The frequency scaling ({st.scaling_type}) is not applied: the function uses "
         "the unscaled base frequencies."),
        ("posdtype", "The positions are rounded to the input's dtype before the angles are formed "
         "(a position index built in x's dtype, e.g. torch.arange(L, dtype=x.dtype) or "
         "positions.to(x.dtype)): bfloat16 holds integers exactly only up to 256, float16 up to "
         "2048, float32 up to 2^24, so larger positions move (257 -> 256 in bfloat16). Build the "
         "positions in int64 and form the angles in float32 or float64."),
    ]
    hyps += [(("base", b), f"The frequencies are those of base θ = {b:g}, but the settings say "
              f"θ = {st.theta():g} (rope_theta"
              + (": another layer's RoPE" if st.config is not None else "") + ").")
             for b in st.other_thetas()]
    if st.rotary_dim == st.head_dim:
        hyps = [h for h in hyps if h[0] not in ("full", "partial_hd")]
    if st.scaling_type == "default":
        hyps = [h for h in hyps if h[0] != "noscale"]
    hit = {}
    f32_match = []
    for c in failing:
        x, pos, y = c.inputs["x"], c.info["positions"], c.info.get("y")
        if y is None:
            continue
        tol = max(c.tolerance, 2 * c.info["af"] * c.info["max_x"] * (4 * EPS[c.dtype]))
        # The float32-angle recipe (Hugging Face's): does it explain the error?
        if angles == "accurate":
            f32 = _round(_rope_apply(x.astype(np.float32), pos,
                                     st.freqs(c.info["seq_len"], "float32"), st.style), c.dtype)
            e32 = _maxerr(y, f32)
            allow = _f32_allowance(c.info["af"], c.info["max_x"], c.info["a_max"])
            if e32 <= 2 * tol + allow and e32 < 0.5 * c.max_error:
                f32_match.append(c)
        for key, _ in hyps:
            same = _rope_alt(st, key, x, pos, c.info["seq_len"], "accurate", c.dtype)
            if same is None or _maxerr(same, c.info["ref"]) <= 2 * tol:
                continue  # the mistake would not show in this case
            for ang in (("accurate", "float32") if angles == "accurate" else ("float32",)):
                alt = _rope_alt(st, key, x, pos, c.info["seq_len"], ang, c.dtype)
                if alt is None:
                    continue
                alt = _round(alt, c.dtype) if ang == "float32" else alt
                ea = _maxerr(y, alt)
                lim = 2 * tol + (_f32_allowance(c.info["af"], c.info["max_x"], c.info["a_max"])
                                 if ang == "float32" else 0)
                if ea <= lim and ea < 0.5 * c.max_error:
                    hit.setdefault(key, []).append((c, ang))
                    break
    # A mistake that explains only some of the cases another explains as well is that other one
    # seen where the two coincide (a bfloat16 position index turns 1001 into 1000, which looks
    # like an off-by-one in that case alone): only the wider explanation is reported.
    cases_of = {key: {id(c) for c, _ in v} for key, v in hit.items()}
    for key in list(hit):
        if any(other != key and cases_of[key] < cases_of[other] for other in cases_of):
            del hit[key]
    for key, sentence in hyps:
        if key in hit:
            c, _ = hit[key][0]
            f32 = [x for x, ang in hit[key] if ang == "float32"]
            extra = ""
            if f32 and angles == "accurate":
                extra = (" The angles are also computed in float32 (the float32 recipe explains "
                         f"'{f32[-1].name}').")
            out.append(sentence + f" Seen in '{c.name}' (error {c.max_error:.3g}, tolerance "
                       f"{c.tolerance:.3g})." + extra)
    # The float32-angle recipe explains cases that no other mistake does: its own sentence, next
    # to the others' (one sentence for each matching mistake).
    covered = {id(c) for v in hit.values() for c, _ in v}
    f32_match = [c for c in f32_match if id(c) not in covered]
    if f32_match:
        worst = max(f32_match, key=lambda c: c.max_error)
        ok_small = [c for c in results if c.status == "pass" and c.dtype == worst.dtype]
        rel = worst.max_error / max(worst.info["max_x"], 1e-300)
        out.append(
            "Float32 angles at long context: the results equal the float32 recipe "
            "(angle = float32(position) * float32(inv_freq), cos/sin in float32; Hugging Face's "
            "rotary classes), whose error grows with the position: "
            + ", ".join(f"{c.max_error:.2g} at position {int(c.info['positions'].max())}"
                        for c in sorted(f32_match, key=lambda c: c.info["a_max"])[:4])
            + f" (relative {rel:.2g} of max|x|; float32 angle rounding is eps_32/2*|angle| "
            "radians). Compute the angles in float64 (or reduce the angle range exactly) and "
            "round once"
            + (f"; cases at smaller positions pass ({ok_small[0].name})" if ok_small else "")
            + ". check_rope(..., angles='float32') checks the rest against that recipe.")
    elif not hit and angles == "accurate":
        # the same growth pattern without matching the recipe exactly (e.g. float32 inv_freq)
        grow = [c for c in failing if c.info.get("y") is not None]
        if grow and all(c.max_error <= c.info["af"] * c.info["max_x"]
                        * (2 * EPS["float32"] * c.info["a_max"] + 8 * EPS[c.dtype])
                        for c in grow):
            out.append("The error grows with the position and stays within float32's angle "
                       "rounding (eps_32*|angle|): the angles or the inverse frequencies are "
                       "computed in float32 (float32 angles at long context).")
    if len(out) == len(errors) and failing:
        only_rows = all(c.name.startswith("per-row") for c in failing)
        only_half = all(c.dtype in _HALF for c in failing)
        if only_rows:
            out.append("Only per-row positions [batch, seq] fail: the function takes them but "
                       "broadcasts them wrongly (each batch row must use its own positions).")
        elif only_half:
            out.append("Only half-precision cases fail: the rotation loses more than the dtype's "
                       "rounding (e.g. cos/sin or the product rounded more than once, or "
                       "overflow).")
        else:
            out.append("No known mistake matches the error pattern; compare the first failing "
                       "case's result with posenc.apply_rope on float64 inputs.")
    return out


def _rope_alt(st, key, x, pos, seq_len, ang, dtype="float64"):
    x = x.astype(np.float32) if ang == "float32" else x
    if key == "posdtype":
        p = _round(pos, dtype).astype(np.int64)
        if np.array_equal(p, pos):
            return None
        return _rope_apply(x, np.ascontiguousarray(p), st.freqs(seq_len, ang), st.style)
    if key == "style":
        other = "interleaved" if st.style == "half" else "half"
        return _rope_apply(x, pos, st.freqs(seq_len, ang), other)
    if key == "inverse":
        f = st.freqs(seq_len, ang)
        y = _rope_apply(x, pos, f, st.style, inverse=True)
        return y * float(f.attention_factor) ** 2 if f.attention_factor != 1 else y
    if key in ("plus1", "minus1"):
        p = pos + (1 if key == "plus1" else -1)
        if p.min() < 0:
            return None
        n = max(seq_len + (1 if key == "plus1" else -1), 1)
        return _rope_apply(x, p, st.freqs(n, ang), st.style)
    if key == "zero":
        p = np.broadcast_to(np.arange(pos.shape[-1]), pos.shape)
        if np.array_equal(p, pos):
            return None
        return _rope_apply(x, np.ascontiguousarray(p), st.freqs(seq_len, ang), st.style)
    if key == "full":
        return _rope_apply(x, pos, st.freqs(seq_len, ang, rotary_dim=st.head_dim), st.style)
    if key == "partial_hd":  # pairs (i, i + D/2) with R/2 frequencies: rotate a permuted x
        if st.style != "half":
            return None
        f = st.freqs(seq_len, ang)
        D, R = st.head_dim, st.rotary_dim
        perm = np.concatenate([np.arange(R // 2), D // 2 + np.arange(R // 2)])
        rest = np.setdiff1d(np.arange(D), perm)
        xp = np.concatenate([x[..., perm], x[..., rest]], axis=-1)
        yp = _rope_apply(xp, pos, f, "half")
        y = np.empty_like(yp)
        y[..., perm] = yp[..., :R]
        y[..., rest] = yp[..., R:]
        return y
    if key == "noscale":
        return _rope_apply(x, pos, st.freqs(seq_len, ang, scaling=False), st.style)
    if isinstance(key, tuple) and key[0] == "base":
        return _rope_apply(x, pos, st.freqs(seq_len, ang, base=key[1]), st.style)
    return None
