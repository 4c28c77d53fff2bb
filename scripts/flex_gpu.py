#!/usr/bin/env python3
"""posenc.torch.flex on a CUDA GPU: correctness against posenc's CPU results, then timings.

    python scripts/flex_gpu.py                      # both parts, on cuda
    python scripts/flex_gpu.py --part check         # only the correctness cases
    python scripts/flex_gpu.py --part time --lengths 4096 8192 --schemes alibi
    python scripts/flex_gpu.py --device cpu --quick # the script's own dry run (CPU, small)

Part 1 (check) runs the cases of tests/python/test_flex.py with FlexAttention on the GPU, in
float32 and in bf16, forward and backward (out, dq, dk, dv and every table's gradient): eagerly
(flex_attention's reference implementation on the GPU) for every case, and through
torch.compile'd flex_attention (the fused Triton kernels) for a subset, against posenc on the
CPU (the float64 oracle, with posenc's float32 / bf16 result as the yardstick: tolerance rule in
test_flex.py, Problem.check). It prints one row per case, dtype and tensor.

Part 2 (time) times posenc.torch.flex.attention (compiled flex_attention, bf16, causal, batch 1,
8 heads, head_dim 128) against torch's scaled_dot_product_attention with the scheme's bias
materialized as a [1, heads, L, L] attn_mask (causal -inf folded in), forward and forward +
backward, at L = 4096 .. 32768, and prints a Markdown table (median of --repeat timed runs after
two warm-up runs, CUDA events; peak memory from torch.cuda.max_memory_allocated). The "flex
kernel" column calls flex_attention with a block mask and score_mod built once; the
"flex.attention" column is the whole call (the block mask rebuilt each time, as a training step
without caching does). An out-of-memory run prints OOM.

Both parts compile many kernels (the check: a forward and a backward for each compiled case and
dtype; the timings: three per scheme and length), which takes minutes: under a time limit, run
`--part check` and `--part time` as separate commands, and narrow --lengths / --schemes.

Without a CUDA device (and without --device cpu) it prints a message and exits with status 0.
Exit status 1 when a comparison fails.
"""

import argparse
import os
import statistics
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(HERE), "tests", "python")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--part", choices=("check", "time", "all"), default="all")
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    ap.add_argument("--schemes", nargs="+", default=["alibi", "t5"])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--quick", action="store_true",
                    help="small sizes and no compilation (a dry run of the script)")
    args = ap.parse_args()

    try:
        import torch
    except ImportError:
        print("flex_gpu: PyTorch is not installed; nothing to do.")
        return 0
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("flex_gpu: no CUDA device is available (torch.cuda.is_available() is False); "
              "the GPU checks and timings were not run. The CPU tests "
              "(tests/python/test_flex.py) are the contract.")
        return 0
    warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
    sys.path.insert(0, TESTS)
    dev = torch.device(args.device)
    if dev.type == "cuda":
        print(f"device: {torch.cuda.get_device_name(dev)}, torch {torch.__version__}")
    failures = 0
    if args.part in ("check", "all"):
        failures += check(torch, dev, args.quick)
    if args.part in ("time", "all"):
        timings(torch, dev, args)
    print(f"\n{failures} failing comparison(s)" if failures else "\nall comparisons passed")
    return 1 if failures else 0


# Cases that also run through compiled flex_attention (each compiles a forward and a backward).
COMPILED_CASES = ("t5-causal-chunk-softcap", "shaw-per-head-positions",
                  "deberta-buckets-paper-causal", "sinks-t5-gqa", "rope-causal-gqa")


def check(torch, dev, quick):
    import test_flex as tf
    print("\n## Correctness: flex on", dev, "vs posenc on the CPU (max |err| / tolerance)\n")
    print("| case | mode | dtype | tensor | max error | tolerance | ok |")
    print("|---|---|---|---|---|---|---|")
    failures = 0
    cases = list(tf.FORWARD_AND_BACKWARD)
    for name, scheme, kw in cases:
        modes = [("eager", False)]
        if name in COMPILED_CASES and not quick and dev.type != "cpu":
            modes.append(("compiled", True))
        for mode, compile in modes:
            for dtype in (torch.float32, torch.bfloat16):
                try:
                    rows = tf.Problem(name, scheme, **kw).check(
                        grad=True, flex_kw={"compile": compile}, device=dev, dtype=dtype,
                        report=True)
                except Exception as e:  # report and go on: one row per failing case
                    failures += 1
                    print(f"| {name} | {mode} | {str(dtype)[6:]} | - | {type(e).__name__}: "
                          f"{str(e).splitlines()[0][:120]} | - | FAIL |")
                    continue
                for tensor, err, tol in rows:
                    ok = err <= tol
                    failures += not ok
                    print(f"| {name} | {mode} | {str(dtype)[6:]} | {tensor} | {err:.2e} | "
                          f"{tol:.2e} | {'ok' if ok else 'FAIL'} |")
            sys.stdout.flush()
    return failures


def _bias(torch, scheme, L, H, dev, table, dtype):
    """The scheme's causal bias [1, H, L, L] in dtype, -inf above the diagonal, built head by
    head (one [L, L] float32 temporary)."""
    import numpy as np
    import posenc
    i = torch.arange(L, device=dev, dtype=torch.int32)
    rel = i[None, :] - i[:, None]  # key minus query
    future = rel > 0
    bias = torch.empty(1, H, L, L, device=dev, dtype=dtype)
    if scheme == "alibi":
        m = posenc.alibi_slopes(H)
        dist = rel.abs().float()
        for h in range(H):
            bias[0, h] = (dist * -float(m[h])).masked_fill_(future, float("-inf"))
    else:
        t = 1024
        idx = torch.from_numpy(np.asarray(posenc.t5_bucket(
            np.arange(-t, t + 1), num_buckets=table.shape[0], bidirectional=False))).to(dev)
        buckets = idx[rel.clamp(-t, t) + t]
        for h in range(H):
            bias[0, h] = table[:, h].float()[buckets].masked_fill_(future, float("-inf"))
    return bias


def _time(torch, fn, repeat, dev):
    """Median milliseconds of fn() over `repeat` runs after two warm-up runs."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeat):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return f"{statistics.median(times):.2f}"


def _measure(torch, fn, repeat, dev):
    """_time, or OOM / n/a (a backward FlexAttention lacks on the CPU) / the error's name."""
    try:
        return _time(torch, fn, repeat, dev)
    except torch.OutOfMemoryError:
        return "OOM"
    except NotImplementedError:
        return "n/a"


def timings(torch, dev, args):
    import torch.nn.functional as F
    from torch.nn.attention import flex_attention as fa
    import posenc.torch as pt
    fx = pt.flex
    H, D = args.heads, args.head_dim
    lengths = [256, 512] if args.quick else args.lengths
    compile = not args.quick and dev.type != "cpu"
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    kernel = torch.compile(fa.flex_attention, dynamic=False) if compile else fa.flex_attention
    print(f"\n## Timings: flex vs SDPA with a materialized bias (causal, batch 1, {H} heads, "
          f"head_dim {D}, {str(dtype)[6:]}, median of {args.repeat}; ms)\n")
    print("| scheme | L | flex kernel fwd | flex.attention fwd | SDPA+bias fwd | bias build | "
          "flex kernel fwd+bwd | SDPA+bias fwd+bwd | peak GiB flex / SDPA | max abs(flex - SDPA) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    g = torch.Generator(device="cpu").manual_seed(0)
    for scheme in args.schemes:
        for L in lengths:
            q, k, v = (torch.randn(1, L, H, D, generator=g).to(dev, dtype) for _ in range(3))
            table = torch.randn(32, H, generator=g).to(dev) * 0.5
            params = {"relative_attention_bias": table} if scheme == "t5" else None
            do = torch.randn(1, H, L, D, generator=g).to(dev, dtype)
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
            cells, peak, outs = {}, ["-", "-"], [None, None]
            _reset(torch, dev)
            try:
                mod = fx.score_mod(scheme, q, k, params=params, causal=True)
                bm = fx.block_mask(L, L, causal=True, device=dev, compile=compile or None)

                def flex_fwd():
                    return kernel(qt, kt, vt, score_mod=mod, block_mask=bm, scale=mod.scale)
                cells["fk"] = _measure(torch, flex_fwd, args.repeat, dev)
                cells["fa"] = _measure(torch, lambda: fx.attention(
                    q, k, v, scheme, params=params, causal=True, compile=compile),
                    args.repeat, dev)
                qg, kg, vg = (x.detach().requires_grad_() for x in (qt, kt, vt))

                def flex_step():
                    kernel(qg, kg, vg, score_mod=mod, block_mask=bm,
                           scale=mod.scale).backward(do)
                cells["fb"] = _measure(torch, flex_step, args.repeat, dev)
                outs[0] = flex_fwd()
                peak[0] = _peak(torch, dev)
                qg = kg = vg = bm = None  # free before the SDPA runs
            except torch.OutOfMemoryError:
                pass
            _reset(torch, dev)
            try:
                cells["bb"] = _measure(torch, lambda: _bias(torch, scheme, L, H, dev, table,
                                                            dtype), args.repeat, dev)
                bias = _bias(torch, scheme, L, H, dev, table, dtype)

                def sdpa_fwd():
                    return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=bias)
                cells["sf"] = _measure(torch, sdpa_fwd, args.repeat, dev)
                qg, kg, vg = (x.detach().requires_grad_() for x in (qt, kt, vt))

                def sdpa_step():
                    F.scaled_dot_product_attention(qg, kg, vg, attn_mask=bias).backward(do)
                cells["sb"] = _measure(torch, sdpa_step, args.repeat, dev)
                outs[1] = sdpa_fwd()
                peak[1] = _peak(torch, dev)
                bias = qg = kg = vg = None
            except torch.OutOfMemoryError:
                pass
            diff = (f"{float((outs[0].float() - outs[1].float()).abs().max()):.1e}"
                    if outs[0] is not None and outs[1] is not None else "-")
            row = [scheme, str(L)] + [cells.get(key, "OOM") for key in
                                      ("fk", "fa", "sf", "bb", "fb", "sb")]
            row += [f"{peak[0]} / {peak[1]}", diff]
            print("| " + " | ".join(row) + " |")
            outs = None
            sys.stdout.flush()


def _reset(torch, dev):
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)


def _peak(torch, dev):
    if dev.type != "cuda":
        return "-"
    return f"{torch.cuda.max_memory_allocated(dev) / 2 ** 30:.1f}"


if __name__ == "__main__":
    sys.exit(main())
