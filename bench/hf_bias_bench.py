#!/usr/bin/env python3
"""posenc.hf.patch against transformers' own attention on shrunk bias-family models: T5 (bucket
bias), BLOOM (ALiBi) and DeBERTa-v3 (disentangled c2p + p2c). Time and peak memory of a forward
and of a forward + backward at L = 2048 and 8192, measured in one run.

    .venv/bin/python bench/hf_bias_bench.py [--lengths 2048,8192] [--families t5,bloom,deberta]
                                            [--layers 1] [--hidden 256] [--heads 4]
                                            [--reps 2] [--rounds 2] [--warmup 1] [--json]
(.venv/ with torch and transformers; posenc importable: installed, or
PYTHONPATH=build-test/python/stage.)

Models: random weights from tests/configs (t5-base, bloom-560m, deberta-v3-base) shrunk to
`--layers` layers (default 1), hidden size `--hidden`, `--heads` heads, the positional
settings intact (32 buckets / max distance 128, ALiBi, position_buckets 256 /
max_relative_positions 512); batch 1, float32, no padding. The baseline is transformers' "sdpa"
attention where the model has one (T5), else "eager" (BLOOM, DeBERTa: their attention is written
out in the model). T5 runs encoder and decoder with L tokens each (encoder self, decoder self and
cross attention).

Every measurement runs in a fresh subprocess (one run's freed memory cannot hide the next one's
peak); the implementations alternate per round. Time: the median of `--reps` steps after
`--warmup` untimed steps (default 1). Peak: the growth of the process's peak resident set
(VmHWM, reset through /proc/self/clear_refs) over the last timed step, after the model and
inputs exist (`--warmup 0`: no untimed step, for long runs). "LxL": the bytes of every tensor a
forward creates whose last two dimensions are (L, L) (scores, probabilities, biases, masks,
relative positions), counted in a separate forward (L <= --lxl-max). The bias alone
(transformers' own tensors, by shape): T5 position_bias [1, H, L, L] per stack and
cross-attention's zero bias, BLOOM's [B, 1, L, L] mask (its ALiBi [B*H, 1, L] is added inside the
score matmul), DeBERTa's [1, L, L] relative positions and [B, 1, L, L] mask (int64) and its
c2p / p2c terms [B*H, L, L].
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from procmem import peak_kib, reset_peak  # noqa: E402

CONFIGS = os.path.join(HERE, "..", "tests", "configs")


def build(family, layers, hidden, heads, impl):
    """(model, inputs dict) for one family; impl 'hf' or 'posenc'."""
    import torch
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
    name = {"t5": "t5-base", "bloom": "bloom-560m", "deberta": "deberta-v3-base"}[family]
    with open(os.path.join(CONFIGS, name + ".json")) as f:
        d = json.load(f)
    for k in ("_name_or_path", "architectures"):
        d.pop(k, None)
    if family == "t5":
        d.update(d_model=hidden, d_kv=hidden // heads, num_heads=heads, d_ff=2 * hidden,
                 num_layers=layers, num_decoder_layers=layers, vocab_size=256, dropout_rate=0.0)
    elif family == "bloom":
        d.update(hidden_size=hidden, n_head=heads, n_layer=layers, vocab_size=256)
    else:
        d.update(hidden_size=hidden, num_attention_heads=heads, intermediate_size=2 * hidden,
                 num_hidden_layers=layers, vocab_size=256, hidden_dropout_prob=0.0,
                 attention_probs_dropout_prob=0.0, max_position_embeddings=16384)
    cfg = AutoConfig.for_model(d.pop("model_type"), **d)
    base = "sdpa" if family == "t5" else "eager"
    torch.manual_seed(0)
    auto = AutoModelForCausalLM if family == "bloom" else AutoModel
    model = auto.from_config(cfg, attn_implementation=base).eval()
    if impl == "posenc":
        import posenc.hf
        posenc.hf.patch(model)
    return model, base


def inputs(family, L):
    import torch
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 256, (1, L), generator=g)
    kw = {"input_ids": ids}
    if family == "t5":
        kw["decoder_input_ids"] = torch.randint(2, 256, (1, L), generator=g)
    return kw


def output_tensor(out):
    return out.logits if hasattr(out, "logits") and out.logits is not None else out[0]


def measure(family, L, impl, mode, layers, hidden, heads, reps, threads, lxl_pass=True,
            warmup=1):
    """One measurement (in a subprocess): {'seconds', 'peak_mib', 'lxl_mib'}."""
    import torch
    if threads:
        torch.set_num_threads(threads)
    model, base = build(family, layers, hidden, heads, impl)
    kw = inputs(family, L)

    def step():
        if mode == "fwd":
            with torch.no_grad():
                output_tensor(model(**kw))
        else:
            model.zero_grad(set_to_none=True)
            output_tensor(model(**kw)).float().square().mean().backward()

    for _ in range(warmup):
        step()
    times = []
    peak = 0.0
    for i in range(reps):
        last = i == reps - 1
        if last:  # the last timed step also gives the peak
            model.zero_grad(set_to_none=True)
            reset_peak()
            before = peak_kib()
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
        if last:
            peak = (peak_kib() - before) / 1024
    lxl = lxl_bytes(model, kw, L) / 2**20 if mode == "fwd" and lxl_pass else None
    return {"seconds": statistics.median(times), "peak_mib": peak, "lxl_mib": lxl,
            "baseline": base}


def lxl_bytes(model, kw, L):
    """Bytes of the tensors a forward creates whose last two dims are (L, L)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Rec(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor) and t.dim() >= 2 and tuple(t.shape[-2:]) == (L, L):
                    Rec.total += t.numel() * t.element_size()
            return out

    with torch.no_grad(), Rec():
        output_tensor(model(**kw))
    return Rec.total


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="2048,8192")
    ap.add_argument("--families", default="t5,bloom,deberta")
    ap.add_argument("--modes", default="fwd,fwdbwd")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--lxl-max", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # family,L,impl,mode: one measurement
    a = ap.parse_args()
    if a.one:
        fam, L, impl, mode = a.one.split(",")
        print(json.dumps(measure(fam, int(L), impl, mode, a.layers, a.hidden, a.heads, a.reps,
                                 a.threads, int(L) <= a.lxl_max, a.warmup)))
        return
    rows = []
    for fam in a.families.split(","):
        for L in (int(x) for x in a.lengths.split(",")):
            for mode in a.modes.split(","):
                res = {"hf": [], "posenc": []}
                for _ in range(a.rounds):
                    for impl in ("hf", "posenc"):
                        cmd = [sys.executable, __file__, "--one", f"{fam},{L},{impl},{mode}",
                               "--layers", str(a.layers), "--hidden", str(a.hidden),
                               "--heads", str(a.heads), "--reps", str(a.reps),
                               "--threads", str(a.threads), "--lxl-max", str(a.lxl_max),
                               "--warmup", str(a.warmup)]
                        p = subprocess.run(cmd, capture_output=True, text=True)
                        if p.returncode != 0:
                            res[impl].append({"error": p.stderr.strip().splitlines()[-1]})
                            continue
                        res[impl].append(json.loads(p.stdout.strip().splitlines()[-1]))
                row = {"family": fam, "L": L, "mode": mode}
                for impl, runs in res.items():
                    ok = [r for r in runs if "error" not in r]
                    if not ok:
                        row[impl] = {"error": runs[0]["error"]}
                        continue
                    row[impl] = {"seconds": statistics.median(r["seconds"] for r in ok),
                                 "peak_mib": max(r["peak_mib"] for r in ok),
                                 "lxl_mib": ok[0]["lxl_mib"], "baseline": ok[0]["baseline"]}
                if "seconds" in row["hf"] and "seconds" in row["posenc"]:
                    row["speedup"] = row["hf"]["seconds"] / row["posenc"]["seconds"]
                rows.append(row)
                if not a.json:
                    print(_line(row), flush=True)
    if a.json:
        print(json.dumps(rows, indent=1))


def _line(row):
    def part(r):
        if "error" in r:
            return f"error: {r['error'][:60]}"
        lxl = "" if r["lxl_mib"] is None else f", LxL {r['lxl_mib']:.0f} MiB"
        return f"{r['seconds']:.3f} s, peak +{r['peak_mib']:.0f} MiB{lxl}"
    base = row["hf"].get("baseline", "?")
    s = (f"{row['family']:8s} L={row['L']:5d} {row['mode']:6s} | hf ({base}): "
         f"{part(row['hf'])} | posenc: {part(row['posenc'])}")
    if "speedup" in row:
        s += f" | x{row['speedup']:.2f}"
    return s


if __name__ == "__main__":
    main()
