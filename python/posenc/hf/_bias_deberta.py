"""DeBERTa-v2/v3 disentangled attention on posenc: c2p and p2c inside the fused kernel.

The layer's projections of the (layer-normalised) relative embeddings are the tables pos_key
[2K, H, D] and pos_query [2K, H, D]; gradients flow to the embeddings, the normalisation and
the projections through them. The encoder's [B, 1, L, L] mask and [1, L, L] relative positions
are not built (the encoder is patched to keep the 2-D padding mask).
"""

import torch

from .. import torch as pt
from ._bias_mask import BiasMask, attention_kwargs, check_call


def forward(self, hidden_states, attention_mask, output_attentions=False, query_states=None,
            relative_pos=None, rel_embeddings=None):
    """DisentangledSelfAttention.forward with posenc's fused attention (posenc.hf.patch)."""
    state = self._posenc_state
    check_call(self, {"output_attentions": output_attentions}, state["dropout_check"])
    if relative_pos is not None:
        raise ValueError("DeBERTa attention patched by posenc.hf.patch: explicit relative_pos is "
                         "not supported (posenc computes the relative positions of the tokens)")
    if query_states is None:
        query_states = hidden_states
    batch, seq_q = query_states.shape[:2]
    seq_k = hidden_states.shape[1]
    heads, d = self.num_attention_heads, self.attention_head_size
    query = self.query_proj(query_states).view(batch, seq_q, heads, d)
    key = self.key_proj(hidden_states).view(batch, seq_k, heads, d)
    value = self.value_proj(hidden_states).view(batch, seq_k, heads, d)
    c2p = "c2p" in self.pos_att_type
    p2c = "p2c" in self.pos_att_type
    factor = 1 + int(c2p) + int(p2c)
    # The model divides by sqrt(D·factor) evaluated in float32.
    scale = 1.0 / float(torch.sqrt(torch.tensor(d, dtype=torch.float) * factor))
    kw = attention_kwargs(attention_mask, batch, seq_q, seq_k, causal=False,
                          kind="multiplicative", what="DeBERTa attention")
    if seq_q != seq_k and "query_positions" not in kw:
        kw["query_positions"] = torch.arange(seq_q, dtype=torch.int64)  # the model's q_ids
    if not self.relative_attention or not (c2p or p2c):
        out = pt.attention(query, key, value, "none", scale=scale, **kw)
    else:
        if rel_embeddings is None:
            raise ValueError("DeBERTa attention patched by posenc.hf.patch needs rel_embeddings")
        span = self.pos_ebd_size
        rel = self.pos_dropout(rel_embeddings)[:2 * span]
        if rel.shape[0] != 2 * span:
            raise ValueError(f"DeBERTa rel_embeddings: {rel.shape[0]} rows, expected {2 * span}")
        if self.share_att_key:
            pos_key = self.key_proj(rel) if c2p else None
            pos_query = self.query_proj(rel) if p2c else None
        else:
            pos_key = self.pos_key_proj(rel) if c2p else None
            pos_query = self.pos_query_proj(rel) if p2c else None
        # A term the model leaves out gets a zero table (its product vanishes).
        if pos_key is None:
            pos_key = torch.zeros_like(pos_query)
        if pos_query is None:
            pos_query = torch.zeros_like(pos_key)
        params = {"pos_key": pos_key.view(2 * span, heads, d),
                  "pos_query": pos_query.view(2 * span, heads, d)}
        buckets = self.position_buckets if self.position_buckets > 0 else 0
        out = pt.attention(query, key, value, "deberta", params=params, scale=scale,
                           position_buckets=buckets,
                           max_relative_positions=self.max_relative_positions,
                           deberta_p2c="model", **kw)
    return out.reshape(batch, seq_q, heads * d), None


def encoder_attention_mask(self, attention_mask):
    """DebertaV2Encoder.get_attention_mask, patched: a BiasMask with the 2-D padding mask (the
    model's [B, 1, L, L] product of the padding masks is never built)."""
    if attention_mask.dim() <= 2:
        pad = attention_mask.to(torch.bool)
        return BiasMask(None if bool(pad.all()) else pad, False, 0)
    mask = attention_mask.unsqueeze(1) if attention_mask.dim() == 3 else attention_mask
    return BiasMask(dense=mask.to(torch.bool))


def encoder_rel_pos(self, hidden_states, query_states=None, relative_pos=None):
    """DebertaV2Encoder.get_rel_pos, patched: no [1, L, L] relative positions (posenc computes
    them); an explicit relative_pos is passed on (and refused by the patched attention)."""
    return relative_pos


def install(module, dropout_check):
    """Makes module (a DisentangledSelfAttention) run forward() above."""
    module.__dict__["_posenc_state"] = {"dropout_check": dropout_check}
    module.forward = forward.__get__(module)


def install_encoder(encoder):
    """Patches a DebertaV2Encoder's mask and relative-position builders."""
    encoder.get_attention_mask = encoder_attention_mask.__get__(encoder)
    encoder.get_rel_pos = encoder_rel_pos.__get__(encoder)
