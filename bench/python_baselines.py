#!/usr/bin/env python3
"""posenc.torch against PyTorch's own CPU attention, side by side in one process.

    .venv/bin/python bench/python_baselines.py [--seq 1024,4096,8192] [--heads 8] [--dim 128]
        [--threads 2] [--reps 3] [--dtypes float32,bfloat16] [--cases none,alibi,t5,rope,decode]
        [--modes fwd,fwdbwd] [--json]
(.venv/ with torch and NumPy: scripts/python-env.sh; the package importable: installed in .venv,
or PYTHONPATH=build-test/python/stage for the test build.)

Causal attention of one sequence, [1, L, heads, dim], every implementation on the same values:
  none    posenc.torch.attention vs F.scaled_dot_product_attention(is_causal=True), PyTorch's
          fused CPU flash kernel.
  alibi   posenc vs SDPA with the bias materialized as a float attn_mask [1, H, L, L] (what
  t5      Hugging Face's sdpa attention does; the mask is built once, outside the timing, and
          for T5 gathered from the learnable table inside it, so its gradient flows) and vs
          flex_attention compiled on the CPU with a score_mod (ALiBi: slope[h] (k - q); T5: the
          table at the bucket of q - k) and a causal block_mask (forward only: PyTorch has no
          CPU backward for FlexAttention). T5 scores are unscaled, as in T5.
  rope    posenc's fused rotation (scheme rope) vs the rotate-half reference (cos / sin
          tables, q and k rotated) + SDPA(is_causal=True).
  decode  one query against 32768 cached keys, 32 query heads over 8 kv heads: posenc vs
          SDPA(enable_gqa=True).
Modes: fwd (forward) and fwdbwd (forward and backward of sum(out * dout); q, k, v and the T5
table require gradients). Each repetition runs every implementation once, in turn; the median
over --reps (after one untimed run, which also compiles FlexAttention) is reported, with the
ratio baseline time / posenc time (> 1: posenc is faster), each run's peak memory (the growth of
the process's peak resident set, VmHWM reset through /proc/self/clear_refs, over one run) and the
largest difference of each output from posenc's (the untimed run: the same values computed).
"""

import argparse
import json
import platform
import statistics
import sys
import time

from procmem import peak_kib, reset_peak, rss_kib


def processor():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def build_cases(args, torch, F, pt, posenc):
    """{(case, L, dtype): {implementation: (make_inputs, run)}}; run(inputs, backward)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention, dynamic=False)
    H, D, threads = args.heads, args.dim, args.threads

    def problem(L, dtype, seed=0, kv_heads=None, lq=None):
        g = torch.Generator().manual_seed(seed)
        lq = L if lq is None else lq
        hk = H if kv_heads is None else kv_heads
        q = torch.randn(1, lq, H if kv_heads is None else 32, D, generator=g).to(dtype)
        k = torch.randn(1, L, hk, D, generator=g).to(dtype)
        v = torch.randn(1, L, hk, D, generator=g).to(dtype)
        return q, k, v

    def grads(xs, backward):
        return [x.detach().clone().requires_grad_(backward) for x in xs]

    def finish(out, backward, extra=()):
        if backward:
            out.backward(torch.ones_like(out) * 0.01)
        return out

    def cases_for(L, dtype_name):
        # One (length, dtype): its own scope, so that the closures below keep its tensors.
        dtype = getattr(torch, dtype_name)
        q, k, v = problem(L, dtype)
        bhld = [x.transpose(1, 2).contiguous() for x in (q, k, v)]
        slopes = torch.tensor(posenc.alibi_slopes(H), dtype=torch.float32)
        table = (torch.randn(32, H, generator=torch.Generator().manual_seed(1)) * 0.5)
        # T5 buckets by distance d = q - k >= 0 (causal), and as a [L, L] map for the mask.
        dist_bucket = torch.from_numpy(posenc.t5_bucket(-torch.arange(L).numpy(),
                                                        bidirectional=False))
        causal_block = create_block_mask(lambda b, h, qi, ki: qi >= ki, 1, 1, L, L,
                                         device="cpu")
        idx = torch.arange(L)
        rel = idx[None, :] - idx[:, None]  # k - q
        upper = rel > 0

        def posenc_run(scheme, params=None, scale=None):
            def make(backward):
                xs = grads((q, k, v), backward)
                ps = {n: t.detach().clone().requires_grad_(backward)
                      for n, t in (params or {}).items()}
                return xs, ps

            def run(inp, backward):
                (qq, kk, vv), ps = inp
                kw = {"scale": scale} if scale is not None else {}
                out = pt.attention(qq, kk, vv, scheme, params=ps or None, causal=True,
                                   num_threads=threads, **kw)
                return finish(out, backward)
            return make, run

        def sdpa_run(bias_of=None, scale=None):
            def make(backward):
                xs = grads(bhld, backward)
                t = table.detach().clone().requires_grad_(backward)
                return xs, t

            def run(inp, backward):
                (qq, kk, vv), t = inp
                if bias_of is None:
                    out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True,
                                                         scale=scale)
                else:
                    mask = bias_of(t).to(qq.dtype)
                    out = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask,
                                                         scale=scale)
                return finish(out, backward)
            return make, run

        def flex_run(score_mod, scale=None):
            def make(backward):
                return grads(bhld, False), None

            def run(inp, backward):
                (qq, kk, vv), _ = inp
                return flex(qq, kk, vv, score_mod=score_mod, block_mask=causal_block,
                            scale=scale)
            return make, run

        alibi_mask = torch.where(upper, float("-inf"),
                                 slopes[:, None, None] * rel.float())[None]
        bucket_map = torch.from_numpy(posenc.t5_bucket_map(L, L, bidirectional=False))

        def t5_mask(t):
            # HF T5: position_bias[b, h, i, j] = table[bucket(j - i), h], then the causal mask
            bias = t[bucket_map].permute(2, 0, 1)
            return torch.where(upper, float("-inf"), bias)[None]

        def alibi_mod(score, b, h, qi, ki):
            return score + slopes[h] * (ki - qi).to(score.dtype)

        def t5_mod(score, b, h, qi, ki):
            return score + table[dist_bucket[(qi - ki).clamp(min=0)], h].to(score.dtype)

        cases = {}
        cases[("none", L, dtype_name)] = {"posenc": posenc_run("none"),
                                          "sdpa": sdpa_run()}
        cases[("alibi", L, dtype_name)] = {
            "posenc": posenc_run("alibi"),  # the same slopes (posenc.alibi_slopes)
            "sdpa_mask": sdpa_run(lambda t: alibi_mask),
            "flex": flex_run(alibi_mod)}
        cases[("t5", L, dtype_name)] = {
            "posenc": posenc_run("t5", {"relative_attention_bias": table}, scale=1.0),
            "sdpa_mask": sdpa_run(t5_mask, scale=1.0),
            "flex": flex_run(t5_mod, scale=1.0)}

        inv = posenc.rope_frequencies(D).inv_freq
        ang = torch.arange(L, dtype=torch.float64)[:, None] * torch.from_numpy(inv)[None]
        cos = torch.cat([ang.cos(), ang.cos()], -1).float()[None, None]
        sin = torch.cat([ang.sin(), ang.sin()], -1).float()[None, None]

        def rotate(x):
            x1, x2 = x[..., : D // 2], x[..., D // 2:]
            return (x * cos.to(x.dtype) + torch.cat([-x2, x1], -1) * sin.to(x.dtype))

        def rope_ref():
            make, _ = sdpa_run()

            def run(inp, backward):
                (qq, kk, vv), _ = inp
                out = F.scaled_dot_product_attention(rotate(qq), rotate(kk), vv,
                                                     is_causal=True)
                return finish(out, backward)
            return make, run

        cases[("rope", L, dtype_name)] = {"posenc": posenc_run("rope"),
                                          "rotate_half_sdpa": rope_ref()}
        return cases

    def decode_cases(dtype_name):
        dtype = getattr(torch, dtype_name)
        q, k, v = problem(32768, dtype, kv_heads=8, lq=1)
        bq, bk, bv = (x.transpose(1, 2).contiguous() for x in (q, k, v))

        def prun(inp, backward):
            (qq, kk, vv), _ = inp
            return pt.attention(qq, kk, vv, num_threads=threads)

        def srun(inp, backward):
            (qq, kk, vv), _ = inp
            return F.scaled_dot_product_attention(qq, kk, vv, enable_gqa=True)
        return {("decode", 32768, dtype_name): {
            "posenc": (lambda backward: ((q, k, v), None), prun),
            "sdpa_gqa": (lambda backward: ((bq, bk, bv), None), srun)}}

    cases = {}
    for L in args.seq:
        for dtype_name in args.dtypes:
            cases.update(cases_for(L, dtype_name))
    if "decode" in args.cases:
        for dtype_name in args.dtypes:
            cases.update(decode_cases(dtype_name))
    return {key: impls for key, impls in cases.items() if key[0] in args.cases}


def measure(impls, backward, reps):
    """Median seconds and peak memory (MiB) per implementation, alternating."""
    import torch
    times = {n: [] for n in impls}
    peaks = {n: 0.0 for n in impls}
    diffs = {}
    first = {}
    for rep in range(reps + 1):
        for name, (make, run) in impls.items():
            inp = make(backward)
            base = rss_kib()
            reset_peak()
            with torch.set_grad_enabled(backward):
                t0 = time.perf_counter()
                out = run(inp, backward)
                dt = time.perf_counter() - t0
            peak = (peak_kib() - base) / 1024
            if rep == 0:  # the same values? posenc is [1, L, H, D], the others [1, H, L, D]
                o = out.detach().float()
                first[name] = o if name == "posenc" else o.transpose(1, 2)
            del out, inp
            if rep > 0:
                times[name].append(dt)
                peaks[name] = max(peaks[name], peak)
    for name in impls:
        diffs[name] = float((first[name] - first["posenc"]).abs().max())
    return {n: statistics.median(times[n]) for n in impls}, peaks, diffs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", default="1024,4096,8192")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--cases", default="none,alibi,t5,rope,decode")
    ap.add_argument("--modes", default="fwd,fwdbwd")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    try:
        args.seq = [int(s) for s in args.seq.split(",") if s]
    except ValueError:
        sys.exit(f"--seq: comma-separated lengths (got '{args.seq}')")
    if any(n < 1 or n > 1 << 20 for n in args.seq):
        sys.exit("--seq: lengths from 1 to 2^20")
    args.dtypes = [s for s in args.dtypes.split(",") if s]
    args.cases = [s for s in args.cases.split(",") if s]
    modes = [s for s in args.modes.split(",") if s]
    for name, allowed in (("--dtypes", ("float32", "bfloat16", "float16")),
                          ("--cases", ("none", "alibi", "t5", "rope", "decode"))):
        for s in getattr(args, name[2:]):
            if s not in allowed:
                sys.exit(f"{name}: '{s}' ({', '.join(allowed)})")
    for m in modes:
        if m not in ("fwd", "fwdbwd"):
            sys.exit(f"--modes: '{m}' (fwd or fwdbwd)")

    import torch
    import torch.nn.functional as F

    import posenc
    import posenc._posenc_extras  # noqa: F401  (the SIMD target the harness reports)
    import posenc.torch as pt
    torch.set_num_threads(args.threads)
    header = {"processor": processor(), "threads": args.threads, "torch": torch.__version__,
              "posenc_simd": posenc._posenc_extras._simd_target()}
    if args.json:
        print(json.dumps({"machine": header}), flush=True)
    else:
        print(f"# {header['processor']}, {args.threads} threads, torch {header['torch']}, "
              f"posenc SIMD {header['posenc_simd']}")
        print(f"{'case':8} {'L':>6} {'dtype':9} {'mode':7} {'impl':17} {'seconds':>9} "
              f"{'vs posenc':>9} {'peak MiB':>9} {'max |diff|':>10}")
    cases = build_cases(args, torch, F, pt, posenc)
    for (case, L, dtype), impls in cases.items():
        for mode in modes:
            backward = mode == "fwdbwd"
            if backward and case == "decode":
                continue
            run_impls = {n: f for n, f in impls.items() if not (backward and n == "flex")}
            times, peaks, diffs = measure(run_impls, backward, args.reps)
            for name in run_impls:
                row = {"case": case, "L": L, "dtype": dtype, "mode": mode, "impl": name,
                       "median_s": times[name], "peak_mib": round(peaks[name], 1),
                       "ratio_vs_posenc": times[name] / times["posenc"],
                       "max_abs_diff_vs_posenc": diffs[name]}
                if args.json:
                    print(json.dumps(row), flush=True)
                else:
                    print(f"{case:8} {L:6d} {dtype:9} {mode:7} {name:17} {times[name]:9.4f} "
                          f"{row['ratio_vs_posenc']:9.2f} {peaks[name]:9.1f} "
                          f"{diffs[name]:10.2e}", flush=True)
            if backward and "flex" in impls and not args.json:
                print(f"{case:8} {L:6d} {dtype:9} {mode:7} {'flex':17} {'-':>9} "
                      f"{'(no CPU backward in PyTorch)':>20}", flush=True)


if __name__ == "__main__":
    main()
