"""Triton kernels of the attention backward (FlashAttention-2's recomputation).

The probabilities are rebuilt tile by tile from q, k, the scheme and the forward's lse,
P = exp(s - lse), and with D = rowsum(dout * out) (minus the incoming gradient of lse):

    dP = dout . v        dS = P * (dP - D)        (times 1 - tanh^2 under a soft-cap)
    dv = sum P^T dout    dk = scale * sum dS^T q    dq = scale * sum dS k

Two kernels, so that no element is written by two programs: one program per (batch row, kv
head, block of keys) accumulates dk and dv over every query head of its GQA group and every query
block the masks leave visible; one program per (batch row, query head, block of queries)
accumulates dq over the key tiles, and the bias gradients of its rows: ALiBi's
-sum dS |rel| as one number per program, T5's sum of dS per bucket with atomic adds into the
program's own row of buckets. The host adds those partial sums in float64. With RoPE, dq and dk
are first the gradients of the rotated q and k (float32), then rotated back by the transpose of
the rotation (``rope_back_kernel``). The sinks' gradient, dsink_h = -sum_i exp(sink_h - lse_i)
D_i, needs only lse and D and is summed on the host.
"""

import torch
import triton
import triton.language as tl

from . import _prepare
from ._forward import (ALIBI, T5, EMULATE_BF16, dot, alibi_bias, biased_queries, block_info,
                       head_slope, load_rotated, load_tile, rounded, scores, t5_bucket, tile_info,
                       tile_visible, token_masks, visible)
from ._relative import add_to_rows, dot_value_rows, rows_of, rows_weighted_by_cells


# ---- the gradient of each scheme's bias: one function per scheme -------------------------------

@triton.jit
def alibi_slope_grad(ds, rel):
    """ALiBi: d(sum s)/d m_h = -sum dS |rel|, per row of the tile."""
    return tl.sum(ds * alibi_bias(rel, 1.0), 1)


@triton.jit
def t5_table_grad(ds, rel, vis, DTable, Buckets, max_distance):
    """T5: adds dS of every visible cell to its bucket in this program's row of DTable."""
    tl.atomic_add(DTable + t5_bucket(rel, Buckets, max_distance), ds, mask=vis)


@triton.jit
def probabilities(s, t, vis, lse, dp, delta, HAS_SOFTCAP: tl.constexpr):
    """(P, dS) of a tile: P = exp(s - lse) on visible cells, 0 elsewhere (rows without a visible
    key have lse = -inf); dS = P (dP - D), times 1 - t^2 under a soft-cap (t = tanh of the
    uncapped score over the cap)."""
    p = tl.where(vis, tl.exp(s - tl.where(lse == float("-inf"), 0.0, lse)[:, None]), 0.0)
    ds = p * (dp - delta[:, None])
    if HAS_SOFTCAP:
        ds = ds * (1.0 - t * t)
    return p, ds


@triton.jit
def attention_backward_kv_kernel(
        Q, K, V, DO, Lse, Delta, DK, DV, QTiles,
        q_stride_b, q_stride_l, q_stride_h, k_stride_b, k_stride_l, k_stride_h,
        v_stride_b, v_stride_l, v_stride_h, do_stride_b, do_stride_l, do_stride_h,
        dk_stride_b, dk_stride_l, dk_stride_h, dv_stride_b, dv_stride_l, dv_stride_h,
        heads_q, heads_kv,
        QPos, KPos, qpos_stride_b, kpos_stride_b, Sinks, Table, table_stride_u, table_stride_h,
        Buckets, max_distance, QCos, QSin, KCos, KSin, qcos_stride_b, kcos_stride_b,
        seq_q, seq_k, group, head_dim, v_dim, scale, softcap, window, chunk,
        QDoc, KDoc, QOpen, KOpen, Dense, dense_stride_b,
        RelQ, relq_stride_r, relq_stride_h, RelQIdx, relq_lo, relq_n,
        RelK, relk_stride_r, relk_stride_h, RelKIdx, relk_lo, relk_n,
        RelV, relv_stride_r, relv_stride_h, RelVIdx, relv_lo, relv_n, QBias, QRelBias,
        DRelK, DRelV,
        SCHEME: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
        HAS_CHUNK: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
        ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_DOCS: tl.constexpr,
        HAS_OPEN: tl.constexpr, HAS_DENSE: tl.constexpr, REL_Q: tl.constexpr,
        REL_K: tl.constexpr, REL_V: tl.constexpr, Q_BIAS: tl.constexpr,
        NEED_DTABLE: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
        EMULATE_BF16: tl.constexpr):
    """dk and dv of BLOCK_N keys of one (batch row, kv head); grid (key blocks,
    batch * heads_kv). With RoPE, dk is the gradient of the rotated k (DK float32). With
    NEED_DTABLE, the key side table's (DRelK) and the value table's (DRelV) gradients of these
    keys' cells are added to those buffers."""
    b = (tl.program_id(1) // heads_kv).to(tl.int64)  # 64-bit offsets for large tensors
    kv_head = tl.program_id(1) % heads_kv
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < seq_k
    dims = tl.arange(0, BLOCK_D)
    vdims = tl.arange(0, BLOCK_DV)
    kpos = tl.load(KPos + b * kpos_stride_b + cols, mask=col_ok, other=0)
    kdoc, kopen = token_masks(KDoc + b * seq_k, KOpen + b * seq_k, cols, col_ok, HAS_DOCS,
                              HAS_OPEN)
    klo, khi, kdlo, kdhi, kany = block_info(kpos, kdoc, kopen, col_ok)
    k = load_rotated(K + b * k_stride_b + kv_head * k_stride_h, cols, cols * k_stride_l, col_ok,
                     dims, head_dim, KCos + b * kcos_stride_b, KSin + b * kcos_stride_b,
                     ROTARY, INTERLEAVED, False)
    v = load_tile(V + b * v_stride_b + kv_head * v_stride_h, cols * v_stride_l, col_ok, vdims,
                  vdims < v_dim)
    dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_DV), tl.float32)
    q_tiles = tl.cdiv(seq_q, BLOCK_M)
    q_info = QTiles + b * q_tiles * 5
    for g in range(0, group):
        head = kv_head * group + g
        slope = head_slope(Table, head, table_stride_h, SCHEME)
        row_base = (b * heads_q + head) * seq_q
        for tile in range(0, q_tiles):
            qlo, qhi, qdlo, qdhi, qany = tile_info(q_info, tile)
            if tile_visible(qlo, qhi, qdlo, qdhi, qany, klo, khi, kdlo, kdhi, kany, window,
                            chunk, CAUSAL, HAS_WINDOW, HAS_CHUNK, HAS_DOCS, HAS_OPEN):
                rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
                row_ok = rows < seq_q
                qpos = tl.load(QPos + b * qpos_stride_b + rows, mask=row_ok, other=0)
                qdoc, qopen = token_masks(QDoc + b * seq_q, QOpen + b * seq_q, rows, row_ok,
                                          HAS_DOCS, HAS_OPEN)
                q = load_rotated(Q + b * q_stride_b + head * q_stride_h, rows,
                                 rows * q_stride_l, row_ok, dims, head_dim,
                                 QCos + b * qcos_stride_b, QSin + b * qcos_stride_b, ROTARY,
                                 INTERLEAVED, False)
                qc, qr = biased_queries(q, QBias, QRelBias, head, dims, head_dim, Q_BIAS)
                do = load_tile(DO + b * do_stride_b + head * do_stride_h, rows * do_stride_l,
                               row_ok, vdims, vdims < v_dim)
                lse = tl.load(Lse + row_base + rows, mask=row_ok, other=0.0)
                delta = tl.load(Delta + row_base + rows, mask=row_ok, other=0.0)
                vis = visible(qpos, kpos, row_ok, col_ok, window, chunk, qdoc, kdoc, qopen,
                              kopen, Dense + b * dense_stride_b, rows, cols, seq_k, CAUSAL,
                              HAS_WINDOW, HAS_CHUNK, HAS_DOCS, HAS_OPEN, HAS_DENSE)
                s, t = scores(qc, qr, k, qpos, kpos, vis, head, slope, scale, softcap, Table,
                              table_stride_u, table_stride_h, Buckets, max_distance, RelQ,
                              relq_stride_r, relq_stride_h, RelQIdx, relq_lo, relq_n, RelK,
                              relk_stride_r, relk_stride_h, RelKIdx, relk_lo, relk_n, dims,
                              head_dim, SCHEME, REL_Q, REL_K, HAS_SOFTCAP, EMULATE_BF16)
                dp = dot(do, tl.trans(v), tl.zeros((BLOCK_M, BLOCK_N), tl.float32), EMULATE_BF16)
                rel = kpos[None, :] - qpos[:, None]
                if REL_V:
                    rows_v = rows_of(rel, RelVIdx, relv_lo, relv_n)
                    dp += dot_value_rows(do.to(tl.float32), rows_v, RelV, relv_stride_r,
                                         relv_stride_h, head, vdims, v_dim)
                p, ds = probabilities(s, t, vis, lse, dp, delta, HAS_SOFTCAP)
                dv = dot(tl.trans(p), do, dv, EMULATE_BF16)
                dk = dot(tl.trans(ds), qc, dk, EMULATE_BF16)
                if REL_K:
                    rows_k = rows_of(rel, RelKIdx, relk_lo, relk_n)
                    dk += rows_weighted_by_cells(ds, rows_k, RelK, relk_stride_r, relk_stride_h,
                                                 head, dims, head_dim, 0)
                    if NEED_DTABLE:
                        add_to_rows(DRelK, relk_stride_r, relk_stride_h, head, rows_k,
                                    ds * scale, k.to(tl.float32), dims, head_dim, vis, False)
                if REL_V and NEED_DTABLE:
                    add_to_rows(DRelV, relv_stride_r, relv_stride_h, head, rows_v, p,
                                do.to(tl.float32), vdims, v_dim, vis, True)

    dk_ptr = DK + b * dk_stride_b + kv_head * dk_stride_h + cols[:, None] * dk_stride_l
    tl.store(dk_ptr + dims[None, :], rounded(dk * scale, DK.dtype.element_ty, EMULATE_BF16),
             mask=col_ok[:, None] & (dims < head_dim)[None, :])
    dv_ptr = DV + b * dv_stride_b + kv_head * dv_stride_h + cols[:, None] * dv_stride_l
    tl.store(dv_ptr + vdims[None, :], rounded(dv, DV.dtype.element_ty, EMULATE_BF16),
             mask=col_ok[:, None] & (vdims < v_dim)[None, :])


@triton.jit
def attention_backward_q_kernel(
        Q, K, V, DO, Lse, Delta, DQ, DTable, KTiles,
        q_stride_b, q_stride_l, q_stride_h, k_stride_b, k_stride_l, k_stride_h,
        v_stride_b, v_stride_l, v_stride_h, do_stride_b, do_stride_l, do_stride_h,
        dq_stride_b, dq_stride_l, dq_stride_h, heads_q, dtable_stride,
        QPos, KPos, qpos_stride_b, kpos_stride_b, Sinks, Table, table_stride_u, table_stride_h,
        Buckets, max_distance, QCos, QSin, KCos, KSin, qcos_stride_b, kcos_stride_b,
        seq_q, seq_k, group, head_dim, v_dim, scale, softcap, window, chunk,
        QDoc, KDoc, QOpen, KOpen, Dense, dense_stride_b,
        RelQ, relq_stride_r, relq_stride_h, RelQIdx, relq_lo, relq_n,
        RelK, relk_stride_r, relk_stride_h, RelKIdx, relk_lo, relk_n,
        RelV, relv_stride_r, relv_stride_h, RelVIdx, relv_lo, relv_n, QBias, QRelBias,
        DRelQ, DBias,
        SCHEME: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
        HAS_CHUNK: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
        ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_DOCS: tl.constexpr,
        HAS_OPEN: tl.constexpr, HAS_DENSE: tl.constexpr, REL_Q: tl.constexpr,
        REL_K: tl.constexpr, REL_V: tl.constexpr, Q_BIAS: tl.constexpr,
        NEED_DTABLE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """dq of BLOCK_M query rows of one (batch row, query head), and with NEED_DTABLE the partial
    bias gradient of those rows in DTable's row of this program (row stride dtable_stride), the
    query side table's gradient of these rows' cells added to DRelQ, and with Q_BIAS
    (Transformer-XL) the sums over these rows of the gradients of q + r_w_bias and q + r_r_bias
    in this program's row [2, head_dim] of DBias; grid (query blocks, batch * heads_q). With
    RoPE, dq is the gradient of the rotated q."""
    b = (tl.program_id(1) // heads_q).to(tl.int64)  # 64-bit offsets for large tensors
    head = tl.program_id(1) % heads_q
    kv_head = head // group
    program = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < seq_q
    dims = tl.arange(0, BLOCK_D)
    vdims = tl.arange(0, BLOCK_DV)
    qpos = tl.load(QPos + b * qpos_stride_b + rows, mask=row_ok, other=0)
    qdoc, qopen = token_masks(QDoc + b * seq_q, QOpen + b * seq_q, rows, row_ok, HAS_DOCS,
                              HAS_OPEN)
    qlo, qhi, qdlo, qdhi, qany = block_info(qpos, qdoc, qopen, row_ok)
    q = load_rotated(Q + b * q_stride_b + head * q_stride_h, rows, rows * q_stride_l, row_ok, dims,
                     head_dim, QCos + b * qcos_stride_b, QSin + b * qcos_stride_b,
                     ROTARY, INTERLEAVED, False)
    qc, qr = biased_queries(q, QBias, QRelBias, head, dims, head_dim, Q_BIAS)
    do = load_tile(DO + b * do_stride_b + head * do_stride_h, rows * do_stride_l, row_ok, vdims,
                   vdims < v_dim)
    row_base = (b * heads_q + head) * seq_q
    lse = tl.load(Lse + row_base + rows, mask=row_ok, other=0.0)
    delta = tl.load(Delta + row_base + rows, mask=row_ok, other=0.0)
    slope = head_slope(Table, head, table_stride_h, SCHEME)
    k_base = K + b * k_stride_b + kv_head * k_stride_h
    v_base = V + b * v_stride_b + kv_head * v_stride_h
    dtable = DTable + program * dtable_stride
    k_tiles = tl.cdiv(seq_k, BLOCK_N)
    k_info = KTiles + b * k_tiles * 5

    dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    dqr = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)  # the query side table term's part
    dslope = tl.zeros((BLOCK_M,), tl.float32)
    for tile in range(0, k_tiles):
        klo, khi, kdlo, kdhi, kany = tile_info(k_info, tile)
        if tile_visible(qlo, qhi, qdlo, qdhi, qany, klo, khi, kdlo, kdhi, kany, window, chunk,
                        CAUSAL, HAS_WINDOW, HAS_CHUNK, HAS_DOCS, HAS_OPEN):
            cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            col_ok = cols < seq_k
            kpos = tl.load(KPos + b * kpos_stride_b + cols, mask=col_ok, other=0)
            kdoc, kopen = token_masks(KDoc + b * seq_k, KOpen + b * seq_k, cols, col_ok,
                                      HAS_DOCS, HAS_OPEN)
            k = load_rotated(k_base, cols, cols * k_stride_l, col_ok, dims, head_dim,
                             KCos + b * kcos_stride_b, KSin + b * kcos_stride_b,
                             ROTARY, INTERLEAVED, False)
            v = load_tile(v_base, cols * v_stride_l, col_ok, vdims, vdims < v_dim)
            vis = visible(qpos, kpos, row_ok, col_ok, window, chunk, qdoc, kdoc, qopen, kopen,
                          Dense + b * dense_stride_b, rows, cols, seq_k, CAUSAL, HAS_WINDOW,
                          HAS_CHUNK, HAS_DOCS, HAS_OPEN, HAS_DENSE)
            s, t = scores(qc, qr, k, qpos, kpos, vis, head, slope, scale, softcap, Table,
                          table_stride_u, table_stride_h, Buckets, max_distance, RelQ,
                          relq_stride_r, relq_stride_h, RelQIdx, relq_lo, relq_n, RelK,
                          relk_stride_r, relk_stride_h, RelKIdx, relk_lo, relk_n, dims, head_dim,
                          SCHEME, REL_Q, REL_K, HAS_SOFTCAP, EMULATE_BF16)
            dp = dot(do, tl.trans(v), tl.zeros((BLOCK_M, BLOCK_N), tl.float32), EMULATE_BF16)
            rel = kpos[None, :] - qpos[:, None]
            if REL_V:
                dp += dot_value_rows(do.to(tl.float32), rows_of(rel, RelVIdx, relv_lo, relv_n),
                                     RelV, relv_stride_r, relv_stride_h, head, vdims, v_dim)
            _, ds = probabilities(s, t, vis, lse, dp, delta, HAS_SOFTCAP)
            dq = dot(ds, k, dq, EMULATE_BF16)
            if REL_Q:
                rows_q = rows_of(rel, RelQIdx, relq_lo, relq_n)
                dqr += rows_weighted_by_cells(ds, rows_q, RelQ, relq_stride_r, relq_stride_h,
                                              head, dims, head_dim, 1)
                if NEED_DTABLE:
                    add_to_rows(DRelQ, relq_stride_r, relq_stride_h, head, rows_q, ds * scale,
                                qr.to(tl.float32), dims, head_dim, vis, True)
            if NEED_DTABLE:
                if SCHEME == ALIBI:
                    dslope += alibi_slope_grad(ds, rel)
                if SCHEME == T5:
                    t5_table_grad(ds, rel, vis, dtable, Buckets, max_distance)

    if NEED_DTABLE and Q_BIAS:  # d r_w_bias and d r_r_bias: the two parts of dq, summed
        bias = DBias + program * 2 * head_dim + dims
        tl.store(bias, tl.sum(dq, 0) * scale, mask=dims < head_dim)
        tl.store(bias + head_dim, tl.sum(dqr, 0) * scale, mask=dims < head_dim)
    dq += dqr
    dq_ptr = DQ + b * dq_stride_b + head * dq_stride_h + rows[:, None] * dq_stride_l
    tl.store(dq_ptr + dims[None, :], rounded(dq * scale, DQ.dtype.element_ty, EMULATE_BF16),
             mask=row_ok[:, None] & (dims < head_dim)[None, :])
    if NEED_DTABLE and SCHEME == ALIBI:
        tl.store(dtable, tl.sum(dslope, 0))


@triton.jit
def rope_back_kernel(X, Y, x_stride_b, x_stride_l, x_stride_h, y_stride_b, y_stride_l,
                     y_stride_h, heads, seq, head_dim, Cos, Sin, cos_stride_b,
                     ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_L: tl.constexpr,
                     BLOCK_D: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """Y = the gradient X of rotated rows mapped back through the rotation (its transpose:
    rotation by minus the angle, attention factor included), rounded to Y's dtype; grid
    (row blocks, batch * heads)."""
    b = (tl.program_id(1) // heads).to(tl.int64)  # 64-bit offsets for large tensors
    head = tl.program_id(1) % heads
    rows = tl.program_id(0) * BLOCK_L + tl.arange(0, BLOCK_L)
    row_ok = rows < seq
    dims = tl.arange(0, BLOCK_D)
    x = load_rotated(X + b * x_stride_b + head * x_stride_h, rows, rows * x_stride_l, row_ok, dims,
                     head_dim, Cos + b * cos_stride_b, Sin + b * cos_stride_b, ROTARY,
                     INTERLEAVED, True)
    y_ptr = Y + b * y_stride_b + head * y_stride_h + rows[:, None] * y_stride_l + dims[None, :]
    tl.store(y_ptr, rounded(x, Y.dtype.element_ty, EMULATE_BF16),
             mask=row_ok[:, None] & (dims < head_dim)[None, :])


def _rope_back(x, like, tables, plan, block=64):
    """The unrotated gradient, of like's dtype and shape, from the float32 gradient x of the
    rotated rows; tables: the (cos, sin) of those rows' positions."""
    y = torch.empty_like(like)
    cos, sin = tables
    grid = (triton.cdiv(x.shape[1], block), x.shape[0] * x.shape[2])
    rope_back_kernel[grid](x, y, *x.stride()[:3], *y.stride()[:3], x.shape[2], x.shape[1],
                           plan.head_dim, cos, sin, cos.stride(0) if cos.shape[0] > 1 else 0,
                           ROTARY=plan.rotary_dim, INTERLEAVED=plan.interleaved,
                           BLOCK_L=block, BLOCK_D=max(16, triton.next_power_of_2(plan.head_dim)),
                           EMULATE_BF16=EMULATE_BF16)
    return y


def _table_buffer(term):
    """A zeroed float32 buffer of a term's table shape (its gradient), or the term absent: None."""
    return None if term is None else torch.zeros_like(term.table)


def backward(q, k, v, out, lse, dout, dlse, plan, needs):
    """Gradients of the attention. out: the forward's output (float32 for half inputs), lse
    float32 [batch, heads_q, seq_q], dout of out's shape, dlse (the gradient of lse) or None. needs:
    (dq, dk, dv, dsinks, dtables) flags. Returns (dq, dk, dv, dsinks, dtables), None where not
    needed; dtables maps each learned table of the scheme to its gradient, float64: ALiBi's
    slopes [heads_q], T5's relative_attention_bias [buckets, heads_q], Shaw's rel_k and rel_v
    (in their given layout), XL's r_w_bias, r_r_bias and r_net, DeBERTa's pos_key and pos_query."""
    need_dq, need_dk, need_dv, need_dsinks, need_dtable = needs
    rope = plan.rotary_dim > 0
    relative = plan.rel_q is not None
    delta = (dout.float() * out.float()).sum(-1).transpose(1, 2).contiguous()
    if dlse is not None:
        delta = delta - dlse.float()
    args = plan.kernel_args()
    dq = dk = dv = dsinks = dtables = None
    d = plan.dummy
    drel_q, drel_k, drel_v = (_table_buffer(t) if need_dtable else None
                              for t in (plan.rel_q, plan.rel_k, plan.rel_v))

    if need_dk or need_dv or need_dtable and (drel_k is not None or drel_v is not None):
        dk = torch.empty(k.shape, dtype=torch.float32 if rope else k.dtype, device=k.device)
        dv = torch.empty_like(v)
        block_m, block_n, warps = plan.tiles("backward_kv")
        q_tiles = plan.tile_info(plan.query_pos, plan.query_docs, plan.query_open, block_m)
        grid = (triton.cdiv(plan.seq_k, block_n), plan.batch * plan.heads_kv)
        attention_backward_kv_kernel[grid](
            q, k, v, dout, lse, delta, dk, dv, q_tiles, *q.stride()[:3], *k.stride()[:3],
            *v.stride()[:3], *dout.stride()[:3], *dk.stride()[:3], *dv.stride()[:3],
            plan.heads_q, plan.heads_kv, **args, DRelK=_or(drel_k, d), DRelV=_or(drel_v, d),
            NEED_DTABLE=need_dtable and relative, BLOCK_M=block_m, BLOCK_N=block_n,
            EMULATE_BF16=EMULATE_BF16, num_warps=warps)
        if rope:
            dk = _rope_back(dk, k, plan.rope_k, plan)

    need_bias = need_dtable and plan.q_bias is not None
    if need_dq or need_dtable:
        dq = torch.empty(q.shape, dtype=torch.float32 if rope else q.dtype, device=q.device)
        block_m, block_n, warps = plan.tiles("backward_q")
        q_blocks = triton.cdiv(plan.seq_q, block_m)
        programs = plan.batch * plan.heads_q * q_blocks
        width = plan.table.shape[0] if plan.scheme == _prepare.T5 else 1
        need_partial = need_dtable and plan.scheme in (_prepare.ALIBI, _prepare.T5)
        partial = torch.zeros((programs, width) if need_partial else (1,), dtype=torch.float32,
                              device=q.device)
        bias = torch.zeros((programs, 2, plan.head_dim) if need_bias else (1,),
                           dtype=torch.float32, device=q.device)
        k_tiles = plan.tile_info(plan.key_pos, plan.key_docs, plan.key_open, block_n)
        grid = (q_blocks, plan.batch * plan.heads_q)
        attention_backward_q_kernel[grid](
            q, k, v, dout, lse, delta, dq, partial, k_tiles, *q.stride()[:3], *k.stride()[:3],
            *v.stride()[:3], *dout.stride()[:3], *dq.stride()[:3], plan.heads_q, width,
            **args, DRelQ=_or(drel_q, d), DBias=bias, NEED_DTABLE=need_dtable,
            BLOCK_M=block_m, BLOCK_N=block_n, EMULATE_BF16=EMULATE_BF16, num_warps=warps)
        if rope:
            dq = _rope_back(dq, q, plan.rope_q, plan)
        if need_partial:
            sums = partial.view(plan.batch, plan.heads_q, q_blocks, width).double().sum((0, 2))
            dtables = {"slopes": sums[:, 0]} if plan.scheme == _prepare.ALIBI else {
                "relative_attention_bias": sums.t()}

    if need_dtable and relative:
        dtables = {}
        if plan.q_bias is not None:  # Transformer-XL: r = R W_r^T, u and v
            sums = bias.view(plan.batch, plan.heads_q, -1, 2, plan.head_dim).double().sum((0, 2))
            dtables["r_w_bias"], dtables["r_r_bias"] = sums[:, 0], sums[:, 1]
            rows = drel_q.shape[0]
            dtables["r_net"] = drel_q.double().view(rows, -1).t() @ plan.xl_sinusoid
        for term, grad in ((plan.rel_q, drel_q), (plan.rel_k, drel_k), (plan.rel_v, drel_v)):
            if term is not None and term.name is not None:
                dtables[term.name] = grad.double()

    if need_dsinks:
        p_sink = torch.exp(plan.sinks.double()[None, :, None] - lse.double())
        dsinks = -(p_sink * delta.double()).sum((0, 2))
    return dq, dk, dv, dsinks, dtables


def _or(t, default):
    return default if t is None else t
