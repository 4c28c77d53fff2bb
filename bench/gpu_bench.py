"""posenc's Triton kernels against the GPU baselines, in one run on one CUDA GPU: a Markdown
table of times and same-run ratios.

    python bench/gpu_bench.py [--out results.md] [--lengths 4096 16384] [--quick]

Rows (bf16, batch 4, 16 heads of 128, causal, unless a row says otherwise), each forward and
forward + backward:
- none: posenc (backend "triton") against the fastest of PyTorch's SDPA backends (flash,
  efficient, cuDNN: each tried, the fastest kept);
- ALiBi and T5: posenc against FlexAttention compiled with the equivalent score_mod, and against
  SDPA with the bias materialized ([heads, L, L], made outside the timing);
- DeBERTa (DeBERTa-v3-base's attention: 12 heads of 64, batch 8, L 2048, 256 log buckets over
  512 positions, bidirectional) and Transformer-XL (the same shapes, d_model 768, causal): posenc
  against the eager formulation of Hugging Face's model code (every score term materialized as
  [batch, heads, L, L] and gathered by distance, softmax, then the values), with each side's
  peak of extra memory;
- paged decoding (bf16, 8 rows of one query, 32 query heads over 8 kv heads of 128, 32768
  cached keys per row in pages of 16 scattered over the pool, RoPE): posenc's
  ``attention_paged`` (the pages read in place) against the fastest SDPA backend over the same
  keys stored contiguously, and as a fraction of the copy bandwidth (the cache bytes read);
- RoPE alone (bf16, batch 4, L 16384, 16 heads of 128): ``posenc.torch.rope`` (the Triton
  kernel) and the same rotation written in place, as a fraction of the copy bandwidth (bytes
  read and written);
- the device's copy bandwidth (a bf16 tensor copied, bytes read and written), for scale.
Times are CUDA-event medians of several runs after warm-up. A ratio > 1 means posenc is faster.
Needs a CUDA GPU and the posenc package with its extension importable.
"""

import argparse
import math
import statistics
import sys

import numpy as np
import torch
import torch.nn.functional as F

import posenc
import posenc.torch as pt


def timed(fn, repeats, warmup=3):
    """Median milliseconds of fn() over `repeats` runs (CUDA events), after warm-up."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def forward_backward(fn, inputs):
    """A closure running fn's forward and, for 'fwd+bwd', its backward."""
    def fwd():
        with torch.no_grad():
            fn()

    def both():
        out = fn()
        out.backward(torch.ones_like(out))
        for t in inputs:
            t.grad = None
    return fwd, both


def sdpa_fastest(q, k, v, repeats, bias=None):
    """(name, forward ms, forward + backward ms) of the fastest SDPA backend that runs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    best = None
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                    SDPBackend.EFFICIENT_ATTENTION):
        def call(backend=backend):
            with sdpa_kernel(backend):
                if bias is None:
                    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
                return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=bias)
        try:
            fwd, both = forward_backward(call, (q, k, v))
            row = (backend.name.lower(), timed(fwd, repeats), timed(both, repeats))
        except RuntimeError:
            continue
        if best is None or row[1] < best[1]:
            best = row
    return best


def peak_mb(fn):
    """The peak of memory allocated beyond what was allocated before fn() (MB)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 1e6


def relative_cases(dev, batch, heads, dim, length, backend="triton"):
    """{name: (posenc call, eager call, the tensors with gradients)} of DeBERTa and
    Transformer-XL at these sizes (bf16 on the device)."""
    g = torch.Generator(device=dev).manual_seed(7)

    def rand(*shape, scale=1.0, dtype=torch.bfloat16):
        return (scale * torch.randn(*shape, device=dev, generator=g)).to(dtype).requires_grad_()

    q, k, v = (rand(batch, length, heads, dim) for _ in range(3))
    idx = torch.arange(length, device=dev)
    rel = idx[None, :] - idx[:, None]  # pos_k - pos_q
    span = 256
    pos_key, pos_query = rand(2 * span, heads, dim, scale=0.1), rand(2 * span, heads, dim,
                                                                      scale=0.1)
    bucket_kw = dict(position_buckets=span, max_relative_positions=512)
    c2p = torch.as_tensor(posenc.deberta_c2p_index(idx.cpu().numpy()[:, None],
                                                   idx.cpu().numpy()[None, :], **bucket_kw),
                          device=dev).long()
    p2c = torch.as_tensor(posenc.deberta_p2c_index(idx.cpu().numpy()[:, None],
                                                   idx.cpu().numpy()[None, :], **bucket_kw),
                          device=dev).long()
    scale = 1 / math.sqrt(3 * dim)

    def deberta_eager():
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # [b, h, L, d]
        s = qt @ kt.transpose(-1, -2)
        c2p_all = qt @ pos_key.permute(1, 2, 0)  # [b, h, L, 2K]
        s = s + torch.gather(c2p_all, -1, c2p.expand(batch, heads, length, length))
        p2c_all = kt @ pos_query.permute(1, 2, 0)  # [b, h, L_k, 2K]
        s = s + torch.gather(p2c_all, -1, p2c.t().expand(batch, heads, length,
                                                          length)).transpose(-1, -2)
        return (torch.softmax(s * scale, -1) @ vt).transpose(1, 2)

    def deberta_posenc():
        return pt.attention(q, k, v, "deberta", backend=backend,
                            params={"pos_key": pos_key, "pos_query": pos_query}, **bucket_kw)

    d_model = 768
    u, w = rand(heads, dim, scale=0.1, dtype=torch.float32), rand(heads, dim, scale=0.1,
                                                                   dtype=torch.float32)
    r_net = rand(heads * dim, d_model, scale=0.05, dtype=torch.float32)
    sinusoid = torch.as_tensor(np.stack([posenc.xl_sinusoid(d, d_model)
                                         for d in range(length)]), device=dev)
    causal = rel > 0

    def xl_eager():
        r = (sinusoid.float() @ r_net.t()).view(length, heads, dim).to(q.dtype)  # r(delta)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        ac = (qt + u.to(q.dtype)[None, :, None, :]) @ kt.transpose(-1, -2)
        bd_all = (qt + w.to(q.dtype)[None, :, None, :]) @ r.permute(1, 2, 0)  # [b, h, L, L]
        delta = (-rel).clamp(min=0)
        bd = torch.gather(bd_all, -1, delta.expand(batch, heads, length, length))
        s = ((ac + bd) / math.sqrt(dim)).masked_fill(causal, -math.inf)
        return (torch.softmax(s, -1) @ vt).transpose(1, 2)

    def xl_posenc():
        return pt.attention(q, k, v, "xl", causal=True, backend=backend,
                            params={"r_w_bias": u, "r_r_bias": w, "r_net": r_net})

    inputs = (q, k, v, pos_key, pos_query, u, w, r_net)
    return {"DeBERTa": (deberta_posenc, deberta_eager, inputs),
            "Transformer-XL": (xl_posenc, xl_eager, inputs)}


def relative_rows(lines, dev, repeats, batch=8, heads=12, dim=64, length=2048):
    """DeBERTa and Transformer-XL: posenc against the eager formulation of the model code."""
    cases = relative_cases(dev, batch, heads, dim, length)
    lines += ["", f"DeBERTa and Transformer-XL: bf16, batch {batch}, {heads} heads of {dim}, "
              f"L {length}", "", "| row | posenc fwd ms | eager fwd ms | ratio fwd | posenc "
              "fwd+bwd ms | eager fwd+bwd ms | ratio fwd+bwd | posenc extra MB | eager extra "
              "MB |", "|---|---|---|---|---|---|---|---|---|"]
    for name, (mine, eager, inputs) in cases.items():
        times = []
        for fn in (mine, eager):
            fwd, both = forward_backward(fn, inputs)
            times.append((timed(fwd, repeats), timed(both, repeats), peak_mb(both)))
        (mf, mb, mm), (ef, eb, em) = times
        lines.append(f"| {name} | {mf:.3f} | {ef:.3f} | {ef / mf:.2f} | {mb:.3f} | {eb:.3f} | "
                     f"{eb / mb:.2f} | {mm:.0f} | {em:.0f} |")


def decode_rows(lines, dev, repeats, bandwidth, batch=8, heads_q=32, heads_kv=8, dim=128,
                length=32768, page=16):
    """Paged decoding and RoPE alone, against SDPA and the copy bandwidth."""
    from posenc import _device
    from posenc.triton import _rope
    g = torch.Generator(device=dev).manual_seed(3)
    pages_per_row = length // page
    num_pages = batch * pages_per_row
    k_pages, v_pages = (torch.randn(num_pages, page, heads_kv, dim, device=dev,
                                    dtype=torch.bfloat16, generator=g) for _ in range(2))
    table = torch.randperm(num_pages, device=dev, generator=g).view(batch, pages_per_row)
    table = table.to(torch.int32)
    lens = torch.full((batch,), length, dtype=torch.int32, device=dev)
    q = torch.randn(batch, 1, heads_q, dim, device=dev, dtype=torch.bfloat16, generator=g)
    with torch.no_grad():
        mine = timed(lambda: pt.attention_paged(q, k_pages, v_pages, table, lens, "rope",
                                                causal=True), repeats)
        # SDPA over the same keys, contiguous [batch, heads_kv, length, dim] (rotated keys and
        # queries are the same work for it; its rotation is not timed).
        k, v = (p[table.long()].flatten(1, 2).transpose(1, 2).contiguous()
                for p in (k_pages, v_pages))
        qt = q.transpose(1, 2)
        best = None
        from torch.nn.attention import SDPBackend, sdpa_kernel
        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                        SDPBackend.EFFICIENT_ATTENTION):
            def call(backend=backend):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(qt, k, v, enable_gqa=True)
            try:
                ms = timed(call, repeats)
            except RuntimeError:
                continue
            if best is None or ms < best[1]:
                best = (backend.name.lower(), ms)
        del k, v
    cache_gb = 2 * k_pages.numel() * 2 / 1e9
    lines += ["", f"Paged decoding: bf16, {batch} rows x 1 query, {heads_q} / {heads_kv} heads of "
              f"{dim}, {length} keys per row in pages of {page}, RoPE, causal", "",
              "| row | posenc ms | SDPA (contiguous cache) | SDPA ms | ratio | posenc cache "
              "GB/s | vs copy bandwidth |", "|---|---|---|---|---|---|---|"]
    name, sdpa_ms = best if best else ("none ran", float("nan"))
    lines.append(f"| paged decode | {mine:.3f} | {name} | {sdpa_ms:.3f} | {sdpa_ms / mine:.2f} "
                 f"| {cache_gb / (mine * 1e-3):.0f} | "
                 f"{cache_gb / (mine * 1e-3) / bandwidth:.2f} |")
    del k_pages, v_pages
    x = torch.randn(4, 16384, 16, 128, device=dev, dtype=torch.bfloat16, generator=g)
    freqs = posenc.rope_frequencies(128)
    ids = np.arange(x.shape[1])[None, :]
    _, cos, sin = _device._tables(ids, freqs, False, x.device)
    cos, sin = cos.contiguous(), sin.contiguous()
    with torch.no_grad():
        op_ms = timed(lambda: pt.rope(x, freqs), repeats)
        inplace_ms = timed(lambda: _rope.rotate(x, cos, sin, 128, False, out=x), repeats)
    moved = 2 * x.numel() * 2 / 1e9
    lines += ["", "RoPE alone: bf16 [4, 16384, 16, 128], accurate angles (float64 rotation)", "",
              "| row | ms | GB/s (read + written) | vs copy bandwidth |", "|---|---|---|---|"]
    for row, ms in (("posenc.torch.rope (new tensor, angles included)", op_ms),
                    ("Triton kernel in place (tables made beforehand)", inplace_ms)):
        lines.append(f"| {row} | {ms:.3f} | {moved / (ms * 1e-3):.0f} | "
                     f"{moved / (ms * 1e-3) / bandwidth:.2f} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", help="write the table to this file too")
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--quick", action="store_true", help="fewer repeats")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_bench: no CUDA device")
    repeats = 5 if args.quick else 20
    dev = torch.device("cuda")
    lines = [f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}; triton "
             f"{__import__('triton').__version__}; posenc {posenc.__version__}", "",
             "| L | row | posenc fwd ms | baseline | baseline fwd ms | ratio fwd | posenc fwd+bwd ms"
             " | baseline fwd+bwd ms | ratio fwd+bwd |", "|---|---|---|---|---|---|---|---|---|"]

    x = torch.empty(1 << 28, dtype=torch.bfloat16, device=dev)
    y = torch.empty_like(x)
    copy_ms = timed(lambda: y.copy_(x), repeats)
    bandwidth = 2 * x.numel() * 2 / (copy_ms * 1e-3) / 1e9
    del x, y

    batch, heads, dim = 4, 16, 128
    for length in args.lengths:
        g = torch.Generator(device=dev).manual_seed(length)
        q, k, v = (torch.randn(batch, length, heads, dim, device=dev, dtype=torch.bfloat16,
                               generator=g).requires_grad_() for _ in range(3))
        slopes = torch.tensor(posenc.alibi_slopes(heads), device=dev, dtype=torch.float32)
        table = torch.randn(32, heads, device=dev, generator=g)

        def posenc_row(scheme, **kw):
            fwd, both = forward_backward(
                lambda: pt.attention(q, k, v, scheme, causal=True, backend="triton", **kw),
                (q, k, v))
            return timed(fwd, repeats), timed(both, repeats)

        def add(row, mine, base_name, base):
            lines.append(f"| {length} | {row} | {mine[0]:.3f} | {base_name} | {base[0]:.3f} | "
                         f"{base[0] / mine[0]:.2f} | {mine[1]:.3f} | {base[1]:.3f} | "
                         f"{base[1] / mine[1]:.2f} |")

        name, *sdpa = sdpa_fastest(q, k, v, repeats)
        add("none", posenc_row("none"), f"SDPA {name}", sdpa)

        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        flex = torch.compile(flex_attention)
        causal = create_block_mask(lambda b, h, i, j: j <= i, None, None, length, length,
                                   device=dev)
        idx = torch.arange(length, device=dev)
        for scheme, kw, score_mod, bias in (
                ("alibi", {}, lambda s, b, h, i, j: s - slopes[h] * (i - j),
                 -slopes[:, None, None] * (idx[:, None] - idx[None, :]).abs()),
                ("t5", {"params": {"relative_attention_bias": table}, "scale": 1.0}, None, None)):
            if scheme == "t5":
                buckets = torch.tensor(posenc.t5_bucket(
                    (idx[None, :] - idx[:, None]).cpu().numpy(), num_buckets=32,
                    max_distance=128, bidirectional=False), device=dev).long()
                bias = table[buckets].permute(2, 0, 1)
                flat = table.t().contiguous()

                def score_mod(s, b, h, i, j, flat=flat, buckets=buckets):
                    return s + flat[h, buckets[i, j]]
            bias = bias.masked_fill(idx[None, :] > idx[:, None], -math.inf).to(torch.bfloat16)
            scale = kw.get("scale")
            mine = posenc_row(scheme, **kw)
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
            fwd, both = forward_backward(
                lambda sm=score_mod: flex(qt, kt, vt, score_mod=sm, block_mask=causal,
                                          scale=scale).transpose(1, 2), (q, k, v))
            add(scheme, mine, "FlexAttention", (timed(fwd, repeats), timed(both, repeats)))
            name, *base = sdpa_fastest(q, k, v, repeats, bias=bias[None].expand(
                batch, heads, length, length))
            add(scheme, mine, f"SDPA {name} + materialized bias", base)
        del q, k, v
        torch.cuda.empty_cache()
    relative_rows(lines, dev, repeats)
    decode_rows(lines, dev, repeats, bandwidth)
    lines += ["", f"Copy bandwidth (bf16 copy, bytes read + written): {bandwidth:.0f} GB/s"]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
