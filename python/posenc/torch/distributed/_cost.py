"""cost_model: the per-rank communication and work of one attention layer, computed without a
process group."""

from ._layout import STRATEGIES, _check_layout, _segments, _shard_len


def cost_model(seq_len, world_size, *, heads_q, heads_kv=None, head_dim, v_dim=None, batch=1,
               strategy="ring", layout="contiguous", causal=True, bytes_per_element=4):
    """Per-rank communication and work of one attention layer (no process group needed).

    Returns a dict: bytes_sent_forward / bytes_sent_backward (per rank, the most any rank sends:
    ring: (N-1) k/v shards forward, (N-1) k/v shards and N k/v gradient shards backward;
    all_to_all: q, k, v out and back forward plus lse, dout, dq, dk, dv backward),
    work (visible query-key pairs per rank, per head and batch row: the ring's causal blocks
    after skipping, or Ulysses' full sequence on heads/N), work_max_over_min (the compute
    imbalance), activation_elements (per rank: its q, k, v and out shards)."""
    _check_layout(layout)
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy: '{strategy}' (ring or all_to_all)")
    n = world_size
    hkv = heads_kv or heads_q
    dv = v_dim or head_dim
    lens = [_shard_len(seq_len, r, n, layout) for r in range(n)]
    segs = [_segments(seq_len, r, n, layout) for r in range(n)]
    be = bytes_per_element

    def pairs(qa, qb, ka, kb):
        if qb <= qa or kb <= ka:
            return 0
        if not causal:
            return (qb - qa) * (kb - ka)
        # sum over queries i of |{j in [ka, kb): j <= i}|, in closed form
        lo, hi = max(qa, ka), min(qb, kb - 1)
        ramp = (hi - lo) * (lo + hi + 1 - 2 * ka) // 2 if hi > lo else 0
        full = max(0, qb - max(qa, kb - 1)) * (kb - ka)
        return ramp + full

    def block_pairs(qr, kr):
        return sum(pairs(a, b, c, d) for a, b in segs[qr] for c, d in segs[kr])

    if strategy == "ring":
        work = [sum(block_pairs(r, s) for s in range(n)) * heads_q for r in range(n)]
        kv = [batch * L * hkv * (head_dim + dv) * be for L in lens]
        fwd = [sum(kv[(r - t) % n] for t in range(n - 1)) for r in range(n)]
        bwd = [fwd[r] + sum(kv[(r - t) % n] for t in range(n)) for r in range(n)]
    else:
        if heads_q % n:
            raise ValueError(f"heads_q ({heads_q}) must be divisible by world_size ({n})")
        total = pairs(0, seq_len, 0, seq_len)
        work = [total * heads_q // n] * n
        hq = heads_q // n
        group = heads_q // hkv
        hk = [((r + 1) * hq - 1) // group + 1 - (r * hq) // group for r in range(n)]
        fwd, bwd = [], []
        for r in range(n):
            others = [s for s in range(n) if s != r]
            # q, k, v of this rank's rows for the other ranks' heads; out and lse of their rows
            # for this rank's heads back.
            to = sum(lens[r] * (hq * head_dim + hk[s] * (head_dim + dv)) for s in others)
            back = sum(lens[s] * hq * (dv + 1) for s in others)
            fwd.append(batch * (to + back) * be)
            # dout of this rank's rows for the others' heads; dq, dk, dv of their rows back.
            b_dout = sum(lens[r] * hq * dv for s in others)
            b_grads = sum(lens[s] * (hq * head_dim + hk[r] * (head_dim + dv)) for s in others)
            bwd.append(batch * (b_dout + b_grads) * be)
    act = [batch * L * (2 * heads_q * head_dim + hkv * (head_dim + dv)) for L in lens]
    lo = min(work) if min(work) > 0 else 1
    return {"bytes_sent_forward": max(fwd), "bytes_sent_backward": max(bwd),
            "bytes_sent_forward_per_rank": fwd, "bytes_sent_backward_per_rank": bwd,
            "work": work, "work_max_over_min": max(work) / lo,
            "activation_elements": act}
