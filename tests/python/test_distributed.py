"""posenc.torch.distributed with real processes: context-parallel attention against single-process
posenc.torch.attention on the whole sequence.

One pytest test spawns 4 processes (torch.multiprocessing, gloo on 127.0.0.1, a free port) and
runs the whole battery inside them on process groups of 1, 2, 3 and 4 ranks (each group of n
ranks is a real n-rank context-parallel job: the calls pass `group=`): every scheme x {causal,
bidirectional} x {ring, all_to_all} x {contiguous, zigzag}, GQA / MQA / MHA, uneven lengths,
seq_q != seq_k (down to one query, so some ranks hold none), explicit per-row positions, windows,
chunks, sinks, documents, a dense mask, soft-capping, a model config, bf16, and the failures
(mismatched shards, bad input on one rank, heads not divisible, a dead rank) that must raise on
every rank without hanging. Every worker reports its failures to the parent through a file;
the parent joins with a timeout and kills what is left. A second test runs the same checks
(a smaller set) under `torchrun --nproc-per-node=2` on this file.

Tolerances. float64 inputs run posenc's float64 reference in every block and merge in float64,
so the distributed result must equal the float64 single-process result to rounding: 1e-9 x
max(1, |ref|). float32: the distributed result is a float32 computation of the same quantity as
the single-process fused kernel, with the blocks' partial results merged by their lse
(attention_merge rounds each merged row once) and the dk / dv / table gradients summed in float32
over at most n ranks. So its error against the float64 oracle may be twice the single-process
float32 error plus one float32 rounding per rank of the result's magnitude:
max |dist32 - ref64| <= 2 max |single32 - ref64| + 8 n 2^-24 max(1, |ref64|).
"""

import datetime
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

SCHEMES = ("none", "rope", "alibi", "t5", "shaw", "xl", "deberta")
EPS32 = 2.0 ** -24


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the battery (runs inside the workers) -----------------------------------------------------

def _case_tensors(scheme, seed, *, batch, seq_q, seq_k, heads_q, heads_kv, dim, causal, variant,
                  positions=False, sinks=False, chunk=None):
    from conftest import Case
    case = Case(scheme, seed, batch=batch, seq_q=seq_q, seq_k=seq_k, heads_q=heads_q,
                heads_kv=heads_kv, dim=dim, causal=causal, variant=variant, positions=positions,
                sinks=sinks, chunk=chunk)
    q, k, v = (torch.from_numpy(x) for x in case.inputs(np.float64))
    params = {n: torch.from_numpy(np.asarray(p, np.float64)) for n, p in case.params.items()}
    kw = dict(case.kw)
    return q, k, v, params, kw


def _leaf(x, dtype, device=None):
    return x.detach().to(device=device, dtype=dtype).clone().requires_grad_()


def _single(q, k, v, scheme, params, kw, dtype, dout):
    """Single-process out and gradients {dq, dk, dv, d<table>} in `dtype`."""
    import posenc.torch as pt
    q, k, v = (_leaf(x, dtype) for x in (q, k, v))
    tables = {n: _leaf(t, dtype) for n, t in params.items()}
    out = pt.attention(q, k, v, scheme, params=tables or None, **kw)
    (out.double() * dout).sum().backward()
    g = {"out": out.detach().double(), "dq": q.grad.double(), "dk": k.grad.double(),
         "dv": v.grad.double()}
    g.update({"d" + n: t.grad.double() for n, t in tables.items()})
    return g


def _distributed(q, k, v, scheme, params, kw, dtype, dout, group, strategy, layout,
                 device=None):
    """This rank's out and gradients, as the full-size tensors' shards (tables: global), on the
    CPU (computed on `device`, default the CPU)."""
    import posenc.torch.distributed as ptd
    n, r = dist.get_world_size(group), dist.get_rank(group)
    ql, kl, vl = (_leaf(ptd.shard(x, r, n, layout), dtype, device) for x in (q, k, v))
    tables = {nm: _leaf(t, dtype, device) for nm, t in params.items()}
    out = ptd.context_parallel_attention(ql, kl, vl, scheme, group=group, strategy=strategy,
                                         layout=layout, params=tables or None, timeout=60, **kw)
    if device is not None and out.device != torch.device(device):
        raise AssertionError(f"out on {out.device}, expected {device}")
    (out.double() * ptd.shard(dout, r, n, layout).to(out.device)).sum().backward()
    g = {"out": out.detach().double(), "dq": ql.grad.double(), "dk": kl.grad.double(),
         "dv": vl.grad.double()}
    g.update({"d" + nm: t.grad.double() for nm, t in tables.items()})
    return {key: val.cpu() for key, val in g.items()}


def _maxerr(a, b):
    return float((a - b).abs().max()) if a.numel() else 0.0


def check_case(name, group, strategy, layout, scheme, q, k, v, params, kw, *, dtypes=("f64",
                                                                                   "f32")):
    """Compares this rank's results with the single-process ones; returns failure strings."""
    import posenc.torch.distributed as ptd
    n, r = dist.get_world_size(group), dist.get_rank(group)
    gen = torch.Generator().manual_seed(1234)
    dout = torch.randn(q.shape[0], q.shape[1], q.shape[2], v.shape[3], generator=gen,
                       dtype=torch.float64)
    fails = []
    ref = _single(q, k, v, scheme, params, kw, torch.float64, dout)
    single32 = _single(q, k, v, scheme, params, kw, torch.float32, dout) if "f32" in dtypes \
        else None
    for dt in dtypes:
        dtype = torch.float64 if dt == "f64" else torch.float32
        got = _distributed(q, k, v, scheme, params, kw, dtype, dout, group, strategy, layout)
        for key, val in got.items():
            want = ref[key]
            if key in ("out", "dq", "dk", "dv"):
                want = ptd.shard(want, r, n, layout)
            if val.shape != want.shape:
                fails.append(f"{name} {dt} {key}: shape {tuple(val.shape)} != "
                             f"{tuple(want.shape)}")
                continue
            mag = max(1.0, float(ref[key].abs().max()) if ref[key].numel() else 1.0)
            if dt == "f64":
                tol = 1e-9 * mag
            else:
                tol = 2 * _maxerr(single32[key], ref[key]) + 8 * n * EPS32 * mag
            err = _maxerr(val, want)
            if not err <= tol:
                fails.append(f"{name} {dt} {key}: max err {err:.3g} > tol {tol:.3g} "
                             f"(rank {r} of {n})")
    return fails


def battery(group, full=True, schemes=SCHEMES, extras_limit=None):
    """Every case for one group (or the given schemes and the first extras_limit extra cases);
    returns (failures, number of cases)."""
    n = dist.get_world_size(group)
    fails, count = [], 0
    strategies = ("ring", "all_to_all")
    layouts = ("contiguous", "zigzag")

    def run(name, strategy, layout, scheme, q, k, v, params, kw, **opt):
        nonlocal count
        count += 1
        try:
            fails.extend(check_case(name, group, strategy, layout, scheme, q, k, v, params, kw,
                                    **opt))
        except Exception:
            fails.append(f"{name}: raised\n{traceback.format_exc()}")

    # Every scheme x causal x strategy x layout; GQA with one kv head per rank, uneven L.
    seed = 0
    for scheme in schemes:
        for causal in (True, False):
            for strategy in strategies:
                for layout in layouts:
                    seed += 1
                    variant = seed % {"rope": 4, "alibi": 2, "shaw": 2,
                                      "deberta": 3}.get(scheme, 1)
                    q, k, v, params, kw = _case_tensors(
                        scheme, seed, batch=2, seq_q=13, seq_k=13, heads_q=12, heads_kv=n,
                        dim=8, causal=causal, variant=variant)
                    run(f"[n={n} {scheme} causal={causal} {strategy} {layout} v{variant}]",
                        strategy, layout, scheme, q, k, v, params, kw,
                        dtypes=("f64", "f32") if full or causal else ("f32",))
    # Extra cases in both strategies and layouts.
    extras = []

    def extra(name, scheme, kwmod=None, **shape):
        spec = dict(batch=2, seq_q=11, seq_k=11, heads_q=12, heads_kv=n, dim=8, causal=True,
                    variant=0)
        spec.update(shape)
        extras.append((name, scheme, spec, kwmod))

    extra("positions", "t5", positions=True)
    extra("positions-alibi", "alibi", positions=True, causal=False, variant=1)
    extra("positions-rope", "rope", positions=True)
    extra("sinks", "xl", sinks=True)
    extra("sinks-bidir", "alibi", sinks=True, causal=False)
    extra("window", "alibi", lambda kw: kw.update(window=4), seq_q=17, seq_k=17)
    extra("window-bidir", "shaw", lambda kw: kw.update(window=3), causal=False)
    extra("chunk", "rope", chunk=5, seq_q=17, seq_k=17)
    extra("chunk-sinks", "t5", chunk=4, sinks=True)
    extra("seq_q<seq_k", "deberta", seq_q=5, seq_k=13, variant=1)
    extra("decode", "alibi", seq_q=1, seq_k=9)
    extra("decode-bidir", "t5", seq_q=2, seq_k=9, causal=False)
    extra("mha", "xl", heads_kv=12)
    extra("mqa", "shaw", heads_kv=1, variant=1)
    extra("softcap", "rope", lambda kw: kw.update(softcap=2.0))
    extra("documents", "t5", lambda kw: kw.update(
        query_documents=np.repeat([[0, 1, 2]], [4, 5, 2], axis=1).repeat(2, 0).astype(np.int32),
        key_documents=np.repeat([[0, 1, 2]], [4, 5, 2], axis=1).repeat(2, 0).astype(np.int32)))
    extra("dense-mask", "alibi", lambda kw: kw.update(
        mask=(np.random.default_rng(5).random((2, 11, 11)) < 0.6) | np.eye(11, dtype=bool)),
        causal=False)
    extra("prefix", "none", lambda kw: kw.update(prefix=np.array([3, 5])))
    extra("offset", "shaw", lambda kw: kw.update(query_positions=100, key_positions=100))
    for name, scheme, spec, kwmod in extras[:extras_limit]:
        for strategy in strategies:
            for layout in layouts:
                seed += 1
                q, k, v, params, kw = _case_tensors(scheme, seed, **spec)
                if kwmod is not None:
                    kwmod(kw)
                run(f"[n={n} {name} {scheme} {strategy} {layout}]", strategy, layout, scheme,
                    q, k, v, params, kw, dtypes=("f64", "f32") if full else ("f32",))
    return fails, count


def model_config_cases(group):
    """gpt-oss's layers (sliding window + sinks) and Bloom's ALiBi slopes from the config."""
    import posenc.torch.distributed as ptd
    from conftest import load_config
    fails = []
    n = dist.get_world_size(group)
    g = torch.Generator().manual_seed(7)
    for cfg_name, layer, heads_q, heads_kv, d in (("gpt-oss-20b.json", 0, 8, 4, 16),
                                                  ("bloom-560m.json", None, 4, 4, 16)):
        over = {"num_attention_heads": heads_q, "num_key_value_heads": heads_kv,
                "head_dim": d, "sliding_window": 4}
        if cfg_name.startswith("bloom"):
            over = {"n_head": heads_q, "hidden_size": heads_q * d}
        cfg = load_config(cfg_name, **over)
        q = torch.randn(1, 9, heads_q, d, generator=g, dtype=torch.float64)
        k = torch.randn(1, 9, heads_kv, d, generator=g, dtype=torch.float64)
        v = torch.randn(1, 9, heads_kv, d, generator=g, dtype=torch.float64)
        params = {"sinks": torch.randn(heads_q, generator=g, dtype=torch.float64)} \
            if cfg_name.startswith("gpt") else {}
        kw = {"config": cfg, "causal": True}
        if layer is not None:
            kw["layer"] = layer
        try:  # a config fixes the head count: all_to_all refuses it on every rank
            ptd.context_parallel_attention(q, k, v, group=group, strategy="all_to_all",
                                           params=params, **kw)
            fails.append(f"[n={n} config {cfg_name}] all_to_all did not raise")
        except ValueError as e:
            if "ring" not in str(e):
                fails.append(f"[n={n} config {cfg_name}] all_to_all: {e}")
        for strategy in ("ring",):
            for layout in ("contiguous", "zigzag"):
                try:
                    fails += check_case(f"[n={n} config {cfg_name} {strategy} {layout}]", group,
                                        strategy, layout, None, q, k, v, params, kw)
                except Exception:
                    fails.append(f"config {cfg_name} {strategy} {layout}: raised\n"
                                 f"{traceback.format_exc()}")
    return fails


def module_case(group):
    """ContextParallel(PositionalAttention) against the module on the whole sequence, in
    float64 (posenc's float64 reference in both: equal to rounding, 1e-9 x max(1, |ref|))."""
    import posenc.torch as pt
    import posenc.torch.distributed as ptd
    n, r = dist.get_world_size(group), dist.get_rank(group)
    fails = []
    torch.manual_seed(5)
    for strategy, layout in (("ring", "zigzag"), ("all_to_all", "contiguous")):
        m = pt.PositionalAttention("t5", heads=12, kv_heads=n, head_dim=8, causal=True,
                                   sinks=True, layout="bhld", num_buckets=8,
                                   max_distance=10).double()
        with torch.no_grad():
            m.sinks.normal_()
        g = torch.Generator().manual_seed(6)
        q = torch.randn(2, 12, 11, 8, generator=g, dtype=torch.float64)
        k, v = (torch.randn(2, n, 11, 8, generator=g, dtype=torch.float64) for _ in range(2))
        want = m(q, k, v)
        want.sum().backward()
        grads = [p.grad.clone() for p in m.parameters()]
        m.zero_grad()
        cpm = ptd.ContextParallel(m, group=group, strategy=strategy, layout=layout)
        ql, kl, vl = (ptd.shard(x, r, n, layout, dim=2) for x in (q, k, v))
        out = cpm(ql, kl, vl)
        out.sum().backward()
        err = float((out.detach() - ptd.shard(want.detach(), r, n, layout, dim=2)).abs().max())
        gerr = max(float((p.grad - gw).abs().max()) for p, gw in zip(m.parameters(), grads))
        mag = max(1.0, float(want.detach().abs().max()))
        gmag = max(1.0, max(float(gw.abs().max()) for gw in grads))
        if not (err <= 1e-9 * mag and gerr <= 1e-9 * gmag):
            fails.append(f"[n={n} ContextParallel {strategy} {layout}] out err {err}, table "
                         f"grad err {gerr}")
    return fails


def half_case(group):
    """bf16 shards: the output is the float32 result rounded once (as single-process)."""
    import posenc.torch as pt
    import posenc.torch.distributed as ptd
    n, r = dist.get_world_size(group), dist.get_rank(group)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 10, 4, 8, generator=g).to(torch.bfloat16) for _ in range(3))
    want = pt.attention(q.float(), k.float(), v.float(), "alibi", causal=True)
    fails = []
    for strategy in ("ring", "all_to_all"):
        if 4 % n:
            continue
        ql, kl, vl = (ptd.shard(x, r, n, "zigzag").requires_grad_() for x in (q, k, v))
        ptd.reset_comm_stats()
        out = ptd.context_parallel_attention(ql, kl, vl, "alibi", group=group, strategy=strategy,
                                             layout="zigzag", causal=True)
        if strategy == "ring":  # bf16 k / v travel as bf16 (lossless): 2 bytes per element
            want_bytes = ptd.cost_model(10, n, heads_q=4, heads_kv=4, head_dim=8, layout="zigzag",
                                        bytes_per_element=2)["bytes_sent_forward_per_rank"][r]
            if ptd.comm_stats()["bytes_sent"] != want_bytes:
                fails.append(f"[n={n} bf16 ring] sent {ptd.comm_stats()['bytes_sent']} bytes, "
                             f"expected {want_bytes}")
        out.float().sum().backward()
        ref = ptd.shard(want, r, n, "zigzag")
        err = float((out.detach().float() - ref).abs().max())
        # one bf16 rounding of values <= max|ref| plus the float32 merge error
        if out.dtype != torch.bfloat16 or ql.grad.dtype != torch.bfloat16 or \
                err > 2.0 ** -8 * float(ref.abs().max()) + 1e-5:
            fails.append(f"[n={n} bf16 {strategy}] dtype {out.dtype} grad {ql.grad.dtype} "
                         f"err {err}")
    return fails


def error_cases(group):
    """Each failure must raise on every rank of the group (no hang): returns failure strings."""
    import posenc.torch.distributed as ptd
    n, r = dist.get_world_size(group), dist.get_rank(group)
    fails = []
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, 12, 4, 8, generator=g) for _ in range(3))

    def expect(name, exc, text, fn):
        t0 = time.time()
        try:
            fn()
        except exc as e:
            if text not in str(e):
                fails.append(f"[n={n} error {name}] message {str(e)!r} lacks {text!r}")
        except Exception as e:
            fails.append(f"[n={n} error {name}] raised {type(e).__name__}: {e}")
        else:
            fails.append(f"[n={n} error {name}] did not raise on rank {r}")
        if time.time() - t0 > 30:
            fails.append(f"[n={n} error {name}] took {time.time() - t0:.0f} s")

    ql, kl, vl = (ptd.shard(x, r, n, "contiguous") for x in (q, k, v))
    if n > 1:
        # the last rank holds one row too many of k and v
        kb = torch.cat([kl, kl[:, :1]], 1) if r == n - 1 else kl
        vb = torch.cat([vl, vl[:, :1]], 1) if r == n - 1 else vl
        expect("shard size", ValueError, "layout", lambda: ptd.context_parallel_attention(
            ql, kb, vb, group=group, causal=True))
        # a NaN in the last rank's queries: only its kernel raises, every rank reports it
        qn = ql.clone()
        if r == n - 1:
            qn[0, 0, 0, 0] = float("nan")
        expect("nan on one rank", ValueError, f"rank {n - 1} of {n} failed: attention: q: non-",
               lambda: ptd.context_parallel_attention(qn, kl, vl, group=group, causal=False))
        # a NaN in keys travels: every rank that sees it reports it
        kn = kl.clone()
        if r == n - 1:
            kn[0, 0, 0, 0] = float("nan")
        expect("nan in keys", ValueError, "non-finite",
               lambda: ptd.context_parallel_attention(ql, kn, vl, group=group, causal=False))
        # heads not divisible by the world size
        q5 = torch.randn(1, ql.shape[1], 5 * n + 1, 8)
        expect("heads", ValueError, "divisible", lambda: ptd.context_parallel_attention(
            q5, q5, q5, group=group, strategy="all_to_all"))
        # ranks disagreeing on the options
        expect("options", ValueError, "differ", lambda: ptd.context_parallel_attention(
            ql, kl, vl, group=group, causal=(r == 0)))
        # positions that differ between ranks
        expect("positions", ValueError, "given whole", lambda: ptd.context_parallel_attention(
            ql, kl, vl, group=group, query_positions=r, key_positions=0))
        # tables that are not replicated
        slopes = torch.full((4,), 0.5 + r)
        expect("tables", ValueError, "replicated", lambda: ptd.context_parallel_attention(
            ql, kl, vl, "alibi", group=group, params={"slopes": slopes}))
        # an exception in one rank's backward reaches every rank
    expect("packed", ValueError, "packed", lambda: ptd.context_parallel_attention(
        ql, kl, vl, group=group, cu_seqlens_q=[0, 1], cu_seqlens_k=[0, 1]))
    expect("fully masked", ValueError, "sees no key", lambda: ptd.context_parallel_attention(
        ql, kl, vl, group=group, causal=True, query_positions=0, key_positions=100))
    expect("layout", ValueError, "layout", lambda: ptd.context_parallel_attention(
        ql, kl, vl, group=group, layout="striped"))
    return fails


def shard_cases():
    import posenc.torch.distributed as ptd
    fails = []
    for length in (0, 1, 5, 13, 16):
        x = torch.arange(2 * length).view(2, length)
        for n in (1, 2, 3, 4):
            for layout in ("contiguous", "zigzag"):
                parts = [ptd.shard(x, r, n, layout) for r in range(n)]
                idx = [ptd.shard_indices(length, r, n, layout) for r in range(n)]
                if not torch.equal(ptd.unshard(parts, layout), x):
                    fails.append(f"unshard(shard) L={length} n={n} {layout}")
                if not all(torch.equal(p, x[:, i]) for p, i in zip(parts, idx)):
                    fails.append(f"shard_indices L={length} n={n} {layout}")
                chunks = torch.tensor_split(x, 2 * n if layout == "zigzag" else n, 1)
                want = chunks if layout == "contiguous" else \
                    [torch.cat([chunks[r], chunks[2 * n - 1 - r]], 1) for r in range(n)]
                if not all(torch.equal(a, b) for a, b in zip(parts, want)):
                    fails.append(f"shard L={length} n={n} {layout}: not the specified chunks")
    return fails


def training_case(group):
    """Item 3: the extrapolation model trained with its sequences split over the group gives the
    single-process losses step by step (float64: to 1e-9; float32: within twice the float32 vs
    float64 difference of the single-process run, + 1e-6). T5 (a learned table shared by the
    layers) on the ring, ALiBi on the all-to-all."""
    import copy
    from posenc.experiments import context_parallel as cp
    from posenc.experiments.extrapolation import _max_rel
    fails = []
    cfg = dict(cp.CONFIG, steps=4)
    data = cp.batches(cfg, 0)
    for scheme, strategy, layout in (("t5", "ring", "zigzag"), ("alibi", "all_to_all",
                                                                "contiguous")):
        base = cp.ContextParallelLM(scheme, strategy=strategy, layout=layout, seed=0, **cfg)
        single32 = cp.train_single(copy.deepcopy(base), cfg, data)
        single64 = cp.train_single(copy.deepcopy(base).double(), cfg, data)
        sharded32 = cp.train_sharded(copy.deepcopy(base), cfg, data, group)
        sharded64 = cp.train_sharded(copy.deepcopy(base).double(), cfg, data, group)
        tol = 2 * _max_rel(single32, single64) + 1e-6
        if not _max_rel(sharded32, single32) <= tol:
            fails.append(f"[training {scheme} {strategy}] float32 losses {sharded32} vs "
                         f"{single32} (tol {tol:.2g})")
        if not _max_rel(sharded64, single64) <= 1e-9:
            fails.append(f"[training {scheme} {strategy}] float64 losses {sharded64} vs "
                         f"{single64}")
    return fails


def _setup_threads():
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"


def worker(rank, world, port, outdir, mode):
    """One process of the spawned 4-rank world (mode 'battery') ."""
    _setup_threads()
    fails = []
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=60))
        groups = {}
        for n in range(1, world + 1):
            # groups of 1..world ranks; the 2-rank group is {1, 3}: group ranks differ from
            # global ranks
            members = [1, 3] if n == 2 and world >= 4 else list(range(n))
            groups[n] = (members, dist.new_group(members, timeout=datetime.timedelta(seconds=60)))
        if rank == 0:
            fails += shard_cases()
        total = 0
        for n, (members, group) in groups.items():
            if rank in members:
                # One rank (no communication): the grid only; 3 ranks: float32 only.
                f, c = battery(group, full=(n in (2, 4)), extras_limit=None if n > 1 else 0)
                fails += f
                total += c
                checks = [model_config_cases, module_case, half_case, error_cases]
                if n == 2:
                    checks.append(training_case)
                for check in checks:
                    try:
                        fails += check(group)
                    except Exception:
                        fails.append(f"[n={n} {check.__name__}] raised\n"
                                     f"{traceback.format_exc()}")
            dist.barrier()
        # A hung rank: rank 1 of a group with a 2-second timeout does not call; rank 0 must
        # raise within the timeout instead of waiting for it.
        hung = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=2))
        if rank == 0:
            import posenc.torch.distributed as ptd
            t0 = time.time()
            x = torch.randn(1, 3, 4, 8)
            try:
                ptd.context_parallel_attention(x, x, x, group=hung)
                fails.append("hung rank: rank 0 did not raise")
            except Exception:
                if time.time() - t0 > 20:
                    fails.append(f"hung rank: rank 0 took {time.time() - t0:.0f} s")
        elif rank == 1:
            time.sleep(5)
        # A dead rank: the last one leaves; the others must fail fast, not hang.
        if rank == world - 1:
            with open(os.path.join(outdir, f"rank{rank}.txt"), "w") as f:
                f.write("\n".join(fails) + f"\n#cases {total}\n")
            os._exit(0)
        import posenc.torch.distributed as ptd
        t0 = time.time()
        x = torch.randn(1, 3, 4, 8)
        try:
            ptd.context_parallel_attention(x, x, x, timeout=20)
            fails.append(f"dead rank: rank {rank} did not raise")
        except Exception:
            if time.time() - t0 > 60:
                fails.append(f"dead rank: rank {rank} took {time.time() - t0:.0f} s")
        with open(os.path.join(outdir, f"rank{rank}.txt"), "w") as f:
            f.write("\n".join(fails) + f"\n#cases {total}\n")
    except Exception:
        with open(os.path.join(outdir, f"rank{rank}.txt"), "w") as f:
            f.write("\n".join(fails) + "\nworker raised:\n" + traceback.format_exc())
    os._exit(0)  # no teardown against a dead peer


def _collect(outdir, world):
    fails, cases = [], 0
    for r in range(world):
        path = os.path.join(outdir, f"rank{r}.txt")
        if not os.path.exists(path):
            fails.append(f"rank {r}: no report (crashed or killed)")
            continue
        for line in open(path).read().splitlines():
            if line.startswith("#cases"):
                cases = max(cases, int(line.split()[1]))
            elif line.strip():
                fails.append(f"rank {r}: {line}")
    return fails, cases


def _run_workers(fn, world, args, seconds):
    """Spawns `world` processes fn(rank, world, port, outdir, *args), waits up to `seconds`,
    kills what is left; asserts none hung and none failed; returns the largest case count."""
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(fn, args=(world, free_port(), outdir, *args), nprocs=world,
                                 join=False, start_method="spawn")
        deadline = time.time() + seconds
        while time.time() < deadline and any(p.is_alive() for p in ctx.processes):
            time.sleep(0.2)
        alive = [p.pid for p in ctx.processes if p.is_alive()]
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
        fails, cases = _collect(outdir, world)
    assert not alive, f"workers {alive} hung (killed)\n" + "\n".join(fails[:40])
    assert not fails, f"{len(fails)} failures:\n" + "\n".join(fails[:60])
    return cases


def test_context_parallel_battery():
    cases = _run_workers(worker, 4, ("battery",), 600)
    assert cases >= 56 + 19 * 4  # the largest group's count


def triton_worker(rank, world, port, outdir, device):
    """One of 2 processes running context_parallel_attention on posenc's Triton kernels, with
    every block's kernel, merge and backward on them: CUDA shards (device 'cuda', both ranks on
    one GPU, gloo staging the transfers through host memory), or CPU shards with
    backend='triton' through Triton's interpreter (device 'cpu')."""
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported here
    _setup_threads()
    fails = []
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=60))
        import posenc.torch.distributed as ptd
        cases = [("rope", "ring", "zigzag", {"causal": True}),
                 ("alibi", "all_to_all", "contiguous", {"causal": True, "window": 9}),
                 ("t5", "ring", "contiguous", {}),
                 ("none", "ring", "contiguous", {"causal": True, "softcap": 4.0})]
        count = 0
        for i, (scheme, strategy, layout, extra) in enumerate(cases):
            q, k, v, params, kw = _case_tensors(scheme, 40 + i, batch=1, seq_q=21, seq_k=21,
                                                heads_q=4, heads_kv=2, dim=16, causal=False,
                                                variant=0)
            kw = {n: x for n, x in kw.items() if n != "causal"}
            kw.update(extra)
            gen = torch.Generator().manual_seed(7)
            dout = torch.randn(q.shape[0], q.shape[1], q.shape[2], v.shape[3], generator=gen,
                               dtype=torch.float64)
            ref = _single(q, k, v, scheme, params, kw, torch.float64, dout)
            got = _distributed(q, k, v, scheme, params, dict(kw, backend="triton"),
                               torch.float32, dout, None, strategy, layout, device)
            for key, val in got.items():
                want = ref[key]
                if key in ("out", "dq", "dk", "dv"):
                    want = ptd.shard(want, rank, world, layout)
                err = _maxerr(val, want)
                bound = 4e-6 * max(1.0, float(want.abs().max()))
                if not err <= bound:
                    fails.append(f"[triton {scheme} {strategy} {layout}] {key}: {err:.3g} > "
                                 f"{bound:.3g}")
            count += 1
        if "posenc.triton._op" not in sys.modules:
            fails.append("the Triton kernels did not run")
        # q, k and v on two devices: refused on every rank before any transfer.
        x = torch.zeros(1, 8, 2, 8, device=device)
        try:
            ptd.context_parallel_attention(x, x.to("meta"), x, timeout=30)
            fails.append("devices: no error")
        except ValueError as e:
            if "one device" not in str(e):
                fails.append(f"devices: {e}")
        # The ranks on different kinds of device: refused on every rank, naming it.
        y = torch.zeros(1, 8, 2, 8, device=device if rank == 0 else "meta")
        try:
            ptd.context_parallel_attention(y, y, y, timeout=30)
            fails.append("device types: no error")
        except ValueError as e:
            if "device type differs from" not in str(e):
                fails.append(f"device types: {e}")
        with open(os.path.join(outdir, f"rank{rank}.txt"), "w") as f:
            f.write("\n".join(fails) + f"\n#cases {count}\n")
        dist.barrier()
    except Exception:
        with open(os.path.join(outdir, f"rank{rank}.txt"), "w") as f:
            f.write("\n".join(fails) + "\nworker raised:\n" + traceback.format_exc())
    os._exit(0)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_context_parallel_on_the_triton_kernels(device):
    """Ring and all-to-all context parallelism with every block on posenc's Triton kernels,
    forward and backward, against the float64 single-process result: on CUDA shards (skipped
    without a GPU) and on CPU shards through the interpreter."""
    pytest.importorskip("triton")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    assert _run_workers(triton_worker, 2, (device,), 400) == 4


def test_torchrun_smoke():
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    if not os.path.exists(torchrun):
        pytest.skip("torchrun is not installed beside this interpreter")
    with tempfile.TemporaryDirectory() as outdir:
        env = dict(os.environ, POSENC_DIST_OUT=outdir, OMP_NUM_THREADS="1")
        cmd = [torchrun, "--nnodes=1", "--nproc-per-node=2", "--master-addr=127.0.0.1",
               f"--master-port={free_port()}", os.path.abspath(__file__)]
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        fails, cases = _collect(outdir, 2)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        assert not fails, "\n".join(fails[:40])
        assert cases > 0


def _torchrun_main():
    """Under torchrun: the default group from the environment, a smaller battery."""
    _setup_threads()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    fails = []
    try:
        f, count = battery(None, full=False, schemes=("t5", "deberta"), extras_limit=4)
        fails += f + error_cases(None)
    except Exception:
        fails.append("raised:\n" + traceback.format_exc())
        count = 0
    with open(os.path.join(os.environ["POSENC_DIST_OUT"], f"rank{rank}.txt"), "w") as f:
        f.write("\n".join(fails) + f"\n#cases {count}\n")
    # Both ranks done with every collective, then out without tearing gloo down: its teardown can
    # abort a rank ("terminate called without an active exception") while the peer's connection
    # threads still run, even after a barrier. The report is written; nothing is left to flush.
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    _torchrun_main()
