"""Training with the sequence split over several processes (context parallelism).

The extrapolation experiment's byte-level language model (posenc.experiments.extrapolation),
with its attention replaced by posenc.torch.distributed.context_parallel_attention: each rank
holds a shard of every sequence (its tokens, their embeddings and every activation: memory
O(L / N)), positions are the tokens' global positions, and after the backward the gradients are
summed over the ranks (the attention's table gradients are left per rank, reduce_grads=False, so
one all-reduce treats every parameter alike). The same model, weights and batches are trained in
one process too, and the losses are compared step by step.

    python -m posenc.experiments.context_parallel --scheme alibi --ranks 2 --steps 8

prints both loss sequences and their largest relative difference, for float32 (fused kernels)
and float64 (posenc's float64 reference end to end). The float32 tolerance is the float32 noise
of the same single-process training: twice the largest relative difference between its float32
and float64 losses, plus 1e-6; float64 must agree to 1e-9.
"""

import argparse
import copy
import datetime
import json
import math
import os
import socket
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from . import extrapolation as ex

CONFIG = dict(ex.QUICK, train_length=32, batch=4, steps=8, lr=3e-3, warmup=2)


class ContextParallelLM(ex.LanguageModel):
    """LanguageModel whose forward takes this rank's shard of the tokens (shard_forward) and whose
    attention is context-parallel over `group`."""

    def __init__(self, scheme, *, strategy="ring", layout="zigzag", **cfg):
        super().__init__(scheme, **cfg)
        self.cp = {"strategy": strategy, "layout": layout}

    def shard_forward(self, idx, positions, group):
        """Logits of this rank's tokens idx [batch, shard] at global `positions` [shard]."""
        self.cp_group = group
        x = self.tok(idx) * math.sqrt(self.d)
        if self.sinusoidal is not None:
            x = self.sinusoidal(x, positions)
        if self.learned is not None:
            x = self.learned(x, positions)
        for i, blk in enumerate(self.blocks):
            blk.layer_index = i
            x = blk(x, self.attend_cp)
        return self.head(self.lnf(x))

    def attend_cp(self, block, q, k, v):
        from ..torch.distributed import context_parallel_attention
        i = block.layer_index
        kw = {"causal": True, "num_threads": self.threads, "group": self.cp_group,
              "reduce_grads": False, **self.cp}
        if self.attn_scheme == "deberta":
            return context_parallel_attention(q, k, v, "deberta", params=self.deberta_tables(block),
                                              **self.deberta, **kw)
        kw["scale"] = self.scale
        module = self.t5 if self.t5 is not None else (self.pos[i] if self.pos is not None
                                                      else None)
        if module is None:
            return context_parallel_attention(q, k, v, "none", **kw)
        # The call's keywords override the module's settings (as the module's forward does).
        return context_parallel_attention(q, k, v, module.scheme, params=module.tables() or None,
                                          **{**module.settings(), **kw})


def batches(cfg, seed):
    """The training batches [batch, length + 1]: a byte stream with structure (a repeated random
    phrase with noise), the same for every run."""
    g = torch.Generator().manual_seed(seed)
    phrase = torch.randint(0, 256, (97,), generator=g)
    data = phrase.repeat(200)
    noise = torch.rand(data.shape, generator=g) < 0.1
    data = torch.where(noise, torch.randint(0, 256, data.shape, generator=g), data)
    return list(ex.train_batches(data, cfg["train_length"], cfg["batch"], cfg["steps"], seed))


def train_single(model, cfg, data):
    opt = ex.make_optimizer(model, cfg)
    return [ex.train_step(model, opt, b.to(torch.long), i, cfg) for i, b in enumerate(data)]


def train_sharded(model, cfg, data, group):
    """The same steps with the sequence split over `group`: returns the global losses."""
    import torch.distributed as dist
    from ..torch.distributed import shard, shard_indices
    n, r = dist.get_world_size(group), dist.get_rank(group)
    layout = model.cp["layout"]
    opt = ex.make_optimizer(model, cfg)
    losses = []
    for step, b in enumerate(data):
        for grp in opt.param_groups:
            grp["lr"] = ex.lr_at(step, cfg)
        inputs, targets = b[:, :-1], b[:, 1:]
        length = inputs.shape[1]
        idx = shard(inputs, r, n, layout)
        tgt = shard(targets, r, n, layout)
        pos = shard_indices(length, r, n, layout)
        logits = model.shard_forward(idx, pos, group)
        # The global mean: this rank's sum over the number of tokens of the whole batch.
        loss = F.cross_entropy(logits.reshape(-1, 256), tgt.reshape(-1), reduction="sum") / \
            (inputs.numel())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p)
                 for p in model.parameters()]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        off = 0
        for p, g in zip(model.parameters(), grads):
            p.grad = flat[off:off + g.numel()].view_as(g).clone()
            off += g.numel()
        total = loss.detach().clone()
        dist.all_reduce(total, group=group)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(total.item())
    return losses


def _rank_main(rank, world, port, scheme, strategy, layout, dtype, cfg, out_path):
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    model = ContextParallelLM(scheme, strategy=strategy, layout=layout, seed=0, **cfg)
    if dtype == "float64":
        model = model.double()
    losses = train_sharded(model, cfg, batches(cfg, 0), None)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(losses, f)
    dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_sharded(scheme, ranks, strategy, layout, dtype, cfg, timeout=600):
    """Trains with `ranks` processes (torch.multiprocessing, gloo on 127.0.0.1): the losses."""
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "losses.json")
        ctx = mp.start_processes(_rank_main, args=(ranks, _free_port(), scheme, strategy, layout,
                                                   dtype, cfg, path),
                                 nprocs=ranks, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        while not ctx.join(max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise RuntimeError(f"training over {ranks} ranks did not finish in {timeout} s")
        with open(path) as f:
            return json.load(f)


def compare(scheme, ranks=2, strategy="ring", layout="zigzag", cfg=None):
    """Single-process and sharded losses, float32 and float64, with the verdict (a dict)."""
    cfg = dict(cfg or CONFIG)
    torch.set_num_threads(1)
    data = batches(cfg, 0)
    base = ContextParallelLM(scheme, seed=0, **cfg)
    single32 = train_single(copy.deepcopy(base), cfg, data)
    single64 = train_single(copy.deepcopy(base).double(), cfg, data)
    dist32 = run_sharded(scheme, ranks, strategy, layout, "float32", cfg)
    dist64 = run_sharded(scheme, ranks, strategy, layout, "float64", cfg)
    rel = ex._max_rel
    noise = rel(single32, single64)
    res = {"scheme": scheme, "ranks": ranks, "strategy": strategy, "layout": layout,
           "single_float32": single32, "sharded_float32": dist32,
           "single_float64": single64, "sharded_float64": dist64,
           "float32_difference": rel(dist32, single32), "float32_noise": noise,
           "float32_tolerance": 2 * noise + 1e-6, "float64_difference": rel(dist64, single64)}
    res["ok"] = (res["float32_difference"] <= res["float32_tolerance"]
                 and res["float64_difference"] <= 1e-9)
    return res


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scheme", default="alibi", choices=sorted(ex.SCHEMES))
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--strategy", default="ring", choices=("ring", "all_to_all"))
    p.add_argument("--layout", default="zigzag", choices=("contiguous", "zigzag"))
    p.add_argument("--steps", type=int, default=CONFIG["steps"])
    args = p.parse_args(argv)
    cfg = dict(CONFIG, steps=args.steps)
    res = compare(args.scheme, args.ranks, args.strategy, args.layout, cfg)
    print(f"{args.scheme}, {args.ranks} ranks, {args.strategy}, {args.layout}")
    print("step  single float32  sharded float32  single float64  sharded float64")
    for i in range(len(res["single_float32"])):
        print(f"{i:4d}  {res['single_float32'][i]:14.8f}  {res['sharded_float32'][i]:15.8f}  "
              f"{res['single_float64'][i]:14.10f}  {res['sharded_float64'][i]:15.10f}")
    print(f"float32: max relative difference {res['float32_difference']:.2e} (tolerance "
          f"{res['float32_tolerance']:.2e}: twice the float32-vs-float64 difference "
          f"{res['float32_noise']:.2e} + 1e-6)")
    print(f"float64: max relative difference {res['float64_difference']:.2e} (tolerance 1e-9)")
    print("same losses" if res["ok"] else "LOSSES DIFFER")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
