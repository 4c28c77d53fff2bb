"""Triton kernels of the attention forward, and the tile functions the backward shares.

One program computes one block of BLOCK_M query rows of one (batch row, query head) and walks the
keys in tiles of BLOCK_N with an online softmax (a running maximum m and sum l per row), so no
[seq_q, seq_k] matrix is formed. For every tile the score is

    s = scale * (q . k + terms) + bias(rel)   rel = pos_k - pos_q; RoPE rotates q and k on load;
                                              terms: the relative tables' (_relative.py)
    s = softcap * tanh(s / softcap)        (when softcap is set)
    s = -inf where a mask hides the key    (causal, window, chunk, block masks)

and key tiles that the masks hide entirely (known from each tile's smallest and largest key position
and document id, and whether it holds an open key) are skipped without being loaded. Attention sinks
start each row's running sum with the sink's own term, exp(sink - m) with m = sink, so the sink is
one more softmax entry with a zero value. A row that sees no key gets out = 0 and lse = -inf (lse =
sink with sinks).

Arithmetic is float32: q, k and v tiles are loaded in their dtype and widened exactly (RoPE
rotates the widened rows with float32 cos and sin of angles computed in float64), the output is
rounded once to its dtype. See ``dot`` for how half-precision operands reach tl.dot.
"""

import torch
import triton
import triton.language as tl

import posenc

from ._relative import query_term, key_term, rows_of, value_term

# The SCHEME constexpr of the schemes with a bias, as _prepare numbers them (0 none, 1 RoPE).
ALIBI: tl.constexpr = tl.constexpr(2)
T5: tl.constexpr = tl.constexpr(3)

# Under Triton's interpreter (TRITON_INTERPRET=1, kernels run through NumPy on CPU tensors) every
# kernel here is an interpreted function, and the interpreter gets two bfloat16 operations wrong:
# tl.dot on bf16 operands, and the float32 -> bf16 conversion, which truncates where a GPU rounds
# to nearest even. EMULATE_BF16 widens bf16 tiles to float32 before tl.dot and rounds to bf16 in
# integer arithmetic; on a GPU it is off (bf16 tiles go to the tensor cores as they are). It
# follows the setting Triton's @jit read when this module was loaded.
INTERPRETED = bool(triton.knobs.runtime.interpret)
EMULATE_BF16 = INTERPRETED


@triton.jit
def rounded(x, dtype: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """float32 x rounded to dtype, to nearest even."""
    if EMULATE_BF16 and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        y = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        y = x.to(dtype)
    return y


@triton.jit
def _half_dot(a, b, acc, EMULATE_BF16: tl.constexpr):
    """acc + a @ b for operands of one half dtype (exact products, float32 sums)."""
    if EMULATE_BF16 and a.dtype == tl.bfloat16:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def dot(a, b, acc, EMULATE_BF16: tl.constexpr):
    """acc + a @ b, float32 accumulation, for a float32 or of b's dtype.

    Two float32 operands take the exact float32 dot ("ieee", not TF32). Two half operands take
    the half dot. A float32 a (probabilities, score gradients) with a half b is split into two
    halves, a = hi + lo, and takes two half dots: 16 significant bits of a (22 with float16)
    where rounding a to b's dtype would keep 8 (11), so the half paths keep float32 accuracy
    while staying on half-precision tensor cores.
    """
    if a.dtype == tl.float32 and b.dtype == tl.float32:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    elif a.dtype == tl.float32:
        hi = rounded(a, b.dtype, EMULATE_BF16)
        lo = rounded(a - hi.to(tl.float32), b.dtype, EMULATE_BF16)
        acc = _half_dot(lo, b, _half_dot(hi, b, acc, EMULATE_BF16), EMULATE_BF16)
    else:
        acc = _half_dot(a, b, acc, EMULATE_BF16)
    return acc


@triton.jit
def _tanh(x):
    """tanh in float32 to a few ulps: an odd Taylor polynomial for |x| < 0.3, else
    (1 - e) / (1 + e) with e = exp(-2|x|), which neither cancels badly nor overflows there."""
    a = tl.abs(x)
    x2 = x * x
    poly = 1.0 + x2 * (-1.0 / 3 + x2 * (2.0 / 15 + x2 * (-17.0 / 315 + x2 * (
        62.0 / 2835 + x2 * (-1382.0 / 155925)))))
    e = tl.exp(-2.0 * a)
    t = tl.where(a < 0.3, a * poly, (1.0 - e) / (1.0 + e))
    return tl.where(x < 0, -t, t)


@triton.jit
def load_tile(base, offs, row_ok, cols, col_ok):
    """Rows of a [seq, dim] slice with unit dim stride, in its dtype; 0 outside the masks.
    offs: each row's offset from base, in elements (rows * the row stride, or a paged cache's
    page and slot)."""
    return tl.load(base + offs[:, None] + cols[None, :],
                   mask=row_ok[:, None] & col_ok[None, :], other=0.0)


@triton.jit
def rotary_pairs(cols, ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr):
    """RoPE's pairing of dims `cols`: (the pair's index in the cos / sin tables, the partner dim,
    whether the dim is the pair's first, whether it is rotated at all: dims < ROTARY). Pairs
    (i, i + R/2) in the half style, (2i, 2i + 1) interleaved."""
    if INTERLEAVED:
        pair = cols // 2
        partner = cols ^ 1
        first = cols % 2 == 0
    else:
        pair = cols % (ROTARY // 2)
        partner = tl.where(cols < ROTARY // 2, cols + ROTARY // 2, cols - ROTARY // 2)
        first = cols < ROTARY // 2
    return pair, partner, first, cols < ROTARY


@triton.jit
def load_rotated(base, rows, offs, row_ok, cols, dim, Cos, Sin,
                 ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr, INVERSE: tl.constexpr):
    """Rows of q or k as load_tile loads them (rows: their token indices, which index the
    tables; offs: their offsets in memory); with RoPE (ROTARY = rotary dim > 0) widened to
    float32 and rotated by each row's angles: pairs (i, i + R/2) (half style) or (2i, 2i + 1)
    (interleaved), dims >= R unchanged. Cos, Sin: this batch row's per-token tables
    [seq, R/2], attention factor included. INVERSE rotates by minus the angles (the transpose,
    which maps a gradient back to the unrotated input)."""
    col_ok = cols < dim
    x = load_tile(base, offs, row_ok, cols, col_ok)
    if ROTARY > 0:
        pair, partner, first, rotated = rotary_pairs(cols, ROTARY, INTERLEAVED)
        other = load_tile(base, offs, row_ok, partner, rotated).to(tl.float32)
        table = rows[:, None] * (ROTARY // 2) + pair[None, :]
        inside = row_ok[:, None] & rotated[None, :]
        c = tl.load(Cos + table, mask=inside, other=1.0)
        s = tl.load(Sin + table, mask=inside, other=0.0)
        sign = tl.where(first, -1.0, 1.0)
        if INVERSE:
            sign = -sign
        x = x.to(tl.float32)
        x = tl.where(rotated[None, :], x * c + sign[None, :] * other * s, x)
    return x


@triton.jit
def token_masks(Doc, Open, tokens, ok, HAS_DOCS: tl.constexpr, HAS_OPEN: tl.constexpr):
    """The document id and the open flag (global or prefix token) of tokens of one batch row
    (Doc, Open: that row's int32 tables); 0 where a table is absent or a token invalid."""
    doc = tokens * 0
    opn = tokens * 0
    if HAS_DOCS:
        doc = tl.load(Doc + tokens, mask=ok, other=0)
    if HAS_OPEN:
        opn = tl.load(Open + tokens, mask=ok, other=0)
    return doc, opn


@triton.jit
def block_info(pos, doc, opn, ok):
    """(smallest position, largest position, smallest document, largest document, any open
    token) of a block's valid tokens, as a tile's row of the host's tile tables."""
    lo, hi = block_range(pos, ok)
    dlo, dhi = block_range(doc.to(tl.int64), ok)
    return lo, hi, dlo, dhi, tl.max(tl.where(ok, opn, 0)).to(tl.int64)


@triton.jit
def tile_info(Tiles, tile):
    """A tile's row of the host's tile table (Plan.tile_info): positions, documents, open."""
    return (tl.load(Tiles + tile * 5), tl.load(Tiles + tile * 5 + 1),
            tl.load(Tiles + tile * 5 + 2), tl.load(Tiles + tile * 5 + 3),
            tl.load(Tiles + tile * 5 + 4))


@triton.jit
def tile_visible(qlo, qhi, qdlo, qdhi, qopen, klo, khi, kdlo, kdhi, kopen, window, chunk,
                 CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_CHUNK: tl.constexpr,
                 HAS_DOCS: tl.constexpr, HAS_OPEN: tl.constexpr):
    """Whether the masks can leave any key of a tile (positions [klo, khi], documents [kdlo,
    kdhi], kopen > 0 when it holds an open key) visible to any query of a block (likewise);
    False means the tile can be skipped: its documents and the block's are disjoint, or
    causal / window / chunk hide it and neither side holds an open token."""
    rule = klo <= khi
    if CAUSAL:
        rule = rule & (klo <= qhi)
    if HAS_WINDOW:
        rule = rule & (klo - qhi < window) & (qlo - khi < window)
    if HAS_CHUNK:
        rule = rule & (klo // chunk <= qhi // chunk) & (khi // chunk >= qlo // chunk)
    if HAS_OPEN:
        rule = rule | (qopen + kopen > 0)
    ok = rule
    if HAS_DOCS:
        ok = ok & (kdlo <= qdhi) & (kdhi >= qdlo)
    return ok


@triton.jit
def visible(qpos, kpos, row_ok, col_ok, window, chunk, qdoc, kdoc, qopen, kopen, DenseRow,
            rows, cols, seq_k, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
            HAS_CHUNK: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_OPEN: tl.constexpr,
            HAS_DENSE: tl.constexpr):
    """The [rows, keys] mask: True where key j is visible to query i, posenc's rule
    same document & dense & (open query | open key | causal, window and chunk)."""
    rel = kpos[None, :] - qpos[:, None]
    ok = row_ok[:, None] & col_ok[None, :]
    rule = ok
    if CAUSAL:
        rule = rule & (rel <= 0)
    if HAS_WINDOW:
        rule = rule & (rel < window) & (rel > -window)
    if HAS_CHUNK:
        rule = rule & ((kpos // chunk)[None, :] == (qpos // chunk)[:, None])
    if HAS_OPEN:
        rule = rule | (ok & ((qopen[:, None] + kopen[None, :]) > 0))
    if HAS_DOCS:
        rule = rule & (qdoc[:, None] == kdoc[None, :])
    if HAS_DENSE:
        dense = tl.load(DenseRow + rows[:, None].to(tl.int64) * seq_k + cols[None, :], mask=ok,
                        other=0)
        rule = rule & (dense != 0)
    return rule


# ---- the bias of each scheme: one function per scheme ------------------------------------------

@triton.jit
def alibi_bias(rel, slope):
    """ALiBi: -m_h |pos_q - pos_k|."""
    return -slope * tl.abs(rel).to(tl.float32)


@triton.jit
def t5_bucket(rel, Buckets, max_distance):
    """T5's bucket of rel, read from the host's table of the distances [-max_distance,
    max_distance] (buckets saturate beyond them)."""
    return tl.load(Buckets + tl.minimum(tl.maximum(rel, -max_distance), max_distance)
                   + max_distance)


@triton.jit
def t5_bias(rel, head, Table, table_stride_u, table_stride_h, Buckets, max_distance):
    """T5: relative_attention_bias[bucket(rel), h]."""
    bucket = t5_bucket(rel, Buckets, max_distance)
    return tl.load(Table + bucket * table_stride_u + head * table_stride_h)


@triton.jit
def scores(qc, qr, k, qpos, kpos, vis, head, slope, scale, softcap, Table, table_stride_u,
           table_stride_h, Buckets, max_distance, RelQ, relq_stride_r, relq_stride_h, RelQIdx,
           relq_lo, relq_n, RelK, relk_stride_r, relk_stride_h, RelKIdx, relk_lo, relk_n, dims,
           head_dim, SCHEME: tl.constexpr, REL_Q: tl.constexpr, REL_K: tl.constexpr,
           HAS_SOFTCAP: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """The scores of a [rows, keys] tile in the score order: scale * (qc . k + the relative
    tables' terms), then the scheme's bias, then the soft-cap, then -inf where vis is False.
    qc: the content query rows (q, or q + r_w_bias for Transformer-XL), qr: those of the query
    side table term (q, or q + r_r_bias). Returns (s, t) with t = tanh(s / softcap) before the
    mask (the backward's 1 - t^2), or t = s without a cap."""
    s = dot(qc, tl.trans(k), tl.zeros((qc.shape[0], k.shape[0]), tl.float32), EMULATE_BF16)
    rel = kpos[None, :] - qpos[:, None]
    if REL_Q:
        s += query_term(qr.to(tl.float32), rows_of(rel, RelQIdx, relq_lo, relq_n), RelQ,
                        relq_stride_r, relq_stride_h, head, dims, head_dim)
    if REL_K:
        s += key_term(k.to(tl.float32), rows_of(rel, RelKIdx, relk_lo, relk_n), RelK,
                      relk_stride_r, relk_stride_h, head, dims, head_dim)
    s = s * scale
    if SCHEME == ALIBI:
        s += alibi_bias(rel, slope)
    if SCHEME == T5:
        s += t5_bias(rel, head, Table, table_stride_u, table_stride_h, Buckets, max_distance)
    t = s
    if HAS_SOFTCAP:
        t = _tanh(s / softcap)
        s = softcap * t
    return tl.where(vis, s, float("-inf")), t


@triton.jit
def biased_queries(q, QBias, QRelBias, head, dims, head_dim, Q_BIAS: tl.constexpr):
    """(qc, qr): the query rows of the content score and of the query side table term; with
    Q_BIAS (Transformer-XL) q + r_w_bias[head] and q + r_r_bias[head] in float32, else q."""
    qc = q
    qr = q
    if Q_BIAS:
        u = tl.load(QBias + head * head_dim + dims, mask=dims < head_dim, other=0.0)
        w = tl.load(QRelBias + head * head_dim + dims, mask=dims < head_dim, other=0.0)
        qc = q.to(tl.float32) + u[None, :]
        qr = q.to(tl.float32) + w[None, :]
    return qc, qr


@triton.jit
def head_slope(Table, head, table_stride_h, SCHEME: tl.constexpr):
    """ALiBi's slope of a head (0 for other schemes)."""
    slope = 0.0
    if SCHEME == ALIBI:
        slope = tl.load(Table + head * table_stride_h)
    return slope


@triton.jit
def block_range(pos, ok):
    """The smallest and largest position of a block's valid rows."""
    return tl.min(tl.where(ok, pos, 1 << 62)), tl.max(tl.where(ok, pos, -1))


@triton.jit
def attention_forward_kernel(
        Q, K, V, Out, Lse, NonFinite, KTiles,
        q_stride_b, q_stride_l, q_stride_h, k_stride_b, k_stride_l, k_stride_h,
        v_stride_b, v_stride_l, v_stride_h, o_stride_b, o_stride_l, o_stride_h, heads_q,
        QPos, KPos, qpos_stride_b, kpos_stride_b, Sinks, Table, table_stride_u, table_stride_h,
        Buckets, max_distance, QCos, QSin, KCos, KSin, qcos_stride_b, kcos_stride_b,
        seq_q, seq_k, group, head_dim, v_dim, scale, softcap, window, chunk,
        QDoc, KDoc, QOpen, KOpen, Dense, dense_stride_b,
        RelQ, relq_stride_r, relq_stride_h, RelQIdx, relq_lo, relq_n,
        RelK, relk_stride_r, relk_stride_h, RelKIdx, relk_lo, relk_n,
        RelV, relv_stride_r, relv_stride_h, RelVIdx, relv_lo, relv_n, QBias, QRelBias,
        Pages, pages_stride_b, page_size, KLen, k_stride_p, v_stride_p,
        SCHEME: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
        HAS_CHUNK: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
        ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_DOCS: tl.constexpr,
        HAS_OPEN: tl.constexpr, HAS_DENSE: tl.constexpr, REL_Q: tl.constexpr,
        REL_K: tl.constexpr, REL_V: tl.constexpr, Q_BIAS: tl.constexpr, PAGED: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_DV: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """out and lse of BLOCK_M query rows of one (batch row, query head); grid
    (query blocks, batch * heads_q). NonFinite (int32 [1]) becomes 1 when an output element is
    not finite (a non-finite value: the host then names the input that holds one).

    PAGED: K and V are a paged cache's pages, read where they lie: key j of batch row b is slot
    j % page_size of page Pages[b, j // page_size] (k_stride_p, v_stride_p apart; k_stride_l,
    v_stride_l between slots), and row b has KLen[b] keys (tiles past them are not visited)."""
    b = (tl.program_id(1) // heads_q).to(tl.int64)  # 64-bit offsets for large tensors
    head = tl.program_id(1) % heads_q
    kv_head = head // group
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
    slope = head_slope(Table, head, table_stride_h, SCHEME)
    k_base = K + b * k_stride_b + kv_head * k_stride_h
    v_base = V + b * v_stride_b + kv_head * v_stride_h
    k_tiles = tl.cdiv(seq_k, BLOCK_N)
    k_info = KTiles + b * k_tiles * 5

    if HAS_SINKS:
        m = tl.zeros((BLOCK_M,), tl.float32) + tl.load(Sinks + head)
        l = tl.full((BLOCK_M,), 1.0, tl.float32)
    else:
        m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    k_len = seq_k
    row_tiles = k_tiles
    if PAGED:
        k_len = tl.load(KLen + b)
        row_tiles = tl.cdiv(k_len, BLOCK_N)
    for tile in range(0, row_tiles):
        klo, khi, kdlo, kdhi, kany = tile_info(k_info, tile)
        if tile_visible(qlo, qhi, qdlo, qdhi, qany, klo, khi, kdlo, kdhi, kany, window, chunk,
                        CAUSAL, HAS_WINDOW, HAS_CHUNK, HAS_DOCS, HAS_OPEN):
            cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            col_ok = cols < k_len
            kpos = tl.load(KPos + b * kpos_stride_b + cols, mask=col_ok, other=0)
            kdoc, kopen = token_masks(KDoc + b * seq_k, KOpen + b * seq_k, cols, col_ok,
                                      HAS_DOCS, HAS_OPEN)
            if PAGED:
                page = tl.load(Pages + b * pages_stride_b + cols // page_size, mask=col_ok,
                               other=0).to(tl.int64)
                slot = cols % page_size
                k_offs = page * k_stride_p + slot * k_stride_l
                v_offs = page * v_stride_p + slot * v_stride_l
            else:
                k_offs = cols * k_stride_l
                v_offs = cols * v_stride_l
            k = load_rotated(k_base, cols, k_offs, col_ok, dims, head_dim,
                             KCos + b * kcos_stride_b, KSin + b * kcos_stride_b,
                             ROTARY, INTERLEAVED, False)
            v = load_tile(v_base, v_offs, col_ok, vdims, vdims < v_dim)
            vis = visible(qpos, kpos, row_ok, col_ok, window, chunk, qdoc, kdoc, qopen, kopen,
                          Dense + b * dense_stride_b, rows, cols, seq_k, CAUSAL, HAS_WINDOW,
                          HAS_CHUNK, HAS_DOCS, HAS_OPEN, HAS_DENSE)
            s, _ = scores(qc, qr, k, qpos, kpos, vis, head, slope, scale, softcap, Table,
                          table_stride_u, table_stride_h, Buckets, max_distance, RelQ,
                          relq_stride_r, relq_stride_h, RelQIdx, relq_lo, relq_n, RelK,
                          relk_stride_r, relk_stride_h, RelKIdx, relk_lo, relk_n, dims, head_dim,
                          SCHEME, REL_Q, REL_K, HAS_SOFTCAP, EMULATE_BF16)
            m_new = tl.maximum(m, tl.max(s, 1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
            p = tl.exp(s - m_ref[:, None])
            alpha = tl.exp(m - m_ref)
            l = l * alpha + tl.sum(p, 1)
            acc = dot(p, v, acc * alpha[:, None], EMULATE_BF16)
            if REL_V:  # Shaw's rel_v: sum_j p_ij rel_v[row(rel_ij)]
                acc += value_term(p, rows_of(kpos[None, :] - qpos[:, None], RelVIdx, relv_lo,
                                             relv_n), RelV, relv_stride_r, relv_stride_h, head,
                                  vdims, v_dim)
            m = m_new

    seen = l > 0
    out = acc / tl.where(seen, l, 1.0)[:, None]
    lse = tl.where(seen, m + tl.log(tl.where(seen, l, 1.0)), float("-inf"))
    o_ptr = Out + b * o_stride_b + head * o_stride_h + rows[:, None] * o_stride_l + vdims[None, :]
    tl.store(o_ptr, rounded(out, Out.dtype.element_ty, EMULATE_BF16),
             mask=row_ok[:, None] & (vdims < v_dim)[None, :])
    tl.store(Lse + (b * heads_q + head) * seq_q + rows, lse, mask=row_ok)
    written = row_ok[:, None] & (vdims < v_dim)[None, :]
    bad = written & ((out != out) | (tl.abs(out) == float("inf")))
    tl.atomic_max(NonFinite, tl.max(tl.where(bad, 1, 0)))


def forward(q, k, v, plan, out, lse, pages=None):
    """Runs the forward kernel: out [batch, seq_q, heads_q, v_dim] (any float dtype; the
    result is rounded to it), lse float32 [batch, heads_q, seq_q] contiguous. plan.nonfinite:
    int32 [1], 1 when an output element is not finite.

    pages: a paged cache read in place, as (block_table int32 [batch, max_pages], key counts
    int32 [batch], page_size); k and v are then the pages, [num_pages, page_size, heads_kv, dim]
    (any strides with unit dim stride: head-major pages are their transposed view), and the
    plan's seq_k is the largest count."""
    block_m, block_n, warps = plan.tiles("forward")
    plan.nonfinite = torch.zeros(1, dtype=torch.int32, device=q.device)
    k_tiles = plan.tile_info(plan.key_pos, plan.key_docs, plan.key_open, block_n)
    grid = (triton.cdiv(plan.seq_q, block_m), plan.batch * plan.heads_q)
    if pages is None:
        paged = dict(Pages=plan.dummy, pages_stride_b=0, page_size=1, KLen=plan.dummy,
                     k_stride_p=0, v_stride_p=0, PAGED=False)
        k_strides, v_strides = k.stride()[:3], v.stride()[:3]
    else:
        table, counts, page_size = pages
        paged = dict(Pages=table, pages_stride_b=table.stride(0), page_size=page_size,
                     KLen=counts, k_stride_p=k.stride(0), v_stride_p=v.stride(0), PAGED=True)
        k_strides, v_strides = (0, *k.stride()[1:3]), (0, *v.stride()[1:3])
    attention_forward_kernel[grid](
        q, k, v, out, lse, plan.nonfinite, k_tiles, *q.stride()[:3], *k_strides, *v_strides,
        *out.stride()[:3], plan.heads_q, **plan.kernel_args(), **paged, BLOCK_M=block_m,
        BLOCK_N=block_n, EMULATE_BF16=EMULATE_BF16, num_warps=warps)


def check_result(lse, plan, inputs, allow_fully_masked, no_key_error=None):
    """posenc's errors for a forward's result, with one device synchronization: a non-finite
    input (InvalidValueError naming the first such element of the tensors `inputs`, [(name,
    tensor)], in order, as the CPU entry points do), then a query row that sees no key (the
    error no_key_error(lse, plan) makes, by default posenc.attention's). Skipped (no
    synchronization) with allow_fully_masked or sinks, where NaN and infinity propagate."""
    if allow_fully_masked or plan.sinks is not None:
        return
    nonfinite, no_key = torch.stack([
        (plan.nonfinite[0] > 0) | (torch.isnan(lse) | torch.isposinf(lse)).any(),
        torch.isneginf(lse).any()]).tolist()
    if nonfinite:
        for name, t in inputs:
            bad = ~torch.isfinite(t)
            if bool(bad.any()):
                at = [int(x) for x in torch.nonzero(bad)[0]]
                raise posenc.InvalidValueError(f"attention: {name}: non-finite value "
                                               f"{float(t[tuple(at)])} at {at}")
        raise posenc.InvalidValueError("attention: a score or an output is not finite (float32 "
                                       "overflow of q . k)")
    if no_key:
        if no_key_error is None:
            from . import _fully_masked_error as no_key_error
        raise no_key_error(lse, plan)
