"""Context-parallel attention: 1 rank against 2 ranks on this machine, and a projection to more.

    python bench/distributed_bench.py [--seq 8192] [--heads 4] [--kv-heads 4] [--head-dim 64]
                                      [--schemes none,alibi] [--rounds 3] [--backward]
                                      [--bandwidth-gbit 10,100] [--json out.json]

Spawns 2 processes (gloo on 127.0.0.1, one thread each: torch.set_num_threads(1) and posenc
num_threads=1). In every round, alternately: the whole causal attention in one process (rank 0
alone, plain posenc.torch.attention: the 1-rank baseline), then the same attention split over the
2 ranks by posenc.torch.distributed.context_parallel_attention with ring/zigzag, ring/contiguous
and all_to_all/zigzag; and a control: both processes at once, each the whole sequence on half the
heads without communication (perfectly parallel work: on a machine shared with other jobs it
shows how much of a second core the two processes actually get). A 2-rank time is the slower rank's wall time (both start after a barrier);
its split into compute (posenc kernels and merges) and communication (time blocked on transfers,
i.e. not hidden behind compute) comes from comm_stats(), as do the bytes each rank sent and the
query-key pairs each rank computed (max/min: the compute balance). Medians over the rounds; the
speedup is the median of the per-round ratios (1-rank time / 2-rank time).

The projection (printed, and in docs/distributed.md) takes the measured 1-rank rate (causal
query-key pairs x heads x head_dim per second of one thread), a layer of 32 query / 8 kv heads of
128, ranks of 1 or 32 threads (assumed 32 times faster), gives the 1-rank time c, and uses the
bytes the implementation sends (cost_model, which the counted bytes match):

    ring, zigzag, N ranks: T = c / N^2 + (N - 1) * max(c / N^2, a + b_kv / B)
    all_to_all:            T = c / N + 2 * (N - 1) * a + b_a2a / B
    (forward + backward: the ring's steps carry 2 b_kv, plus one last hop; the all-to-all's
    bytes and messages are the forward's and the backward's)

where b_kv is one k/v shard's bytes, b_a2a the bytes a rank sends in the forward's two
all-to-alls, B the link bandwidth per rank and a = 20 us the per-message latency: the ring
overlaps each transfer with one block of compute; the all-to-all does not overlap.
"""

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import time


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


RUNS = (("ring", "zigzag"), ("ring", "contiguous"), ("all_to_all", "zigzag"))


def _rank(rank, world, port, args, out_path):
    import torch
    import torch.distributed as dist
    import posenc.torch as pt
    import posenc.torch.distributed as ptd
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=600))
    g = torch.Generator().manual_seed(0)
    L, H, Hkv, D = args.seq, args.heads, args.kv_heads, args.head_dim
    q = torch.randn(1, L, H, D, generator=g)
    k = torch.randn(1, L, Hkv, D, generator=g)
    v = torch.randn(1, L, Hkv, D, generator=g)
    results = []
    kw = {"causal": True, "num_threads": 1}
    # Warm-up: the first transfers between two processes open their connections.
    for strategy, layout in RUNS:
        x = ptd.shard(torch.randn(1, 64, H, D), rank, world, layout)
        ptd.context_parallel_attention(x, x[:, :, :Hkv], x[:, :, :Hkv], strategy=strategy,
                                       layout=layout, **kw)
    for rnd in range(args.rounds):
        for scheme in args.schemes:
            row = {"round": rnd, "scheme": scheme}
            # 1 rank: the whole attention in rank 0 while rank 1 waits.
            dist.barrier()
            if rank == 0:
                qq, kk, vv = (x.clone().requires_grad_(args.backward) for x in (q, k, v))
                t0 = time.perf_counter()
                out = pt.attention(qq, kk, vv, scheme, **kw)
                if args.backward:
                    out.sum().backward()
                row["single_s"] = time.perf_counter() - t0
            # Control: both ranks at once, each the whole sequence on half the heads, no
            # communication: what two processes can do on this machine right now.
            dist.barrier()
            hs = slice(rank * H // world, (rank + 1) * H // world)
            ks = slice(rank * Hkv // world, (rank + 1) * Hkv // world)
            qq, kk, vv = (x.clone().requires_grad_(args.backward)
                          for x in (q[:, :, hs], k[:, :, ks], v[:, :, ks]))
            t0 = time.perf_counter()
            out = pt.attention(qq, kk, vv, scheme, **kw)
            if args.backward:
                out.sum().backward()
            t = time.perf_counter() - t0
            times = [None] * world
            dist.all_gather_object(times, t)
            row["control_s"] = max(times)
            dist.barrier()
            for strategy, layout in RUNS:
                ql, kl, vl = (ptd.shard(x, rank, world, layout).clone().requires_grad_(
                    args.backward) for x in (q, k, v))
                dist.barrier()
                ptd.reset_comm_stats()
                t0 = time.perf_counter()
                out = ptd.context_parallel_attention(ql, kl, vl, scheme, strategy=strategy,
                                                     layout=layout, **kw)
                if args.backward:
                    out.sum().backward()
                t = time.perf_counter() - t0
                st = ptd.comm_stats()
                times = [None] * world
                dist.all_gather_object(times, (t, st))
                key = f"{strategy}/{layout}"
                row[key] = {"wall_s": max(x[0] for x in times),
                            "compute_s": [x[1]["compute_s"] for x in times],
                            "comm_wait_s": [x[1]["comm_wait_s"] for x in times],
                            "bytes_sent": [x[1]["bytes_sent"] for x in times],
                            "pairs": [x[1]["visible_pairs"] for x in times]}
            if rank == 0:
                results.append(row)
                r = row
                print(f"round {rnd} {scheme:6s} 1 rank {r['single_s']:.3f} s | control "
                      f"{r['control_s']:.3f} s | " + " | ".join(
                    f"{s}/{lay} {r[f'{s}/{lay}']['wall_s']:.3f} s" for s, lay in RUNS),
                    flush=True)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def project(c, L, n, H, Hkv, D, bandwidth, latency=20e-6, bytes_per_element=4,
            backward=False):
    """Projected (ring time, all_to_all time or None) for N ranks; c: the 1-rank time at L.
    backward: a forward + backward pass (the ring's backward steps carry a k/v shard and a dk/dv
    shard, plus the last dk/dv hop home)."""
    import posenc.torch.distributed as ptd
    b_kv = L / n * Hkv * 2 * D * bytes_per_element
    hop = latency + b_kv / bandwidth
    if backward:
        ring = c / n ** 2 + (n - 1) * max(c / n ** 2, latency + 2 * b_kv / bandwidth) + hop
    else:
        ring = c / n ** 2 + (n - 1) * max(c / n ** 2, hop)
    a2a = None
    group = H // Hkv
    if H % n == 0 and ((H // n) % group == 0 or group % (H // n) == 0):
        m = ptd.cost_model(L, n, heads_q=H, heads_kv=Hkv, head_dim=D, strategy="all_to_all",
                           layout="zigzag", bytes_per_element=bytes_per_element)
        sent = m["bytes_sent_forward"] + (m["bytes_sent_backward"] if backward else 0)
        a2a = c / n + (4 if backward else 2) * (n - 1) * latency + sent / bandwidth
    return ring, a2a


# The model shape of the projection: a Llama-3-8B-like layer (32 query heads, 8 kv heads of 128).
PROJ_SHAPE = (32, 8, 128)


def projection(rate, bws, lengths=(8192, 131072), threads=(1, 32), ranks=(2, 8, 16, 32, 64),
               backward=False):
    """Rows of the projection table. rate: measured causal query-key pairs x heads x head_dim
    per second of one thread; a rank of T threads is assumed T times faster."""
    H, Hkv, D = PROJ_SHAPE
    rows = []
    for length in lengths:
        for t in threads:
            c = length * (length + 1) / 2 * H * D / (rate * t)
            for bw in bws:
                cells = []
                for n in ranks:
                    ring, a2a = project(c, length, n, H, Hkv, D, bw * 1e9 / 8,
                                        backward=backward)
                    cells.append((c / ring, (c / a2a) if a2a else None))
                rows.append({"L": length, "threads": t, "gbit": bw, "one_rank_s": c,
                             "speedups": cells})
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--schemes", default="none,alibi")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--backward", action="store_true", help="time forward + backward")
    p.add_argument("--bandwidth-gbit", default="10,100",
                   help="link bandwidths per rank for the projection, Gbit/s")
    p.add_argument("--json", default=None, help="write the measurements here")
    args = p.parse_args(argv)
    args.kv_heads = args.kv_heads or args.heads
    args.schemes = args.schemes.split(",")
    os.environ["OMP_NUM_THREADS"] = "1"
    import tempfile
    import torch.multiprocessing as mp
    import posenc.torch.distributed as ptd
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "res.json")
        mp.start_processes(_rank, args=(2, _free_port(), args, path), nprocs=2,
                           start_method="spawn")
        with open(path) as f:
            rows = json.load(f)
    L, H, Hkv, D = args.seq, args.heads, args.kv_heads, args.head_dim
    what = "forward + backward" if args.backward else "forward"
    print(f"\nL = {L}, heads {H}/{Hkv}, head_dim {D}, causal, {what}, one thread per rank; "
          f"medians of {args.rounds} alternating rounds")
    print("| scheme | run | wall (s) | speedup vs 1 rank | compute per rank (s) | "
          "comm wait per rank (s) | bytes sent per rank (counted / model) | work max/min |")
    print("|---|---|---|---|---|---|---|---|")
    summary = {}
    for scheme in args.schemes:
        rs = [r for r in rows if r["scheme"] == scheme]
        single = statistics.median(r["single_s"] for r in rs)
        summary[scheme] = {"single_s": single}
        print(f"| {scheme} | 1 rank | {single:.3f} | 1 | {single:.3f} | 0 | 0 | 1 |")
        ctl = statistics.median(r["control_s"] for r in rs)
        cspeed = statistics.median(r["single_s"] / r["control_s"] for r in rs)
        summary[scheme]["control"] = {"wall_s": ctl, "speedup": cspeed}
        print(f"| {scheme} | control: 2 independent processes, half the heads each, no "
              f"communication | {ctl:.3f} | {cspeed:.2f} | | | 0 | 1 |")
        for strategy, layout in RUNS:
            key = f"{strategy}/{layout}"
            wall = statistics.median(r[key]["wall_s"] for r in rs)
            speed = statistics.median(r["single_s"] / r[key]["wall_s"] for r in rs)
            comp = [statistics.median(r[key]["compute_s"][i] for r in rs) for i in range(2)]
            wait = [statistics.median(r[key]["comm_wait_s"][i] for r in rs) for i in range(2)]
            sent = rs[-1][key]["bytes_sent"]
            pairs = rs[-1][key]["pairs"]
            m = ptd.cost_model(L, 2, heads_q=H, heads_kv=Hkv, head_dim=D, strategy=strategy,
                               layout=layout)
            model = m["bytes_sent_forward"] + (m["bytes_sent_backward"] if args.backward else 0)
            bal = max(pairs) / max(1, min(pairs))
            vs_ctl = statistics.median(r["control_s"] / r[key]["wall_s"] for r in rs)
            summary[scheme][key] = {"wall_s": wall, "speedup": speed, "vs_control": vs_ctl,
                                    "compute_s": comp,
                                    "comm_wait_s": wait, "bytes_sent": sent,
                                    "bytes_model": model, "work_max_over_min": bal}
            print(f"| {scheme} | 2 ranks {strategy}/{layout} (x{vs_ctl:.2f} of the control's "
                  f"throughput) | {wall:.3f} | {speed:.2f} | "
                  f"{comp[0]:.3f} / {comp[1]:.3f} | {wait[0]:.3f} / {wait[1]:.3f} | "
                  f"{max(sent) / 2**20:.2f} MiB / {model / 2**20:.2f} MiB | {bal:.2f} |")
    # Projection from the measured 1-rank rate (the first scheme's).
    c0 = summary[args.schemes[0]]["single_s"]
    rate = L * (L + 1) / 2 * H * D / c0
    bws = [float(x) for x in args.bandwidth_gbit.split(",")]
    proj = projection(rate, bws, backward=args.backward)
    ranks = (2, 8, 16, 32, 64)
    print(f"\nProjection: {args.schemes[0]}, causal, {what}, one layer of {PROJ_SHAPE[0]}/"
          f"{PROJ_SHAPE[1]} heads of {PROJ_SHAPE[2]}; measured rate {rate / 1e9:.2f} G "
          f"pair-dims/s per thread; speedup over 1 rank, ring zigzag / all_to_all")
    print("| L | threads per rank | link | 1 rank (s) | " + " | ".join(f"N = {n}" for n in ranks)
          + " |")
    print("|---" * (4 + len(ranks)) + "|")
    for row in proj:
        cells = [f"{a:.1f} / " + (f"{b:.1f}" if b else "-") for a, b in row["speedups"]]
        print(f"| {row['L']} | {row['threads']} | {row['gbit']:g} Gbit/s | "
              f"{row['one_rank_s']:.3g} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rounds": rows, "summary": summary,
                       "projection": proj}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
