"""DeBERTa (v1) disentangled attention on posenc: c2p and p2c inside the fused kernel.

v1 differs from v2/v3 (_bias_deberta): one in_proj gives q, k, v (per head, [q | k | v] of
head_dim each) with separate q_bias and v_bias; the relative embeddings are used raw (no
normalisation) and projected by the layer's pos_proj (c2p, no bias) and pos_q_proj (p2c, with
bias); relative distances are clipped to the span min(L, max_relative_positions) without log
buckets; the scale is sqrt(D · (1 + len(pos_att_type))). The model divides the query and the p2c
table by that scale before the products: so does this module (the kernel runs with scale 1), so
gradients reach in_proj, the biases, the projections and rel_embeddings through the same
formulas. The encoder's [B, 1, L, L] mask and [1, L, L] relative positions are not built.
"""

import torch

from .. import torch as pt
from ._bias_deberta import encoder_attention_mask
from ._bias_mask import attention_kwargs, check_call


class _TokenPositions:
    """The relative_pos the patched encoder hands its layers: the positions of the tokens
    (query i minus key j), computed by posenc instead of a [1, L, L] tensor."""

    def __repr__(self):
        return "posenc token positions"


TOKEN_POSITIONS = _TokenPositions()


def forward(self, hidden_states, attention_mask, output_attentions=False, query_states=None,
            relative_pos=None, rel_embeddings=None):
    """DisentangledSelfAttention.forward (DeBERTa v1) with posenc's fused attention."""
    state = self._posenc_state
    check_call(self, {"output_attentions": output_attentions}, state["dropout_check"])
    if query_states is not None:
        raise ValueError("DeBERTa (v1) attention patched by posenc.hf.patch: query_states is not "
                         "supported")
    c2p = "c2p" in self.pos_att_type
    p2c = "p2c" in self.pos_att_type
    relative = (self.relative_attention and rel_embeddings is not None
                and relative_pos is not None and (c2p or p2c))
    if relative and relative_pos is not TOKEN_POSITIONS:
        raise ValueError("DeBERTa (v1) attention patched by posenc.hf.patch: explicit "
                         "relative_pos is not supported (posenc computes the relative positions "
                         "of the tokens)")
    batch, seq = hidden_states.shape[:2]
    heads, d = self.num_attention_heads, self.attention_head_size
    qkv = self.in_proj(hidden_states).view(batch, seq, heads, 3, d)
    query, key, value = qkv.unbind(dim=3)
    # The model's scale: sqrt(D·factor) evaluated in float32, dividing the query (and the p2c
    # table) before the products.
    factor = 1 + len(self.pos_att_type)
    scale = torch.sqrt(torch.tensor(d, dtype=torch.float) * factor)
    query = (query + self.q_bias.view(heads, d)) / scale.to(query.dtype)
    value = value + self.v_bias.view(heads, d)
    kw = attention_kwargs(attention_mask, batch, seq, seq, causal=False,
                          kind="multiplicative", what="DeBERTa (v1) attention")
    if not relative:
        out = pt.attention(query, key, value, "none", scale=1.0, **kw)
        return out.reshape(batch, seq, heads * d), None
    limit = self.max_relative_positions
    span = min(seq, limit)  # the model's attention span: rows limit - span .. limit + span - 1
    rel = self.pos_dropout(rel_embeddings)[limit - span:limit + span]
    if rel.shape[0] != 2 * span:
        raise ValueError(f"DeBERTa rel_embeddings: {rel_embeddings.shape[0]} rows, expected "
                         f"{limit + span} at least")
    pos_key = self.pos_proj(rel) if c2p else None
    pos_query = self.pos_q_proj(rel) / scale.to(rel.dtype) if p2c else None
    # A term the model leaves out gets a zero table (its product vanishes).
    if pos_key is None:
        pos_key = torch.zeros_like(pos_query)
    if pos_query is None:
        pos_query = torch.zeros_like(pos_key)
    params = {"pos_key": pos_key.view(2 * span, heads, d),
              "pos_query": pos_query.view(2 * span, heads, d)}
    out = pt.attention(query, key, value, "deberta", params=params, scale=1.0,
                       position_buckets=0, max_relative_positions=span, deberta_p2c="model",
                       **kw)
    return out.reshape(batch, seq, heads * d), None


def encoder_rel_pos(self, hidden_states, query_states=None, relative_pos=None):
    """DebertaEncoder.get_rel_pos, patched: TOKEN_POSITIONS instead of the [1, L, L] relative
    positions (an explicit relative_pos is passed on, and refused by the patched attention)."""
    if self.relative_attention and relative_pos is None:
        return TOKEN_POSITIONS
    return relative_pos


def unsupported(module):
    """The name of a configuration option of a v1 attention module posenc cannot fuse, or None."""
    if getattr(module, "head_logits_proj", None) is not None or \
            getattr(module, "head_weights_proj", None) is not None:
        return "talking_head"
    return None


def install(module, dropout_check):
    """Makes module (a DeBERTa v1 DisentangledSelfAttention) run forward() above."""
    module.__dict__["_posenc_state"] = {"dropout_check": dropout_check}
    module.forward = forward.__get__(module)


def install_encoder(encoder):
    """Patches a DebertaEncoder's mask and relative-position builders."""
    encoder.get_attention_mask = encoder_attention_mask.__get__(encoder)
    encoder.get_rel_pos = encoder_rel_pos.__get__(encoder)
