"""Train short, test long: the extrapolation experiment of Press, Smith & Lewis (ICLR 2022, Fig. 1)
with posenc's own attention (docs/extrapolation.md).

One small decoder-only byte-level language model per positional scheme, all with the same size,
data, batches, optimizer, step count and seed (the weights shared by every scheme are initialized
identically); the attention core of every layer is posenc.torch.attention (the fused float32
forward and backward kernels). Each model trains on windows of L_train bytes and is evaluated on
non-overlapping validation windows of L_train x 1, 2, 4, 8, 16 bytes, every window starting at
position 0 as in training.

Data: the King James Bible of Debian's bible-kjv-text package, printed by its `bible` program
(scripts/deps.sh installs it) and cached under ~/.cache/posenc; split by book (validation:
Joshua, Ecclesiastes, Mark, Romans), or any text file given with --corpus.

    python3 -m posenc.experiments.extrapolation --out runs/extrapolation   # the full run
    python3 -m posenc.experiments.extrapolation --quick --out /tmp/x        # about a minute
    python3 -m posenc.experiments.extrapolation --merge runs/seed0 runs/seed1 --out runs/both

Writes DIR/results.json, DIR/results.md (a table), DIR/extrapolation.{png,svg} (perplexity
against evaluation length) and DIR/position-loss.{png,svg} (loss against position inside the
longest windows). Progress (loss, tokens/s, ETA) goes to stderr.
"""

import argparse
import copy
import hashlib
import json
import math
import os
import re
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import posenc
import posenc.torch as pt

# Scheme names of this experiment -> (posenc attention scheme, positions added to embeddings).
SCHEMES = {
    "nope": ("none", None),
    "sinusoidal": ("none", "sinusoidal"),
    "learned": ("none", "learned"),
    "rope": ("rope", None),
    "alibi": ("alibi", None),
    "t5": ("t5", None),
    "shaw": ("shaw", None),
    "xl": ("xl", None),
    "deberta": ("deberta", None),
}
LABELS = {"nope": "NoPE", "sinusoidal": "Sinusoidal", "learned": "Learned", "rope": "Rotary",
          "alibi": "ALiBi", "t5": "T5 bias", "shaw": "Shaw et al.", "xl": "Transformer-XL",
          "deberta": "DeBERTa"}

# Validation books of the KJV (the `bible` program's abbreviations): narrative, wisdom, gospel,
# epistle; every other book trains.
KJV_VALID_BOOKS = ("Josh", "Eccl", "Mark", "Rom")
KJV_BOOKS = 66
KJV_VERSES = 31102

# Presets. The full one is sized for <= 45 minutes for the nine schemes on 2 cores (docs).
FULL = dict(train_length=128, d_model=128, layers=4, heads=4, mlp=512, batch=32, steps=700,
            lr=2e-3, warmup=50, eval_factors=(1, 2, 4, 8, 16), eval_tokens=65536,
            t5_buckets=32, t5_max_distance=128, shaw_k=16, deberta_buckets=64,
            deberta_max_relative=128, log_every=50)
QUICK = dict(train_length=16, d_model=32, layers=2, heads=2, mlp=64, batch=8, steps=80,
             lr=3e-3, warmup=8, eval_factors=(1, 2, 4), eval_tokens=4096,
             t5_buckets=8, t5_max_distance=16, shaw_k=4, deberta_buckets=8,
             deberta_max_relative=16, log_every=20)


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def fmt_time(s):
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def write_atomic(path, data):
    tmp = path + ".tmp"
    with open(tmp, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)
    os.replace(tmp, path)


# ---- data ---------------------------------------------------------------------------------

def cache_dir():
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "posenc")


def kjv_verses(bible="bible"):
    """The KJV as printed by Debian's `bible` (bible-kjv, text in bible-kjv-text): the raw
    text (one "Ref verse" line per verse), cached in ~/.cache/posenc/kjv.txt."""
    path = os.path.join(cache_dir(), "kjv.txt")
    if not os.path.exists(path):
        try:
            # -f turns pretty-printing off: one line per verse, each with its reference.
            r = subprocess.run([bible, "-f", "Gen1:1-Rev22:21"], stdin=subprocess.DEVNULL,
                               capture_output=True, check=True)
        except (OSError, subprocess.CalledProcessError) as e:
            raise SystemExit(f"extrapolation: the King James Bible comes from Debian's bible-kjv "
                             f"package (bash scripts/deps.sh installs it): {e}") from None
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_atomic(path, r.stdout)
    with open(path, "rb") as f:
        return f.read().decode("ascii")


def kjv_split(raw, valid_books=KJV_VALID_BOOKS):
    """(train, valid, info): the books as documents (one verse per line, references removed, a
    blank line after each book), split by book in canonical order."""
    books, order = {}, []
    for line in raw.splitlines():
        m = re.match(r"^(\d?[A-Za-z]+)(\d+):(\d+) (.*)$", line)
        if not m:
            raise ValueError(f"kjv: unexpected line {line[:60]!r}")
        name = m.group(1)
        if name not in books:
            books[name] = []
            order.append(name)
        books[name].append(m.group(4).strip())
    nverses = sum(len(v) for v in books.values())
    if len(order) != KJV_BOOKS or nverses != KJV_VERSES:
        raise ValueError(f"kjv: {len(order)} books, {nverses} verses (expected {KJV_BOOKS}, "
                         f"{KJV_VERSES}); remove {os.path.join(cache_dir(), 'kjv.txt')}")
    unknown = [b for b in valid_books if b not in books]
    if unknown:
        raise ValueError(f"kjv: unknown validation books {unknown} (known: {' '.join(order)})")
    text = {b: "\n".join(books[b]) + "\n\n" for b in order}
    train = "".join(text[b] for b in order if b not in valid_books)
    valid = "".join(text[b] for b in order if b in valid_books)
    info = {"corpus": "King James Bible, Debian package bible-kjv-text (printed by bible-kjv's "
                      "`bible -f Gen1:1-Rev22:21`)",
            "split": "by book", "valid_books": list(valid_books),
            "train_books": [b for b in order if b not in valid_books]}
    return train, valid, info


def file_split(path, valid_path=None, valid_fraction=0.05):
    """A text file as corpus: validation from valid_path, else the file's last lines (about
    valid_fraction of its bytes, cut at a line boundary)."""
    with open(path, "rb") as f:
        data = f.read()
    if valid_path:
        with open(valid_path, "rb") as f:
            return data, f.read(), {"corpus": os.path.abspath(path),
                                    "valid_corpus": os.path.abspath(valid_path),
                                    "split": "separate files"}
    cut = data.rfind(b"\n", 0, int(len(data) * (1 - valid_fraction))) + 1
    return data[:cut], data[cut:], {"corpus": os.path.abspath(path),
                                    "split": f"last {valid_fraction:g} of the lines"}


def load_corpus(args):
    if args.corpus:
        train, valid, info = file_split(args.corpus, args.valid_corpus, args.valid_fraction)
    else:
        train, valid, info = kjv_split(kjv_verses())
    train = train.encode() if isinstance(train, str) else train
    valid = valid.encode() if isinstance(valid, str) else valid
    info["train_bytes"], info["valid_bytes"] = len(train), len(valid)
    info["train_sha256"] = hashlib.sha256(train).hexdigest()
    info["valid_sha256"] = hashlib.sha256(valid).hexdigest()
    as_tensor = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8).long()  # noqa: E731
    return as_tensor(train), as_tensor(valid), info


def train_batches(data, length, batch, steps, seed):
    """The same `steps` batches of random windows [batch, length + 1] for every scheme."""
    g = torch.Generator().manual_seed(10_000 + seed)
    span = torch.arange(length + 1)
    for _ in range(steps):
        start = torch.randint(0, data.numel() - length - 1, (batch,), generator=g)
        yield data[start[:, None] + span]


# ---- model --------------------------------------------------------------------------------

class Block(nn.Module):
    """Pre-LayerNorm transformer block; the attention core is the model's `attend`."""

    def __init__(self, d, heads, mlp):
        super().__init__()
        self.heads, self.head_dim = heads, d // heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, mlp), nn.Linear(mlp, d)

    def forward(self, x, attend):
        b, n, d = x.shape
        # q, k, v: strided [batch, seq, heads, head_dim] views of one projection (no copies).
        q, k, v = self.qkv(self.ln1(x)).view(b, n, 3, self.heads, self.head_dim).unbind(2)
        x = x + self.proj(attend(self, q, k, v).reshape(b, n, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class LanguageModel(nn.Module):
    """Byte-level decoder-only transformer whose attention is posenc.torch.attention with
    `scheme` (SCHEMES). The weights every scheme shares are drawn first from `seed`; the
    scheme's own tables afterwards from seed + 1, so all models start from the same core."""

    def __init__(self, scheme, *, d_model, layers, heads, mlp, train_length, seed, threads=0,
                 t5_buckets=32, t5_max_distance=128, shaw_k=16, deberta_buckets=64,
                 deberta_max_relative=128, **_):
        super().__init__()
        if scheme not in SCHEMES:
            raise ValueError(f"scheme: '{scheme}' ({', '.join(SCHEMES)})")
        if d_model % heads:
            raise ValueError(f"d_model ({d_model}) must be a multiple of heads ({heads})")
        self.scheme = scheme
        self.attn_scheme, self.added = SCHEMES[scheme]
        self.d, self.threads = d_model, threads
        self.head_dim = d_model // heads
        torch.manual_seed(seed)
        self.tok = nn.Embedding(256, d_model)
        nn.init.normal_(self.tok.weight, std=d_model ** -0.5)  # x sqrt(d) below: unit scale
        self.blocks = nn.ModuleList(Block(d_model, heads, mlp) for _ in range(layers))
        self.lnf = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, 256)
        for name, p in self.named_parameters():
            if p.dim() == 2 and not name.startswith("tok."):
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "fc2.weight")) \
                    else 0.02
                nn.init.normal_(p, std=std)
            elif name.endswith(".bias"):
                nn.init.zeros_(p)

        torch.manual_seed(seed + 1)
        self.sinusoidal = pt.SinusoidalPositions(d_model) if self.added == "sinusoidal" else None
        self.learned = (pt.LearnedPositions(train_length, d_model, init_std=d_model ** -0.5)
                        if self.added == "learned" else None)
        hd = self.head_dim
        s = self.attn_scheme
        # Per layer (T5: one table shared by every layer, as in T5; DeBERTa: shared relative
        # embeddings projected by each layer's key and query weights, as in DeBERTa v2/v3).
        self.pos = None
        self.t5 = None
        self.rel_embeddings = None
        if s == "rope":
            self.pos = nn.ModuleList(pt.Rope(hd) for _ in range(layers))
        elif s == "alibi":
            self.pos = nn.ModuleList(pt.Alibi(heads) for _ in range(layers))
        elif s == "t5":
            self.t5 = pt.T5RelativeBias(heads, t5_buckets, t5_max_distance)
        elif s == "shaw":
            self.pos = nn.ModuleList(pt.ShawRelative(hd, shaw_k) for _ in range(layers))
        elif s == "xl":
            self.pos = nn.ModuleList(pt.XLRelative(heads, hd, d_model) for _ in range(layers))
        elif s == "deberta":
            self.rel_embeddings = nn.Parameter(torch.randn(2 * deberta_buckets, d_model) * 0.02)
            self.rel_norm = nn.LayerNorm(d_model)
            self.deberta = {"max_relative_positions": deberta_max_relative,
                            "position_buckets": deberta_buckets}
        self.scale = 1.0 / math.sqrt(hd)

    def deberta_tables(self, block):
        """DeBERTa's c2p/p2c tables of a layer: LayerNorm(rel_embeddings) through the layer's
        query and key projections."""
        d = self.d
        r = self.rel_norm(self.rel_embeddings)
        w = block.qkv.weight
        shape = (r.shape[0], block.heads, block.head_dim)
        return {"pos_query": (r @ w[:d].t()).view(shape),
                "pos_key": (r @ w[d:2 * d].t()).view(shape)}

    def attend(self, block, q, k, v):
        i = block.layer_index
        kw = {"causal": True, "num_threads": self.threads}
        if self.attn_scheme == "deberta":
            # its own score scale 1/sqrt(3 head_dim) (posenc's default)
            return pt.attention(q, k, v, "deberta", params=self.deberta_tables(block),
                                **self.deberta, **kw)
        kw["scale"] = self.scale
        if self.t5 is not None:
            return self.t5(q, k, v, **kw)
        if self.pos is not None:
            return self.pos[i](q, k, v, **kw)
        return pt.attention(q, k, v, "none", **kw)

    def forward(self, idx):
        x = self.tok(idx) * math.sqrt(self.d)
        if self.sinusoidal is not None:
            x = self.sinusoidal(x)
        if self.learned is not None:
            x = self.learned(x)  # raises posenc.Error past the table (no clamping)
        for i, blk in enumerate(self.blocks):
            blk.layer_index = i
            x = blk(x, self.attend)
        return self.head(self.lnf(x))


def make_model(scheme, cfg, seed):
    return LanguageModel(scheme, seed=seed, **cfg)


def make_optimizer(model, cfg):
    return torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=(0.9, 0.99),
                             weight_decay=0.01)


def lr_at(step, cfg):
    """Linear warm-up, then cosine decay to a tenth."""
    if step < cfg["warmup"]:
        return cfg["lr"] * (step + 1) / cfg["warmup"]
    t = (step - cfg["warmup"]) / max(1, cfg["steps"] - cfg["warmup"])
    return cfg["lr"] * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, t))))


def train_step(model, opt, batch, step, cfg):
    for g in opt.param_groups:
        g["lr"] = lr_at(step, cfg)
    logits = model(batch[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, 256), batch[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.item()


def eval_spans(valid, tokens, longest):
    """[tokens / longest, longest + 1] spans of the validation text, spread evenly over all of
    it (every validation book contributes); every evaluation length tiles the same spans, so
    each length scores the same bytes."""
    n = tokens // longest
    avail = (valid.numel() - 1) // longest
    if n < 1 or n > avail:
        raise ValueError(f"eval: {tokens} tokens in spans of {longest} do not fit the "
                         f"validation text ({valid.numel()} bytes)")
    starts = [(i * avail // n) * longest for i in range(n)]
    return torch.stack([valid[s:s + longest + 1] for s in starts])


@torch.no_grad()
def evaluate(model, spans, length, batch_tokens=16384):
    """Mean NLL (nats per byte) over the non-overlapping windows of `length` bytes that tile
    the spans (each window predicts its bytes 1..length from 0..length-1, with positions from 0
    as in training), and the mean NLL at each position of the window."""
    x, y = spans[:, :-1], spans[:, 1:]
    if x.shape[1] % length:
        raise ValueError(f"eval: length {length} does not divide the spans ({x.shape[1]})")
    xs = x.reshape(-1, length)
    ys = y.reshape(-1, length)
    windows = xs.shape[0]
    per = max(1, batch_tokens // length)
    pos_nll = torch.zeros(length, dtype=torch.float64)
    model.eval()
    try:
        for i in range(0, windows, per):
            logits = model(xs[i:i + per])
            nll = F.cross_entropy(logits.reshape(-1, 256), ys[i:i + per].reshape(-1),
                                  reduction="none").view(-1, length)
            pos_nll += nll.double().sum(0)
    finally:
        model.train()
    return float(pos_nll.sum() / (windows * length)), (pos_nll / windows).tolist()


# ---- one run, the reference check ---------------------------------------------------------

class Progress:
    """ETA over the whole experiment from the measured step time and evaluation time."""

    def __init__(self, runs, steps):
        self.total_steps = runs * steps
        self.done_steps = 0
        self.t0 = time.time()
        self.train_time = 0.0
        self.eval_time = 0.0
        self.evals = 0
        self.runs = runs

    def eta(self, steps_left_here):
        if self.done_steps == 0:
            return float("nan")
        per_step = self.train_time / self.done_steps
        runs_left = self.runs - self.evals
        per_eval = self.eval_time / self.evals if self.evals else 0.15 * per_step * (
            self.total_steps / self.runs)
        later = self.total_steps - self.done_steps - steps_left_here
        return per_step * (steps_left_here + later) + per_eval * runs_left


def run_scheme(scheme, seed, train, valid, cfg, progress):
    model = make_model(scheme, cfg, seed)
    opt = make_optimizer(model, cfg)
    tag = f"[{scheme} seed {seed}]"
    log(f"{tag} {sum(p.numel() for p in model.parameters()):,} parameters")
    steps, every = cfg["steps"], cfg["log_every"]
    tokens_per_step = cfg["batch"] * cfg["train_length"]
    losses, curve, curve_steps = [], [], []
    t_start = time.time()
    t_log = t_start
    for step, batch in enumerate(train_batches(train, cfg["train_length"], cfg["batch"], steps,
                                               seed)):
        loss = train_step(model, opt, batch, step, cfg)
        if not math.isfinite(loss):
            raise FloatingPointError(f"{tag} loss {loss} at step {step}")
        losses.append(loss)
        if (step + 1) % every == 0 or step + 1 == steps:
            now = time.time()
            n = len(losses) - (curve_steps[-1] if curve_steps else 0)
            curve.append(sum(losses[-n:]) / n)
            curve_steps.append(step + 1)
            progress.train_time += now - t_log
            progress.done_steps += n
            rate = n * tokens_per_step / max(now - t_log, 1e-9)
            eta = progress.eta(steps - step - 1)
            log(f"{tag} step {step + 1}/{steps}  loss {curve[-1]:.4f}  {rate / 1000:.1f}k tok/s"
                f"  elapsed {fmt_time(now - progress.t0)}  ETA "
                f"{'?' if math.isnan(eta) else fmt_time(eta)}")
            t_log = now
    train_seconds = time.time() - t_start

    t_eval = time.time()
    lengths = [cfg["train_length"] * f for f in cfg["eval_factors"]]
    spans = eval_spans(valid, cfg["eval_tokens"], max(lengths))
    ppl, nll, errors, pos_nll = [], [], {}, None
    for length in lengths:
        try:
            mean, per_pos = evaluate(model, spans, length)
        except posenc.Error as e:  # learned positions past the table: refused, not clamped
            if model.learned is None:
                raise
            ppl.append(None)
            nll.append(None)
            errors[str(length)] = str(e)
            log(f"{tag} length {length}: not evaluable ({e})")
            continue
        ppl.append(math.exp(mean) if mean < 700 else None)
        nll.append(mean)
        pos_nll = per_pos
        log(f"{tag} length {length}: perplexity {math.exp(mean):.4f} "
            f"({mean / math.log(2):.4f} bits/byte)")
    eval_seconds = time.time() - t_eval
    progress.eval_time += eval_seconds
    progress.evals += 1
    # Loss by position inside the longest evaluable windows, averaged over chunks of L_train.
    chunk = cfg["train_length"]
    pos_chunks = None
    if pos_nll is not None:
        pos_chunks = [sum(pos_nll[i:i + chunk]) / len(pos_nll[i:i + chunk])
                      for i in range(0, len(pos_nll), chunk)]
    return {"lengths": lengths, "ppl": ppl, "nll": nll, "train_loss": curve,
            "train_loss_steps": curve_steps, "final_train_loss": sum(losses[-every:]) / min(
                every, len(losses)),
            "first_train_loss": sum(losses[:5]) / min(5, len(losses)),
            "seconds": train_seconds + eval_seconds, "train_seconds": train_seconds,
            "eval_seconds": eval_seconds, "tokens_per_second": steps * tokens_per_step /
            train_seconds, "eval_errors": errors, "position_nll": pos_chunks,
            "position_nll_length": None if pos_nll is None else len(pos_nll),
            "parameters": sum(p.numel() for p in model.parameters())}


def _losses(model, train, cfg, seed, steps, batch):
    opt = make_optimizer(model, cfg)
    return [train_step(model, opt, b, i, cfg)
            for i, b in enumerate(train_batches(train, cfg["train_length"], batch, steps, seed))]


def _max_rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def reference_check(scheme, train, cfg, seed, steps=8, batch=4):
    """Trains `scheme` for `steps` steps twice from the same weights and batches: in float32
    (posenc's fused kernels) and in float64 (posenc's float64 reference attention and tables,
    backward included), and returns both loss lists and their largest relative difference.

    The control says how small that difference must be to mean anything: the same float64 run
    without what the scheme contributes (its position tables frozen when it has learnable ones,
    so a missing or wrong table gradient shows; no positions at all for the fixed schemes)."""
    m32 = make_model(scheme, cfg, seed)
    m64 = copy.deepcopy(m32).double()
    l32 = _losses(m32, train, cfg, seed, steps, batch)
    l64 = _losses(m64, train, cfg, seed, steps, batch)
    res = {"scheme": scheme, "steps": steps, "batch": batch, "float32": l32, "float64": l64,
           "max_relative_difference": _max_rel(l32, l64)}
    if scheme == "nope":
        return res  # nothing positional to leave out
    control = make_model(scheme, cfg, seed).double()
    core = ("tok.", "blocks.", "lnf.", "head.")
    tables = [p for n, p in control.named_parameters() if not n.startswith(core)]
    if tables:
        for p in tables:
            p.requires_grad_(False)
        what = "float64, position tables frozen"
    else:
        control = make_model("nope", cfg, seed).double()
        what = "float64, no positions"
    lc = _losses(control, train, cfg, seed, steps, batch)
    res.update({"control": what, "control_losses": lc,
                "control_relative_difference": _max_rel(l32, lc)})
    return res


# ---- results ------------------------------------------------------------------------------

def aggregate(entry):
    """Mean and spread over seeds of a scheme's per-seed results."""
    seeds = sorted(entry["by_seed"], key=int)
    runs = [entry["by_seed"][s] for s in seeds]
    first = runs[0]
    out = {"lengths": first["lengths"], "seeds": [int(s) for s in seeds]}
    cols = list(zip(*[r["ppl"] for r in runs]))
    out["ppl"] = [None if None in c else sum(c) / len(c) for c in cols]
    out["ppl_min"] = [None if None in c else min(c) for c in cols]
    out["ppl_max"] = [None if None in c else max(c) for c in cols]
    out["train_loss"] = [sum(v) / len(v) for v in zip(*[r["train_loss"] for r in runs])]
    out["train_loss_steps"] = first["train_loss_steps"]
    out["seconds"] = sum(r["seconds"] for r in runs) / len(runs)
    out["eval_errors"] = first["eval_errors"]
    out["parameters"] = first["parameters"]
    pos = [r["position_nll"] for r in runs if r["position_nll"] is not None]
    out["position_nll"] = [sum(v) / len(v) for v in zip(*pos)] if pos else None
    out["position_nll_length"] = first["position_nll_length"]
    out["by_seed"] = entry["by_seed"]
    return out


def results_markdown(res):
    s = res["settings"]
    schemes = res["schemes"]
    lengths = next(iter(schemes.values()))["lengths"]
    seeds = sorted({x for v in schemes.values() for x in v["seeds"]})
    lines = [f"Validation perplexity per byte against evaluation length (bytes); trained on "
             f"L_train = {s['train_length']}; "
             + (f"mean over seeds {', '.join(map(str, seeds))} (min to max in brackets)."
                if len(seeds) > 1 else f"seed {seeds[0]}."), "",
             "| scheme | " + " | ".join(f"{n}" + (" (L_train)" if n == s["train_length"] else "")
                                        for n in lengths) + " | train loss | minutes |",
             "|---|" + "---:|" * (len(lengths) + 2)]
    for name, v in schemes.items():
        cells = []
        for p, lo, hi in zip(v["ppl"], v["ppl_min"], v["ppl_max"]):
            if p is None:
                cells.append("—")
            elif len(seeds) > 1:
                cells.append(f"{p:.3f} [{lo:.3f}, {hi:.3f}]")
            else:
                cells.append(f"{p:.3f}")
        lines.append(f"| {LABELS.get(name, name)} | " + " | ".join(cells) +
                     f" | {v['train_loss'][-1]:.3f} | {v['seconds'] / 60:.1f} |")
    chk = res.get("reference_check")
    if chk and chk.get("schemes"):
        worst = max(chk["schemes"].values(), key=lambda c: c["max_relative_difference"])
        ctl = [c["control_relative_difference"] for c in chk["schemes"].values()
               if "control" in c]
        lines += ["", f"Reference check ({', '.join(chk['schemes'])}; {worst['steps']} steps "
                      f"each): float32 fused training against posenc's float64 reference, "
                      f"largest relative loss difference {worst['max_relative_difference']:.1e} "
                      f"({LABELS.get(worst['scheme'], worst['scheme'])})"
                  + (f"; without the scheme's positions or table gradients at least "
                     f"{min(ctl):.1e}." if ctl else ".")]
    errs = {n: v["eval_errors"] for n, v in schemes.items() if v["eval_errors"]}
    for n, e in errs.items():
        first = next(iter(e.values()))
        lines += ["", f"{LABELS.get(n, n)}: not evaluable past {s['train_length']} "
                      f"(posenc: `{first}`)."]
    return "\n".join(lines) + "\n"


COLORS = {"nope": "#7f7f7f", "sinusoidal": "#d62728", "learned": "#8c564b", "rope": "#1f77b4",
          "alibi": "#2ca02c", "t5": "#ff7f0e", "shaw": "#9467bd", "xl": "#17becf",
          "deberta": "#e377c2"}
MARKERS = {"nope": "x", "sinusoidal": "o", "learned": "D", "rope": "s", "alibi": "^",
           "t5": "v", "shaw": "P", "xl": "*", "deberta": "h"}


def _finish(fig, ax, stem, legend_size):
    """Grid, legend and layout of a results figure; writes stem.png and stem.svg, closes it."""
    import matplotlib.pyplot as plt
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=legend_size, ncol=2)
    fig.tight_layout()
    paths = []
    for ext in ("png", "svg"):
        fig.savefig(f"{stem}.{ext}")
        paths.append(f"{stem}.{ext}")
    plt.close(fig)
    return paths


def draw(res, out_dir):
    """extrapolation.{png,svg}: perplexity against evaluation length (Press et al., Fig. 1);
    position-loss.{png,svg}: loss against position inside the longest windows."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        log("extrapolation: matplotlib missing (apt install python3-matplotlib): no figures")
        return []
    s = res["settings"]
    lt = s["train_length"]
    seeds = sorted({x for v in res["schemes"].values() for x in v["seeds"]})
    written = []

    fig, ax = plt.subplots(figsize=(7.2, 4.6), dpi=150)
    for name, v in res["schemes"].items():
        pts = [(n, p, lo, hi) for n, p, lo, hi in zip(v["lengths"], v["ppl"], v["ppl_min"],
                                                     v["ppl_max"]) if p is not None]
        if not pts:
            continue
        xs, ys, lo, hi = zip(*pts)
        ax.plot(xs, ys, marker=MARKERS.get(name, "o"), color=COLORS.get(name), lw=1.8, ms=5,
                label=LABELS.get(name, name) + (" (table ends at L_train)"
                                                if name == "learned" else ""))
        if len(seeds) > 1:
            ax.fill_between(xs, lo, hi, color=COLORS.get(name), alpha=0.18, lw=0)
    ax.axvline(lt, color="black", ls="--", lw=0.8)
    ax.text(lt, 0.98, " L_train", transform=ax.get_xaxis_transform(), va="top", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    lengths = next(iter(res["schemes"].values()))["lengths"]
    ax.set_xticks(lengths)
    ax.set_xticklabels([str(n) for n in lengths])
    plain = matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}")
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
    ax.tick_params(axis="y", which="minor", labelsize=7)
    ax.set_xlabel("Inference input tokens (bytes)")
    ax.set_ylabel("Validation perplexity (per byte)")
    ax.set_title(f"Train short (L_train = {lt}), test long. {s['corpus_name']}; "
                 f"{s['layers']} layers, d = {s['d_model']}, {s['steps']} steps\n"
                 + (f"mean of seeds {', '.join(map(str, seeds))}, band: min to max"
                    if len(seeds) > 1 else f"seed {seeds[0]}"), fontsize=9)
    written += _finish(fig, ax, os.path.join(out_dir, "extrapolation"), legend_size=8)

    fig, ax = plt.subplots(figsize=(7.2, 4.2), dpi=150)
    for name, v in res["schemes"].items():
        if not v.get("position_nll"):
            continue
        xs = [lt * (i + 0.5) for i in range(len(v["position_nll"]))]
        ax.plot(xs, [y / math.log(2) for y in v["position_nll"]], marker=MARKERS.get(name, "o"),
                color=COLORS.get(name), lw=1.5, ms=4,
                label=f"{LABELS.get(name, name)} (windows of {v['position_nll_length']})")
    ax.axvline(lt, color="black", ls="--", lw=0.8)
    ax.set_xlabel(f"Position in the window (bytes, mean over chunks of {lt})")
    ax.set_ylabel("Loss (bits per byte)")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}"))
    ax.tick_params(axis="y", which="minor", labelsize=7)
    ax.set_title("Where the loss goes up: loss against position in the longest windows",
                 fontsize=9)
    written += _finish(fig, ax, os.path.join(out_dir, "position-loss"), legend_size=7)
    return written


def save(res, out_dir, figures=True):
    os.makedirs(out_dir, exist_ok=True)
    res = dict(res)
    res["schemes"] = {n: aggregate(e) for n, e in res["runs"].items()}
    body = {k: v for k, v in res.items() if k != "runs"}
    write_atomic(os.path.join(out_dir, "results.json"), json.dumps(body, indent=1) + "\n")
    write_atomic(os.path.join(out_dir, "results.md"), results_markdown(body))
    if figures:
        draw(body, out_dir)
    return body


def load_runs(path):
    """{scheme: {"by_seed": {...}}} and settings from a results.json."""
    with open(path) as f:
        res = json.load(f)
    return res["settings"], {n: {"by_seed": dict(v["by_seed"])} for n, v in
                             res["schemes"].items()}


COMPARABLE = ("train_length", "d_model", "layers", "heads", "mlp", "batch", "steps", "lr",
              "warmup", "eval_factors", "eval_tokens", "corpus_info")


def merge(dirs, out_dir):
    settings, runs, checks = None, {}, {}
    for d in dirs:
        s, r = load_runs(os.path.join(d, "results.json"))
        with open(os.path.join(d, "results.json")) as f:
            chk = json.load(f).get("reference_check")
        if chk:
            checks[os.path.basename(os.path.normpath(d))] = chk
        if settings is None:
            settings = dict(s)
        else:
            diff = [k for k in COMPARABLE if s.get(k) != settings.get(k)]
            if diff:
                raise SystemExit(f"extrapolation: --merge: {d} differs in {', '.join(diff)}")
            settings["seeds"] = sorted(set(settings["seeds"]) | set(s["seeds"]))
        for n, e in r.items():
            runs.setdefault(n, {"by_seed": {}})["by_seed"].update(e["by_seed"])
    settings["merged_from"] = [os.path.abspath(d) for d in dirs]
    res = {"settings": settings, "runs": runs}
    if checks:
        res["reference_check"] = next(iter(checks.values()))
        res["reference_checks"] = checks
    return save(res, out_dir)


# ---- command line -------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python3 -m posenc.experiments.extrapolation",
        description="Train short, test long (Press et al. 2022, Fig. 1) with posenc's fused "
                    "attention: one byte-level language model per positional scheme.")
    p.add_argument("--out", default="extrapolation-results", help="output directory")
    p.add_argument("--quick", action="store_true",
                   help="tiny model, few steps (the test suite's run, about a minute)")
    p.add_argument("--schemes", default=",".join(SCHEMES),
                   help=f"comma-separated, from {','.join(SCHEMES)} (default: all)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="one run per seed")
    p.add_argument("--threads", type=int,
                   help="PyTorch and posenc threads (default 2; --quick: 1, as the test suite "
                        "runs beside other tests)")
    g = p.add_argument_group("model and training (defaults: the full preset; --quick: tiny)")
    for k in ("train_length", "d_model", "layers", "heads", "mlp", "batch", "steps", "warmup",
              "eval_tokens", "t5_buckets", "t5_max_distance", "shaw_k", "deberta_buckets",
              "deberta_max_relative", "log_every"):
        g.add_argument("--" + k.replace("_", "-"), type=int, dest=k)
    g.add_argument("--lr", type=float)
    g.add_argument("--eval-factors", type=lambda s: tuple(int(x) for x in s.split(",")),
                   help="evaluation lengths as multiples of L_train, e.g. 1,2,4,8,16")
    c = p.add_argument_group("corpus (default: the King James Bible of bible-kjv-text)")
    c.add_argument("--corpus", help="a text file to train on instead")
    c.add_argument("--valid-corpus", help="its validation text (default: its last lines)")
    c.add_argument("--valid-fraction", type=float, default=0.05)
    p.add_argument("--reference-check", metavar="SCHEMES", default="all",
                   help="train these schemes (comma-separated, 'all' or 'none') a few steps in "
                        "float32 (fused kernels) and in float64 (reference) and compare the "
                        "losses (default all)")
    p.add_argument("--reference-steps", type=int, default=16)
    p.add_argument("--reference-tolerance", type=float, default=2e-6,
                   help="largest relative loss difference accepted (default 2e-6)")
    p.add_argument("--resume", action="store_true",
                   help="keep the runs already in OUT/results.json made with the same settings")
    p.add_argument("--merge", nargs="+", metavar="DIR",
                   help="combine the results.json of runs with other seeds into --out")
    return p.parse_args(argv)


def config_from(args):
    cfg = dict(QUICK if args.quick else FULL)
    for k in list(cfg):
        v = getattr(args, k, None)
        if v is not None:
            cfg[k] = v
    cfg["threads"] = args.threads if args.threads else (1 if args.quick else 2)
    return cfg


def main(argv=None):
    args = parse_args(argv)
    if args.merge:
        res = merge(args.merge, args.out)
        log(f"extrapolation: merged {len(args.merge)} runs into {args.out}")
        print(results_markdown(res), end="")
        return 0
    schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
    bad = [s for s in schemes if s not in SCHEMES]
    if bad:
        raise SystemExit(f"extrapolation: unknown schemes {bad} (known: {', '.join(SCHEMES)})")
    cfg = config_from(args)
    torch.set_num_threads(cfg["threads"])
    train, valid, info = load_corpus(args)
    longest = cfg["train_length"] * max(cfg["eval_factors"])
    if cfg["eval_tokens"] % longest or cfg["eval_tokens"] + longest > valid.numel():
        raise SystemExit(f"extrapolation: --eval-tokens ({cfg['eval_tokens']}) must be a "
                         f"multiple of the longest evaluation length ({longest}), so that every "
                         f"length scores the same bytes, and fit the validation text "
                         f"({valid.numel()} bytes)")
    settings = {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.items()}
    settings.update({
        "quick": args.quick, "seeds": args.seeds, "schemes": schemes,
        "corpus_name": "KJV (bible-kjv-text)" if not args.corpus else os.path.basename(
            args.corpus),
        "corpus_info": info, "optimizer": "AdamW(betas=(0.9, 0.99), weight_decay=0.01), "
        "linear warm-up, cosine decay to lr/10, gradient clipping at 1",
        "model": "byte-level pre-LayerNorm decoder, GELU MLP, untied output layer; attention "
                 "core posenc.torch.attention (fused float32 forward and backward)",
        "torch": torch.__version__, "posenc": posenc.__version__,
        "environment": {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY",
                                                        "OPENBLAS_NUM_THREADS")},
        "command": "python3 -m posenc.experiments.extrapolation " + " ".join(
            sys.argv[1:] if argv is None else argv)})
    log(f"extrapolation: {info['corpus']}: train {info['train_bytes']:,} bytes, valid "
        f"{info['valid_bytes']:,} bytes; schemes {','.join(schemes)}; seeds {args.seeds}; "
        f"{cfg['steps']} steps of {cfg['batch']} x {cfg['train_length']} bytes; "
        f"{cfg['threads']} threads")

    out = args.out
    os.makedirs(out, exist_ok=True)
    runs = {}
    prev = os.path.join(out, "results.json")
    if args.resume and os.path.exists(prev):
        s, r = load_runs(prev)
        if all(s.get(k) == settings.get(k) for k in COMPARABLE):
            runs = {n: e for n, e in r.items() if n in schemes}
            log(f"extrapolation: resuming: {sum(len(e['by_seed']) for e in runs.values())} "
                f"runs kept from {prev}")
        else:
            log(f"extrapolation: {prev} has other settings: starting over")
    res = {"settings": settings, "runs": runs}

    failures = []
    checks = schemes if args.reference_check == "all" else [
        x for x in args.reference_check.split(",") if x and x != "none"]
    if checks:
        t = time.time()
        res["reference_check"] = {"tolerance": args.reference_tolerance, "schemes": {}}
        for name in checks:
            if name not in SCHEMES:
                raise SystemExit(f"extrapolation: --reference-check: unknown scheme '{name}'")
            chk = reference_check(name, train, cfg, args.seeds[0], steps=args.reference_steps)
            res["reference_check"]["schemes"][name] = chk
            ok = chk["max_relative_difference"] <= args.reference_tolerance
            log(f"extrapolation: reference check {name}: {chk['steps']} steps, float32 fused vs "
                f"float64 reference: max relative loss difference "
                f"{chk['max_relative_difference']:.1e} ({'ok' if ok else 'TOO LARGE'})"
                + (f"; control ({chk['control']}): {chk['control_relative_difference']:.1e}"
                   if "control" in chk else ""))
            if not ok:
                failures.append(f"reference check {name}: {chk['max_relative_difference']:.2e} "
                                f"> {args.reference_tolerance:g}")
        res["reference_check"]["seconds"] = time.time() - t

    todo = [(n, s) for s in args.seeds for n in schemes
            if str(s) not in runs.get(n, {}).get("by_seed", {})]
    progress = Progress(len(todo), cfg["steps"])
    for name, seed in todo:
        r = run_scheme(name, seed, train, valid, cfg, progress)
        runs.setdefault(name, {"by_seed": {}})["by_seed"][str(seed)] = r
        # Results after every run: a stopped experiment keeps what it finished (--resume).
        res["runs"] = {n: runs[n] for n in schemes if n in runs}
        body = save(res, out, figures=False)
    body = save(res, out)
    log(f"extrapolation: {fmt_time(time.time() - progress.t0)}; wrote {out}/results.json, "
        f"results.md, extrapolation.png/.svg, position-loss.png/.svg")
    print(results_markdown(body), end="")
    if args.quick:
        failures += quick_failures(body)
    for f in failures:
        log(f"extrapolation: FAILED: {f}")
    return 1 if failures else 0


def quick_failures(res):
    """What --quick checks (nothing about which scheme wins): every scheme's training loss
    fell, evaluation at 4 x L_train ran (learned positions: refused by posenc), and the
    reference check could see each scheme (its control differs by more than 10 x tolerance)."""
    out = []
    chk = res.get("reference_check")
    if chk:
        for name, c in chk["schemes"].items():
            if "control" in c and not c["control_relative_difference"] > 10 * chk["tolerance"]:
                out.append(f"reference check {name}: the control ({c['control']}) differs by "
                           f"only {c['control_relative_difference']:.1e}: the check cannot see "
                           f"the scheme")
    lt = res["settings"]["train_length"]
    for name, v in res["schemes"].items():
        for seed, r in v["by_seed"].items():
            if not r["final_train_loss"] < r["first_train_loss"] - 1.0:
                out.append(f"{name} seed {seed}: loss did not fall ({r['first_train_loss']:.3f} "
                           f"-> {r['final_train_loss']:.3f})")
            if 4 * lt not in r["lengths"]:
                out.append(f"{name}: 4 x L_train ({4 * lt}) not among the evaluation lengths")
                continue
            p = r["ppl"][r["lengths"].index(4 * lt)]
            if name == "learned":
                if p is not None or str(4 * lt) not in r["eval_errors"]:
                    out.append("learned: evaluation past the table was not refused")
            elif p is None or not math.isfinite(p):
                out.append(f"{name} seed {seed}: no perplexity at 4 x L_train ({p})")
    return out


def thread_environment(argv=None):
    """The environment the thread pools need, read by the OpenMP and OpenBLAS runtimes when they
    load (before this module runs): idle OpenMP threads sleep instead of spinning (PyTorch's and
    posenc's threads share 2 cores with OpenBLAS's; spinning made a step 1.8x slower), and
    OpenBLAS uses --threads threads, not every core. Variables already set are kept."""
    args = parse_args(argv)
    threads = config_from(args)["threads"]
    want = {"OMP_WAIT_POLICY": "passive", "OPENBLAS_NUM_THREADS": str(threads)}
    return {k: v for k, v in want.items() if k not in os.environ}


if __name__ == "__main__":
    env = thread_environment()
    if env and not os.environ.get("POSENC_EXTRAPOLATION_REEXEC"):
        # Start again with them (once): the runtimes are already loaded in this process.
        os.execve(sys.executable, [sys.executable, "-m", "posenc.experiments.extrapolation",
                                   *sys.argv[1:]],
                  dict(os.environ, POSENC_EXTRAPOLATION_REEXEC="1", **env))
    sys.exit(main())
