#!/usr/bin/env python3
"""transformers RoPE models on attn_implementation="posenc" against "sdpa" (PyTorch's
scaled_dot_product_attention): time and peak memory of a forward, and of a forward + backward,
of a shrunk model at L = 2048 and 8192, measured in one run.

    .venv/bin/python bench/hf_rope_bench.py [--lengths 2048,8192] [--reps 2]
                                            [--cases llama,mistral,llama-padded]
                                            [--modes fwd,fwdbwd] [--json]
    .venv/bin/python bench/hf_rope_bench.py --accuracy   # the measured differences of docs/hf.md
(the package importable: installed in .venv, or PYTHONPATH=build-test/python/stage; transformers
installed).

Cases (the model of a shipped config, shrunk to 2 decoder layers of 4 query heads of 128 dims,
hidden size 512, MLP 1024, vocabulary 1024, random float32 weights; positional settings as
written):

- llama: Llama 3.1 8B's config (GQA 4:2 here, llama3 RoPE scaling), batch 1, causal. sdpa gets
  no mask (is_causal) and runs PyTorch's fused CPU kernel.
- mistral: Mistral 7B's config, sliding window 4096 on every layer: at L = 8192 the window
  matters and sdpa gets a dense [1, 1, L, L] boolean mask.
- llama-padded: the llama case with a batch of 2 whose second row is left padded by 64 tokens:
  sdpa gets a dense [2, 1, L, L] mask; posenc gets key documents.

Every measurement runs in a fresh subprocess (one run's freed memory cannot hide the next one's
peak); the two implementations alternate per repetition (A, B, A, B, ...) and the median is
reported. In each subprocess: the model and inputs are built, one untimed step at L = 256 warms
the code paths, then one step at L is timed; peak memory is the growth of the process's peak
resident set (VmHWM, reset through /proc/self/clear_refs) over that step: activations, the
attention's workspace, masks, gradients.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from procmem import peak_kib, reset_peak, rss_kib  # noqa: E402

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "configs")
CASES = {"llama": "llama-3.1-8b.json", "mistral": "mistral-7b.json",
         "llama-padded": "llama-3.1-8b.json"}


def build(case):
    import torch
    import transformers
    with open(os.path.join(CONFIGS, CASES[case])) as f:
        d = json.load(f)
    for k in ("architectures", "torch_dtype", "_name_or_path"):
        d.pop(k, None)
    kv = d.get("num_key_value_heads") or d["num_attention_heads"]
    d.update(num_attention_heads=4, num_key_value_heads=4 if kv == d["num_attention_heads"] else 2,
             head_dim=128, hidden_size=512, intermediate_size=1024, vocab_size=1024,
             num_hidden_layers=2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
             attention_dropout=0.0)
    mt = d.pop("model_type")
    cfg = transformers.AutoConfig.for_model(mt, **d)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager",
                                                         dtype=torch.float32)


def inputs(case, length):
    import torch
    g = torch.Generator().manual_seed(1)
    batch = 2 if case.endswith("padded") else 1
    ids = torch.randint(3, 1024, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    if case.endswith("padded"):
        mask[1, :64] = 0
        ids[1, :64] = 0
    return ids, mask


def step(model, ids, mask, mode):
    import torch
    if mode == "fwd":
        with torch.no_grad():
            model(ids, attention_mask=mask, use_cache=False)
    else:
        labels = ids.masked_fill(mask == 0, -100)
        out = model(ids, attention_mask=mask, labels=labels, use_cache=False)
        out.loss.backward()


def measure(case, impl, length, mode):
    """One measurement (runs in the subprocess): {seconds, peak_mib}."""
    import posenc.hf
    posenc.hf.register()
    model = build(case)
    model.set_attn_implementation(impl)
    model.train(mode == "fwdbwd")
    ids, mask = inputs(case, 256)
    step(model, ids, mask, mode)
    model.zero_grad(set_to_none=True)
    ids, mask = inputs(case, length)
    reset_peak()
    base = rss_kib()
    t0 = time.perf_counter()
    step(model, ids, mask, mode)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "peak_mib": (peak_kib() - base) / 1024}


def run_child(case, impl, length, mode):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", case, impl, str(length), mode]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def accuracy(only=None):
    """The differences posenc vs eager of every family the tests run (tests/python/
    test_hf_backend.py's shrunk models), as a Markdown table; only: a comma-separated list of
    name substrings (None: every family)."""
    import torch
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                    "python"))
    import posenc.hf
    from test_hf_backend import FAMILIES, _ids, make_model
    posenc.hf.register()
    print("| config | logits (float32) | gradients (float32) | padded logits | bf16: posenc / "
          "eager error |")
    print("|---|---|---|---|---|")
    for name, layers, _ in FAMILIES:
        if only and not any(part in name for part in only.split(",")):
            continue
        model = make_model(name, layers).train()
        ids = _ids(2, 13)
        res = {}
        for impl in ("eager", "posenc"):
            model.set_attn_implementation(impl)
            model.zero_grad()
            out = model(ids, labels=ids)
            out.loss.backward()
            res[impl] = (out.logits.detach(), {n: p.grad.clone() for n, p in
                                               model.named_parameters() if p.grad is not None})
        (la, ga), (lb, gb) = res["eager"], res["posenc"]
        logit = float((la - lb).abs().max() / la.abs().max())
        grad = max(float((ga[n] - gb[n]).abs().max() / ga[n].abs().max().clamp_min(1e-30))
                   for n in ga if float(ga[n].abs().max()) > 0)
        model.eval()
        pids = _ids(2, 13, seed=2)
        mask = torch.ones_like(pids)
        mask[0, :3] = 0
        mask[1, -4:] = 0
        pids = pids.masked_fill(mask == 0, 0)
        with torch.no_grad():
            outs = []
            for impl in ("eager", "posenc"):
                model.set_attn_implementation(impl)
                outs.append(model(pids, attention_mask=mask).logits[mask.bool()])
            padded = float((outs[0] - outs[1]).abs().max() / outs[0].abs().max())
            bids = _ids(2, 11, seed=4)
            model.set_attn_implementation("eager")
            exact = None
            model.to(torch.bfloat16)
            e16 = model(bids).logits.float()
            model.set_attn_implementation("posenc")
            p16 = model(bids).logits.float()
            model.float()
            model.set_attn_implementation("eager")
            exact = model(bids).logits
            scale = float(exact.abs().max())
            ee = float((e16 - exact).abs().max()) / scale
            pe = float((p16 - exact).abs().max()) / scale
        print(f"| {name.removesuffix('.json')} | {logit:.1e} | {grad:.1e} | {padded:.1e} | {pe:.1e} / {ee:.1e} |",
              flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="2048,8192")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--cases", default="llama,mistral,llama-padded")
    ap.add_argument("--modes", default="fwd,fwdbwd")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--only", default=None,
                    help="with --accuracy: comma-separated substrings of the family names")
    ap.add_argument("--accuracy", action="store_true",
                    help="print the differences against eager instead of timing")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.accuracy:
        accuracy(a.only)
        return
    if a.child:
        case, impl, length, mode = a.child
        print(json.dumps(measure(case, impl, int(length), mode)))
        return
    rows = []
    for case in a.cases.split(","):
        for length in (int(x) for x in a.lengths.split(",")):
            for mode in a.modes.split(","):
                res = {"sdpa": [], "posenc": []}
                for _ in range(a.reps):
                    for impl in ("sdpa", "posenc"):
                        res[impl].append(run_child(case, impl, length, mode))
                row = {"case": case, "L": length, "mode": mode}
                for impl in ("sdpa", "posenc"):
                    row[f"{impl}_s"] = statistics.median(r["seconds"] for r in res[impl])
                    row[f"{impl}_mib"] = statistics.median(r["peak_mib"] for r in res[impl])
                row["time_ratio"] = row["posenc_s"] / row["sdpa_s"]
                rows.append(row)
                if not a.json:
                    print(f"{case:13s} L={length:5d} {mode:7s} sdpa {row['sdpa_s']:8.3f} s "
                          f"{row['sdpa_mib']:8.1f} MiB | posenc {row['posenc_s']:8.3f} s "
                          f"{row['posenc_mib']:8.1f} MiB | posenc/sdpa time "
                          f"{row['time_ratio']:.2f}", flush=True)
    if a.json:
        print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
