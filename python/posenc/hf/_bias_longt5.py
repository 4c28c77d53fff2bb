"""LongT5 encoder attention on posenc: local and transient-global attention in the fused kernel.

Local attention (``LongT5LocalAttention``): the model splits the sequence into blocks of
``block_len = local_radius + 1`` and lets each query score the keys of its own and the two
neighbouring blocks, then hides every key farther than ``local_radius`` (``|k - q| < block_len``):
the query sees exactly the keys with ``|k - q| <= local_radius``, a symmetric window, which posenc
takes as ``window=block_len`` (visible iff ``|rel| < w``). Its bias is the stack's layer-0
bucket table at ``rel = k - q`` (bidirectional buckets), no score scale.

Transient-global attention (``LongT5TransientGlobalAttention``) adds one side key per global
block of ``global_block_size`` tokens (``L // global_block_size`` of them; the tail joins the last
full block): the layer's ``k`` / ``v`` projections of the layer-normalised sum of the block's real
tokens. Query ``q`` scores side key ``g`` with the layer-0 ``global_relative_attention_bias`` at
the bucket of ``g - block(q)``, and sees it iff its padding-mask value equals the block's segment
id (1 for blocks up to the row's last real block). The softmax runs over the local keys and the
side keys together: posenc computes the two parts (the side part as a ``t5`` attention whose query
positions are the block ids and whose key positions are the global indices, the side mask as
document ids) and merges them by their log-sum-exp; the backward runs posenc's backward of each
part against the merged output and log-sum-exp, which is the gradient of the union softmax.
Memory stays O(L·block_len) for the model's own local mask and O(L) elsewhere (the side keys are
``L / global_block_size`` rows); no ``[B, H, L, G]`` side bias and no one-hot aggregation matrix.

Block ids and segment ids come from the model's own helper (its float arithmetic decides the
block of each token), so the patched layer assigns tokens exactly as the unpatched one.
"""

import sys

import torch

from .. import _ops
from .. import torch as pt
from ._bias_mask import check_call

_LOCAL = ("LongT5LocalAttention", "LongT5TransientGlobalAttention")


def _model_module(module):
    return sys.modules[type(module).__module__]


def _prepared(scheme, table, **kwargs):
    """The op-level arguments of one posenc attention call but its tensors q, k, v and tables:
    (table names, query positions, key positions, {mask name: tensor}, typed settings); table is
    named relative_attention_bias (or None: no table)."""
    _, _, qpos, kpos, masks, settings = pt._prepared(kwargs, scheme)
    names = ["relative_attention_bias"] if table is not None else []
    return names, qpos, kpos, masks, settings


def _forward(q, k, v, table, part):
    names, qpos, kpos, masks, settings = part
    return _ops.attention_impl(q, k, v, [table], names, qpos, kpos, **masks, **settings)


def _backward(q, k, v, out, lse, dout, table, part):
    names, qpos, kpos, masks, settings = part
    return _ops.attention_backward_impl(q, k, v, out, lse, dout, [table], names, qpos, kpos,
                                        **masks, **settings)


class _UnionAttention(torch.autograd.Function):
    """Softmax over two disjoint key sets (local keys, side keys) of the same queries.

    forward: each part's output and log-sum-exp from posenc, merged. backward: each part's
    posenc backward with the merged output and log-sum-exp (P taken against the total
    normaliser, D = rowsum(dO·O) of the merged output), their dq summed."""

    @staticmethod
    def forward(ctx, part_a, part_b, q, k_a, v_a, t_a, k_b, v_b, t_b):
        out_a, lse_a = _forward(q, k_a, v_a, t_a, part_a)
        out_b, lse_b = _forward(q, k_b, v_b, t_b, part_b)
        la, lb = lse_a.double(), lse_b.double()
        lse = torch.logaddexp(la, lb)
        shift = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
        wa = torch.exp(la - shift).transpose(1, 2)[..., None]   # [B, L, H, 1]
        wb = torch.exp(lb - shift).transpose(1, 2)[..., None]
        out = (wa * out_a.double() + wb * out_b.double()).to(q.dtype)
        lse = lse.to(lse_a.dtype)
        ctx.parts = (part_a, part_b)
        ctx.save_for_backward(q, k_a, v_a, t_a, k_b, v_b, t_b, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k_a, v_a, t_a, k_b, v_b, t_b, out, lse = ctx.saved_tensors
        part_a, part_b = ctx.parts
        dout = dout.contiguous()
        ga = _backward(q, k_a, v_a, out, lse, dout, t_a, part_a)
        gb = _backward(q, k_b, v_b, out, lse, dout, t_b, part_b)
        return (None, None, ga[0] + gb[0], ga[1], ga[2], ga[3], gb[1], gb[2], gb[3])


def _local_padding(self, mask, batch, seq):
    """The [batch, seq] padding (True: a real token) of the local mask the LongT5 stack builds
    ([batch, 1, blocks, block_len, 3·block_len], _get_local_attention_mask), checked to be of
    that form; None when every token is real."""
    bl = self.block_len
    what = f"{type(self).__name__} patched by posenc.hf.patch"
    if mask is None:
        raise ValueError(f"{what}: needs the encoder's attention mask (without one the model "
                         "attends to the zero keys of its block padding, beyond local_radius)")
    blocks = -(-seq // bl)
    if (mask.dim() != 5 or mask.shape[1] != 1 or mask.shape[0] not in (1, batch)
            or tuple(mask.shape[2:]) != (blocks, bl, 3 * bl)):
        raise ValueError(f"{what}: attention mask of shape {tuple(mask.shape)}, expected the "
                         f"local mask [batch, 1, {blocks}, {bl}, {3 * bl}] the LongT5 encoder "
                         "builds from its 2-D padding mask")
    visible = mask > 0
    pad = torch.diagonal(visible[:, 0, :, :, bl:2 * bl], dim1=-2, dim2=-1)
    pad = pad.reshape(mask.shape[0], blocks * bl)[:, :seq]
    rebuilt = _model_module(self)._get_local_attention_mask(pad, bl, mask.device)
    if not torch.equal(rebuilt, visible):
        raise ValueError(f"{what}: the local attention mask is not the model's (a padding mask "
                         f"within |k - q| <= local_radius = {bl - 1}); other patterns are not "
                         "supported")
    pad = pad.expand(batch, seq)
    return None if bool(pad.all()) else pad


def _padding_kwargs(pad, batch, seq):
    if pad is None:
        return {}
    return {"key_documents": (~pad).to(torch.int32),
            "query_documents": torch.zeros(batch, seq, dtype=torch.int32),
            "allow_fully_masked": True}


def _compute_dtype(x):
    return x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32


def forward(self, hidden_states, mask=None, position_bias=None, output_attentions=False,
            **kwargs):
    """LongT5LocalAttention / LongT5TransientGlobalAttention.forward with posenc's fused
    attention (installed by posenc.hf.patch). Returns (output, None): no bias tensor to share."""
    state = self._posenc_state
    check_call(self, dict(kwargs, output_attentions=output_attentions), state["dropout_check"])
    what = f"{type(self).__name__} patched by posenc.hf.patch"
    if position_bias is not None:
        raise ValueError(f"{what}: an explicit position_bias tensor is not supported (posenc "
                         "computes the bias inside the kernel)")
    batch, seq = hidden_states.shape[:2]
    heads, d = self.n_heads, self.key_value_proj_dim
    query = self.q(hidden_states).view(batch, seq, heads, d)
    key = self.k(hidden_states).view(batch, seq, heads, d)
    value = self.v(hidden_states).view(batch, seq, heads, d)
    owner = state["owner"]
    if state["global"]:
        out = _transient_global(self, owner, hidden_states, mask, query, key, value, what)
    else:
        pad = _local_padding(self, mask, batch, seq)
        kw = _padding_kwargs(pad, batch, seq)
        if owner is None:
            out = pt.attention(query, key, value, "none", scale=1.0, window=self.block_len, **kw)
        else:
            out = pt.attention(query, key, value, "t5",
                               params={"relative_attention_bias":
                                       owner.relative_attention_bias.weight},
                               scale=1.0, max_distance=owner.relative_attention_max_distance,
                               bidirectional=not owner.is_decoder, window=self.block_len, **kw)
    out = out.to(hidden_states.dtype).reshape(batch, seq, heads * d)
    return self.o(out), None


def _transient_global(self, owner, hidden_states, mask, query, key, value, what):
    if mask is None:
        raise ValueError(f"{what}: needs the encoder's 2-D attention mask (without one the model "
                         "attends to the zero keys of its block padding, beyond local_radius)")
    if owner is None:
        raise ValueError(f"{what}: no layer holds the relative_attention_bias and "
                         "global_relative_attention_bias tables (the unpatched module needs them "
                         "too)")
    batch, seq, heads, d = query.shape
    if mask.dim() != 2 or tuple(mask.shape) != (batch, seq):
        raise ValueError(f"{what}: attention mask of shape {tuple(mask.shape)}, expected the 2-D "
                         f"padding mask [{batch}, {seq}]")
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError(f"{what}: the attention mask must hold 0 and 1 only (the model compares "
                         "it with its global segment ids)")
    mod = _model_module(self)
    pad = mask != 0
    local_kw = _padding_kwargs(None if bool(pad.all()) else pad, batch, seq)
    common = dict(scale=1.0, max_distance=owner.relative_attention_max_distance,
                  bidirectional=not owner.is_decoder)
    table_a = owner.relative_attention_bias.weight
    block_ids, segments = mod._make_global_fixed_block_ids(mask, self.global_block_size)
    globals_ = segments.shape[-1]
    if globals_ == 0:  # shorter than one global block: no side keys
        return pt.attention(query, key, value, "t5", params={"relative_attention_bias": table_a},
                            window=self.block_len, **common, **local_kw)
    # Side inputs: the layer-normalised sum of each global block's real tokens (padding: -1).
    ids = block_ids.to(torch.int64)
    ids = torch.where(ids >= 0, ids, torch.full_like(ids, globals_))
    sums = hidden_states.new_zeros(batch, globals_ + 1, hidden_states.shape[-1])
    sums = sums.scatter_add(1, ids[..., None].expand(-1, -1, hidden_states.shape[-1]),
                            hidden_states)
    side = self.global_input_layer_norm(sums[:, :globals_])
    side_key = self.k(side).view(batch, globals_, heads, d)
    side_value = self.v(side).view(batch, globals_, heads, d)
    table_b = owner.global_relative_attention_bias.weight
    part_a = _prepared("t5", table_a, window=self.block_len, **common, **local_kw)
    # Side part: rel = g - block(q), as key position g + 1 minus query position block(q) + 1
    # (padding's block -1 becomes 0); visible iff mask(q) == segment(g).
    part_b = _prepared("t5", table_b, **common,
                       query_positions=block_ids.to(torch.int64) + 1,
                       key_positions=torch.arange(1, globals_ + 1, dtype=torch.int64),
                       query_documents=pad.to(torch.int32),
                       key_documents=segments.to(torch.int32).contiguous(),
                       allow_fully_masked=True)
    for t, name in ((query, "query"), (table_a, "relative_attention_bias"),
                    (table_b, "global_relative_attention_bias")):
        _ops.require_cpu(t, f"LongT5 {name}")
    dtype = _compute_dtype(query)
    tensors = [x.to(dtype) for x in (query, key, value, table_a, side_key, side_value, table_b)]
    q, k_a, v_a, t_a, k_b, v_b, t_b = tensors
    return _UnionAttention.apply(part_a, part_b, q, k_a, v_a, t_a, k_b, v_b, t_b)


def install(module, owner, dropout_check):
    """Makes module (a LongT5LocalAttention or LongT5TransientGlobalAttention) run forward()
    above; owner holds the stack's tables (layer 0), or None."""
    module.__dict__["_posenc_state"] = {
        "owner": owner, "dropout_check": dropout_check,
        "global": type(module).__name__ == "LongT5TransientGlobalAttention"}
    module.forward = forward.__get__(module)


def install_model(model, make_check):
    """Installs posenc's forward in every LongT5 attention module of model: the encoder's local
    or transient-global attention here, the decoder's T5-style attention with _bias_t5 (the
    stack's layer-0 table, as in T5). make_check() gives each stack its dropout check."""
    from . import _bias_t5
    for stack in model.modules():
        if type(stack).__name__ != "LongT5Stack":
            continue
        check = make_check()
        selfs = [blk.layer[0] for blk in stack.block]
        selfs = [getattr(s, "SelfAttention", None) or getattr(s, "LocalSelfAttention", None)
                 or getattr(s, "TransientGlobalSelfAttention", None) for s in selfs]
        owner = next((a for a in selfs if a is not None and a.has_relative_attention_bias), None)
        for a in stack.modules():
            name = type(a).__name__
            if name == "LongT5Attention":
                _bias_t5.install(a, a if a.has_relative_attention_bias else owner, check)
            elif name in _LOCAL:
                install(a, a if a.has_relative_attention_bias else owner, check)
    for a in model.modules():  # attention modules outside a stack (used alone)
        name = type(a).__name__
        if "_posenc_state" in a.__dict__ or name not in ("LongT5Attention",) + _LOCAL:
            continue
        own = a if a.has_relative_attention_bias else None
        if name == "LongT5Attention":
            _bias_t5.install(a, own, make_check())
        else:
            install(a, own, make_check())
