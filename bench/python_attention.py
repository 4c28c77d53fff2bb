#!/usr/bin/env python3
"""posenc from Python: calling overhead, and posenc.torch against PyTorch's own materialized
attention (matmul, bias, softmax, matmul, autograd) at L = 4096, 8 heads, D = 128, causal,
float32, forward + backward, for every scheme. Time and peak memory, measured in one run.

    .venv/bin/python bench/python_attention.py [--seq 4096] [--heads 8] [--dim 128]
                                               [--threads N] [--reps 3] [--rounds 2]
                                               [--schemes a,b] [--json]
(.venv/ with torch and NumPy: made by scripts/python-env.sh or scripts/setup.sh; the package
importable: installed in .venv, or PYTHONPATH=build-test/python/stage for the test build).

Overhead: seconds per call of posenc.attention (and of posenc.torch.attention, forward only)
on small shapes minus the seconds per call of the same C++ call timed in C++ (arguments parsed
once; posenc._posenc._time_attention).

Large shapes: every measurement runs in a fresh subprocess (so one run's freed memory cannot
hide the next one's peak), the two implementations alternating per repetition; the median
time of `--reps` forward + backward steps (after one untimed step) is reported. Peak memory is
the growth of the process's peak resident set (VmHWM, reset through /proc/self/clear_refs)
over one step, after the inputs exist: workspace, outputs, gradients and whatever autograd
saves. Materialized baselines are what an eager PyTorch model computes: relative terms by
matmul against the relative table and a gather (Shaw, DeBERTa, Transformer-XL), bias tensors
[H, L, L] (ALiBi, T5), rotated copies (RoPE), a boolean causal mask.
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

from procmem import peak_kib, reset_peak, rss_kib


def scheme_names():
    """The registry's schemes (posenc.SCHEMES), read in a subprocess like every measurement."""
    out = subprocess.run([sys.executable, "-c", "import posenc; print(','.join(posenc.SCHEMES))"],
                         check=True, capture_output=True, text=True)
    return tuple(out.stdout.strip().split(","))


# ---- one measurement, in a subprocess -----------------------------------------------------------

def make_problem(scheme, L, H, D, seed=0):
    import torch
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, L, H, D, generator=g).requires_grad_()
    k = torch.randn(1, L, H, D, generator=g).requires_grad_()
    v = torch.randn(1, L, H, D, generator=g).requires_grad_()
    params = {}
    if scheme == "t5":
        params["relative_attention_bias"] = torch.randn(32, H, generator=g) * 0.1
    elif scheme == "shaw":
        params["rel_k"] = torch.randn(33, D, generator=g) * 0.1
        params["rel_v"] = torch.randn(33, D, generator=g) * 0.1
    elif scheme == "xl":
        params["r_w_bias"] = torch.randn(H, D, generator=g) * 0.1
        params["r_r_bias"] = torch.randn(H, D, generator=g) * 0.1
        params["r_net"] = torch.randn(H * D, H * D, generator=g) / math.sqrt(H * D)
    elif scheme == "deberta":
        params["pos_key"] = torch.randn(512, H, D, generator=g) * 0.1
        params["pos_query"] = torch.randn(512, H, D, generator=g) * 0.1
    for t in params.values():
        t.requires_grad_()
    kw = {"deberta": {"position_buckets": 256, "max_relative_positions": 512,
                      "deberta_p2c": "model"}}.get(scheme, {})
    return q, k, v, params, kw


def posenc_step(scheme, q, k, v, params, kw):
    import posenc.torch as pt
    out = pt.attention(q, k, v, scheme, params=params or None, causal=True, **kw)
    out.backward(torch_ones_like(out))


def torch_ones_like(t):
    import torch
    return torch.ones_like(t)


def materialized_step(scheme, q, k, v, params, kw):
    """PyTorch eager attention: [B, H, L, L] scores, bias, mask, softmax, matmul, autograd."""
    import torch
    B, L, H, D = q.shape
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, L, D]
    pos = torch.arange(L)
    rel = pos[None, :] - pos[:, None]  # key minus query [L, L]
    scale = 1.0 / math.sqrt((3 if scheme == "deberta" else 1) * D)
    if scheme == "rope":
        inv = 10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
        ang = pos[:, None].double() * inv
        c, s = torch.cos(ang).float(), torch.sin(ang).float()

        def rot(x):
            x1, x2 = x[..., :D // 2], x[..., D // 2:]
            return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)
        qh, kh = rot(qh), rot(kh)
    scores = torch.matmul(qh, kh.transpose(-1, -2))
    if scheme == "shaw":
        kk = (params["rel_k"].shape[0] - 1) // 2
        idx = (rel.clamp(-kk, kk) + kk)[None, None].expand(B, H, L, L)
        qr = torch.matmul(qh, params["rel_k"].t())  # [B, H, L, 2K+1]
        scores = scores + torch.gather(qr, -1, idx)
    elif scheme == "xl":
        hd = H * D
        u, vb, rnet = params["r_w_bias"], params["r_r_bias"], params["r_net"]
        scores = scores + torch.matmul(u[None, :, None, :], kh.transpose(-1, -2))
        dm = rnet.shape[1]
        delta = torch.arange(L - 1, -L, -1)  # distances pos_q - pos_k, descending
        w = 10000.0 ** (-2.0 * torch.arange(dm // 2, dtype=torch.float64) / dm)
        a = delta[:, None].double() * w
        R = torch.cat([torch.sin(a), torch.cos(a)], -1).float()  # [2L-1, Dm]
        r = torch.matmul(R, rnet.t()).view(2 * L - 1, H, D).permute(1, 2, 0)  # [H, D, 2L-1]
        bd = torch.matmul(qh + vb[None, :, None, :], r[None])  # [B, H, L, 2L-1]
        idx = (rel + (L - 1))[None, None].expand(B, H, L, L)  # column of pos_q - pos_k
        scores = scores + torch.gather(bd, -1, idx)
    elif scheme == "deberta":
        span = kw["position_buckets"]
        mid = span // 2
        rho = -rel
        absr = torch.where((rho < mid) & (rho > -mid), torch.full_like(rho, mid - 1), rho.abs())
        logp = torch.ceil(torch.log(absr.float() / mid) /
                          math.log((kw["max_relative_positions"] - 1) / mid) * (mid - 1)) + mid
        bucket = torch.where(absr <= mid, rho, (logp * torch.sign(rho)).long())
        c2p = (bucket + span).clamp(0, 2 * span - 1)[None, None].expand(B, H, L, L)
        pk = params["pos_key"].permute(1, 2, 0)  # [H, D, 2K]
        pq = params["pos_query"].permute(1, 2, 0)
        scores = scores + torch.gather(torch.matmul(qh, pk[None]), -1, c2p)
        scores = scores + torch.gather(torch.matmul(kh, pq[None]), -1, c2p).transpose(-1, -2)
    scores = scores * scale
    if scheme == "alibi":
        import posenc
        m = torch.from_numpy(posenc.alibi_slopes(H)).float()
        scores = scores - m[:, None, None] * rel.abs()[None].float()
    elif scheme == "t5":
        import posenc
        bucket = torch.from_numpy(posenc.t5_bucket(rel.numpy(), bidirectional=False))
        scores = scores + params["relative_attention_bias"][bucket].permute(2, 0, 1)[None]
    scores = scores.masked_fill(rel[None, None] > 0, float("-inf"))
    p = torch.softmax(scores, dim=-1)
    out = torch.matmul(p, vh)
    if scheme == "shaw":
        kk = (params["rel_v"].shape[0] - 1) // 2
        bucketed = torch.zeros(B, H, L, 2 * kk + 1).scatter_add_(
            -1, (rel.clamp(-kk, kk) + kk)[None, None].expand(B, H, L, L), p)
        out = out + torch.matmul(bucketed, params["rel_v"])
    out = out.transpose(1, 2)
    out.backward(torch.ones_like(out))


def child(args):
    import torch
    torch.set_num_threads(args.threads)
    q, k, v, params, kw = make_problem(args.scheme, args.seq, args.heads, args.dim)
    step = posenc_step if args.impl == "posenc" else materialized_step
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    step(args.scheme, q, k, v, params, kw)  # warm-up
    for t in [q, k, v, *params.values()]:
        t.grad = None
    base = rss_kib()
    reset_peak()
    t0 = time.perf_counter()
    step(args.scheme, q, k, v, params, kw)
    dt = time.perf_counter() - t0
    peak = peak_kib() - base
    times = [dt]
    for _ in range(args.reps - 1):
        for t in [q, k, v, *params.values()]:
            t.grad = None
        t0 = time.perf_counter()
        step(args.scheme, q, k, v, params, kw)
        times.append(time.perf_counter() - t0)
    print(json.dumps({"times": times, "peak_mib": peak / 1024}))


# ---- overhead ----------------------------------------------------------------------------------

def overhead(threads):
    import numpy as np
    import posenc
    rng = np.random.default_rng(0)
    rows = []
    for name, shape_q, shape_k in [("decode 1x64, 4/2 heads, D 64", (1, 1, 4, 64), (1, 64, 2, 64)),
                                   ("prefill 16, 4 heads, D 32", (1, 16, 4, 32), (1, 16, 4, 32))]:
        q = rng.standard_normal(shape_q).astype(np.float32)
        k = rng.standard_normal(shape_k).astype(np.float32)
        for scheme in ("none", "alibi", "rope"):
            kw = {"causal": True, "num_threads": threads}
            n = 3000
            cpp = posenc._posenc._time_attention(q, k, k, scheme, n, **kw)
            posenc.attention(q, k, k, scheme, **kw)
            t0 = time.perf_counter()
            for _ in range(n):
                posenc.attention(q, k, k, scheme, **kw)
            py = (time.perf_counter() - t0) / n
            row = {"shape": name, "scheme": scheme, "cpp_us": cpp * 1e6, "numpy_us": py * 1e6,
                   "numpy_overhead_us": (py - cpp) * 1e6}
            try:
                import torch
                import posenc.torch as pt
                tq, tk = torch.from_numpy(q), torch.from_numpy(k)
                with torch.no_grad():
                    pt.attention(tq, tk, tk, scheme, **kw)
                    t0 = time.perf_counter()
                    for _ in range(n):
                        pt.attention(tq, tk, tk, scheme, **kw)
                    tt = (time.perf_counter() - t0) / n
                row.update(torch_us=tt * 1e6, torch_overhead_us=(tt - cpp) * 1e6)
            except ImportError:
                pass
            rows.append(row)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--reps", type=int, default=3, help="timed steps per subprocess")
    ap.add_argument("--rounds", type=int, default=2, help="subprocesses per implementation")
    ap.add_argument("--schemes", default=None,
                    help="comma-separated schemes (default: every scheme posenc has)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--skip-overhead", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--impl", help=argparse.SUPPRESS)
    ap.add_argument("--scheme", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)

    out = {"seq": args.seq, "heads": args.heads, "dim": args.dim, "threads": args.threads}
    if not args.skip_overhead:
        out["overhead"] = overhead(1)
        if not args.json:
            print("calling overhead (1 thread; python - C++ per call):")
            for r in out["overhead"]:
                print(f"  {r['shape']:<30} {r['scheme']:<6} C++ {r['cpp_us']:8.1f} us   "
                      f"numpy +{r['numpy_overhead_us']:5.1f} us   "
                      f"torch +{r.get('torch_overhead_us', float('nan')):5.1f} us")
    results = []
    schemes = scheme_names() if args.schemes is None else args.schemes.split(",")
    for scheme in [s for s in schemes if s]:  # --schemes "": overhead only
        runs = {"posenc": [], "torch": []}
        peaks = {}
        for rep in range(args.rounds):  # subprocesses per implementation, alternating
            for impl in ("posenc", "torch") if rep == 0 else ("torch", "posenc"):
                cmd = [sys.executable, os.path.abspath(__file__), "--child", "--impl", impl,
                       "--scheme", scheme, "--seq", str(args.seq), "--heads", str(args.heads),
                       "--dim", str(args.dim), "--threads", str(args.threads),
                       "--reps", str(args.reps)]
                env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
                r = subprocess.run(cmd, capture_output=True, text=True, env=env)
                if r.returncode != 0:
                    raise SystemExit(f"{scheme} {impl}: {r.stderr}")
                m = json.loads(r.stdout.strip().splitlines()[-1])
                runs[impl] += m["times"]
                peaks[impl] = max(peaks.get(impl, 0), m["peak_mib"])
        row = {"scheme": scheme,
               "posenc_s": statistics.median(runs["posenc"]),
               "torch_s": statistics.median(runs["torch"]),
               "posenc_peak_mib": peaks["posenc"], "torch_peak_mib": peaks["torch"]}
        row["speedup"] = row["torch_s"] / row["posenc_s"]
        row["memory_ratio"] = row["torch_peak_mib"] / max(row["posenc_peak_mib"], 1e-9)
        results.append(row)
        if not args.json:
            print(f"{scheme:<8} posenc {row['posenc_s']:7.3f} s {row['posenc_peak_mib']:8.1f} MiB"
                  f"   torch {row['torch_s']:7.3f} s {row['torch_peak_mib']:8.1f} MiB"
                  f"   speedup {row['speedup']:5.2f} x   memory {row['memory_ratio']:6.1f} x",
                  flush=True)
    out["attention"] = results
    if args.json:
        print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
