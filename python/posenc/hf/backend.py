"""The "posenc" attention implementation for transformers' ``AttentionInterface``.

``register()`` adds two functions to transformers under the name "posenc":

- an attention function (``AttentionInterface``), called by every attention layer of a model made
  with ``attn_implementation="posenc"``: it runs ``posenc.torch.attention`` (the fused kernel,
  forward and backward) on the layer's rotated queries and keys, with the layer's softmax scale,
  logit soft-capping (Gemma 2) and attention sinks (gpt-oss);
- a mask function (``AttentionMaskInterface``), called where the model builds its masks: instead
  of a dense ``[batch, 1, q, k]`` tensor it returns a :class:`PosencMask`, a description that the
  attention function turns into posenc's mask options: causal, sliding window, chunked attention
  (Llama 4, with the chunk boundaries shifted by each row's left padding, as transformers does),
  KV-cache offsets, padding (as key documents) and packed sequences (documents and positions).
  A mask pattern it does not recognise (an ``or_mask_function`` for image tokens, a custom
  ``and_mask_function``, block-wise overlays) is evaluated into a dense boolean mask, which posenc
  takes as ``mask=``: exact, at the cost of the ``[batch, q, k]`` bytes.

Masks that cannot be expressed exactly (an additive float mask with values other than 0 and
-inf, a per-head mask, a flex ``BlockMask``, a bare 2-D padding mask) raise ``ValueError`` naming
the model, the layer and the mask; nothing is silently mis-masked.
"""

import math
import torch

__all__ = ["register", "attention_forward", "posenc_mask", "PosencMask", "NAME"]

NAME = "posenc"


class PosencMask:
    """What a transformers mask function describes, kept in a form posenc reads.

    Made by :func:`posenc_mask` (transformers calls it where a model builds a mask); read by
    :func:`attention_forward`. Attributes: ``batch_size``, ``q_length``, ``kv_length``,
    ``q_offset``, ``kv_offset`` (the index of the first query and key, as transformers' caches
    report them), ``padding`` (bool ``[batch, kv_length]``, True for real keys, or None),
    ``causal``, ``window`` (posenc's ``|rel| < window``), ``chunk``, ``chunk_shift`` (int64
    ``[batch]`` added to every index so that chunks start after each row's left padding, or None),
    ``positions`` (int64 ``[batch, length]`` position ids of packed sequences, or None),
    ``documents`` (int ``[batch, length]``, or None) and ``dense`` (bool ``[batch, q, k]`` when the
    pattern was not recognised, else None).
    """

    __slots__ = ("batch_size", "q_length", "kv_length", "q_offset", "kv_offset", "padding",
                 "causal", "window", "chunk", "chunk_shift", "positions", "documents", "dense")

    def __init__(self, **fields):
        for name in self.__slots__:
            setattr(self, name, fields.get(name))

    @property
    def shape(self):
        """The shape of the dense mask this stands for: (batch, 1, q_length, kv_length)."""
        return (self.batch_size, 1, self.q_length, self.kv_length)

    @property
    def ndim(self):
        """4, as the dense mask this stands for (a prepared mask, not a 2-D padding mask)."""
        return 4

    def __repr__(self):
        parts = [f"{n}={getattr(self, n)!r}" for n in ("q_length", "kv_length", "q_offset",
                                                         "kv_offset", "causal", "window", "chunk")]
        if self.padding is not None:
            parts.append("padding")
        if self.documents is not None:
            parts.append("documents")
        if self.dense is not None:
            parts.append("dense")
        return f"PosencMask({', '.join(parts)})"


def _closure(fn):
    """The free variables of a closure, by name."""
    code = getattr(fn, "__code__", None)
    if code is None or not fn.__closure__:
        return {}
    return {n: c.cell_contents for n, c in zip(code.co_freevars, fn.__closure__)}


def _decode(fn, mu, atoms, space):
    """Reads a transformers mask function into atoms [(kind, value, space)]. False when some part
    of it is not one of transformers' known patterns."""
    if fn is mu.causal_mask_function:
        atoms.append(("causal", None, space))
        return True
    if fn is mu.bidirectional_mask_function:
        return True
    qn = getattr(fn, "__qualname__", "")
    cl = _closure(fn)
    if qn == "and_masks.<locals>.and_mask" and "mask_functions" in cl:
        return all(_decode(f, mu, atoms, space) for f in cl["mask_functions"])
    if qn == "sliding_window_overlay.<locals>.inner_mask":
        atoms.append(("window_causal", int(cl["sliding_window"]), space))
        return True
    if qn == "sliding_window_bidirectional_overlay.<locals>.inner_mask":
        atoms.append(("window_bi", int(cl["sliding_window"]), space))
        return True
    if qn == "chunked_overlay.<locals>.inner_mask":
        atoms.append(("chunk", (int(cl["chunk_size"]), cl["left_padding"]), space))
        return True
    if qn == "padding_mask_function.<locals>.inner_mask":
        atoms.append(("padding", cl["padding_mask"], space))
        return True
    if qn == "packed_sequence_mask_function.<locals>.inner_mask":
        atoms.append(("documents", cl["packed_sequence_mask"], space))
        return True
    if qn == "remap_positions_for_packed_sequence.<locals>.inner_mask" and space is None:
        return _decode(cl["mask_function"], mu, atoms, cl["position_ids"])
    return False


def _spec_from_atoms(atoms):
    """Atoms -> dict of posenc mask settings, or None when they do not map exactly."""
    spec = {"causal": False, "window": None, "chunk": None, "positions": None, "documents": None,
            "padding": None, "window_causal": None}
    spaces = {id(s): s for kind, _, s in atoms if kind in ("causal", "window_causal", "window_bi",
                                                              "chunk")}
    if len(spaces) > 1:
        return None  # causal parts in index space and in position space at once
    if spaces:
        spec["positions"] = next(iter(spaces.values()))
    for kind, value, space in atoms:
        if kind in ("documents", "padding") and space is not None:
            return None
        if kind == "causal":
            spec["causal"] = True
        elif kind == "window_causal":
            w = value if spec["window_causal"] is None else min(spec["window_causal"], value)
            spec["window_causal"] = w
        elif kind == "window_bi":
            w = value + 1  # |q - k| <= w
            spec["window"] = w if spec["window"] is None else min(spec["window"], w)
        elif kind == "chunk":
            if spec["chunk"] is not None:
                return None
            spec["chunk"] = value
        elif kind == "documents":
            if spec["documents"] is not None:
                return None
            spec["documents"] = value
        elif kind == "padding":
            spec["padding"] = value if spec["padding"] is None else spec["padding"] & value
    if spec["window_causal"] is not None:
        # kv > q - w is posenc's |rel| < w only together with causal (kv <= q)
        if not spec["causal"]:
            return None
        w = spec["window_causal"]
        spec["window"] = w if spec["window"] is None else min(spec["window"], w)
    return spec


def _visible(spec, b, q_idx, kv_idx):
    """What posenc will make of spec, at absolute query / key indices: bool [batch, q, k]."""
    if spec["positions"] is not None:
        pos = spec["positions"].to(torch.int64).expand(b, -1)
        pq, pk = pos[:, q_idx], pos[:, kv_idx]
    else:
        pq = q_idx[None, :].expand(b, -1)
        pk = kv_idx[None, :].expand(b, -1)
    if spec["chunk"] is not None:
        chunk, left = spec["chunk"]
        shift = torch.remainder(-torch.as_tensor(left).to(torch.int64).reshape(-1), chunk)
        shift = shift.expand(b)[:, None]
        pq, pk = pq + shift, pk + shift
    rel = pk[:, None, :] - pq[:, :, None]
    keep = torch.ones_like(rel, dtype=torch.bool)
    if spec["causal"]:
        keep &= rel <= 0
    if spec["window"] is not None:
        keep &= rel.abs() < spec["window"]
    if spec["chunk"] is not None:
        c = spec["chunk"][0]
        keep &= torch.div(pk[:, None, :], c, rounding_mode="floor") == \
            torch.div(pq[:, :, None], c, rounding_mode="floor")
    if spec["documents"] is not None:
        docs = spec["documents"].expand(b, -1)
        keep &= docs[:, q_idx][:, :, None] == docs[:, kv_idx][:, None, :]
    if spec["padding"] is not None:
        pad = spec["padding"].to(torch.bool)
        keep &= pad[:, kv_idx][:, None, :]
    return keep


def _agrees(spec, mask_function, b, lq, lk, q_offset, kv_offset):
    """Checks the description against transformers' own mask function on a sample of query rows
    (the first and last, and up to 14 in between; every key): False on any difference."""
    from transformers import masking_utils as mu

    rows = torch.unique(torch.linspace(0, lq - 1, min(lq, 16)).round().to(torch.int64))
    q_idx = rows + q_offset
    kv_idx = torch.arange(lk, dtype=torch.int64) + kv_offset
    try:
        want = mask_function(*mu._non_vmap_expansion_sdpa(
            torch.arange(b), torch.arange(1), q_idx, kv_idx))
        want = torch.as_tensor(want).to(torch.bool).expand(b, 1, rows.numel(), lk)[:, 0]
        return bool(torch.equal(want, _visible(spec, b, q_idx, kv_idx)))
    except Exception:  # noqa: BLE001 - not evaluable by broadcasting: not one of the known ones
        return False


def posenc_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                attention_mask=None, use_vmap=False, device="cpu", **kwargs):
    """transformers' mask function for attn_implementation="posenc" (AttentionMaskInterface).

    Takes what transformers gives every mask function (sizes, offsets, the mask pattern as a
    function of (batch, head, q_idx, kv_idx), the 2-D padding mask) and returns a
    :class:`PosencMask`. transformers' own patterns (causal, sliding window, chunked, bidirectional,
    packed sequences, padding) become posenc options; anything else is evaluated into a dense
    boolean mask (exact)."""
    from transformers import masking_utils as mu

    if isinstance(attention_mask, PosencMask):
        # prepared ahead for this step (generate with a static cache): kept when it fits
        if (attention_mask.batch_size, attention_mask.q_length, attention_mask.kv_length) != (
                int(batch_size), int(q_length), int(kv_length)):
            raise ValueError(f"posenc: a prepared mask for {attention_mask.q_length} queries and "
                             f"{attention_mask.kv_length} keys was given for {int(q_length)} "
                             f"queries and {int(kv_length)} keys")
        return attention_mask
    if mask_function is None:
        mask_function = mu.causal_mask_function
    q_offset = int(q_offset)
    kv_offset = int(kv_offset)
    padding = None
    if attention_mask is not None:
        full = mu.prepare_padding_mask(attention_mask.to(torch.bool), kv_length, kv_offset)
        part = full[:, kv_offset:kv_offset + kv_length]
        if part.shape[-1] != kv_length:
            raise ValueError(f"posenc: the 2-D attention mask has {full.shape[-1]} columns; "
                             f"keys {kv_offset}..{kv_offset + kv_length} do not fit it")
        if not bool(part.all()):
            padding = part
    fields = dict(batch_size=int(batch_size), q_length=int(q_length), kv_length=int(kv_length),
                  q_offset=q_offset, kv_offset=kv_offset, padding=padding)
    atoms = []
    spec = _spec_from_atoms(atoms) if _decode(mask_function, mu, atoms, None) else None
    if spec is not None and spec["positions"] is not None and (
            q_offset != 0 or kv_offset != 0 or q_length != kv_length):
        spec = None  # position-space patterns are only made for a full, cache-free batch
    if spec is not None and spec["documents"] is not None and q_length != kv_length:
        spec = None
    if spec is not None and not _agrees(spec, mask_function, int(batch_size), int(q_length),
                                        int(kv_length), q_offset, kv_offset):
        spec = None  # a pattern that looks known but means something else: take it as it is
    if spec is None:
        dense = mu.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                             q_offset=q_offset, kv_offset=kv_offset, mask_function=mask_function,
                             attention_mask=attention_mask, allow_is_causal_skip=False,
                             allow_is_bidirectional_skip=False, use_vmap=use_vmap, device=device)
        fields.update(dense=dense.expand(batch_size, 1, q_length, kv_length)[:, 0],
                      padding=None, causal=False)
        return PosencMask(**fields)
    if spec["padding"] is not None:
        extra = spec["padding"]
        extra = mu.prepare_padding_mask(extra.to(torch.bool), kv_length, kv_offset)
        extra = extra[:, kv_offset:kv_offset + kv_length]
        fields["padding"] = extra if padding is None else padding & extra
    fields.update(causal=spec["causal"], window=spec["window"], positions=spec["positions"],
                  documents=spec["documents"])
    if spec["chunk"] is not None:
        chunk, left = spec["chunk"]
        fields["chunk"] = chunk
        left = torch.as_tensor(left).to(torch.int64).reshape(-1)
        if bool((left != 0).any()):
            # (idx - left) // c == (idx + shift) // c - ceil(left / c): equal chunks, idx + shift >= 0
            shift = torch.remainder(-left, chunk)
            fields["chunk_shift"] = shift.expand(int(batch_size)) if shift.numel() == 1 else shift
    return PosencMask(**fields)


def _model_name(module):
    cfg = getattr(module, "config", None)
    kind = getattr(cfg, "model_type", None) or type(module).__name__
    layer = getattr(module, "layer_idx", None)
    return f"{kind} ({type(module).__name__}" + (f", layer {layer})" if layer is not None else ")")


def _refuse(module, what):
    raise ValueError(f"posenc: {_model_name(module)}: {what}; posenc cannot express this mask "
                     "exactly (use attn_implementation='eager' or 'sdpa' for this model)")


def _dense_from_tensor(module, mask, lq, lk):
    """A 4-D mask tensor given to the model as is -> bool [batch or 1, lq, lk]."""
    if mask.dim() != 4:
        _refuse(module, f"a {mask.dim()}-D attention mask tensor of shape {tuple(mask.shape)} "
                "(posenc's mask function makes the masks of models built with "
                "attn_implementation='posenc'; a 4-D boolean or 0/-inf mask is accepted too)")
    if mask.shape[-2:] != (lq, lk) and not (mask.shape[-2] == lq and mask.shape[-1] >= lk):
        _refuse(module, f"a 4-D mask of shape {tuple(mask.shape)} for {lq} queries and {lk} keys")
    mask = mask[..., :lk]
    if mask.dtype == torch.bool:
        keep = mask
    elif mask.is_floating_point():
        neg = torch.isneginf(mask) | (mask <= torch.finfo(mask.dtype).min / 2)
        if not bool(((mask == 0) | neg).all()):
            _refuse(module, "an additive float attention mask with values other than 0 and -inf "
                    "(a bias, not a mask)")
        keep = ~neg
    else:
        keep = mask != 0
    if keep.shape[1] != 1:
        if not bool((keep == keep[:, :1]).all()):
            _refuse(module, f"a per-head attention mask of shape {tuple(mask.shape)}")
    return keep[:, 0]


def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      sliding_window=None, softcap=None, s_aux=None, **kwargs):
    """transformers' attention function for attn_implementation="posenc" (AttentionInterface).

    query [batch, heads, q_len, head_dim], key and value [batch, kv_heads, k_len, head_dim or
    v_dim] (rotated by the model; GQA and narrower value heads as they come), attention_mask a
    :class:`PosencMask` (or None: causal when the layer is, queries at the last positions; or a
    4-D boolean / 0-or-minus-infinity tensor). Returns (attn_output [batch, q_len, heads, v_dim],
    None). ``dropout`` must be 0 (posenc has no attention dropout), ``softcap`` is logit
    soft-capping, ``s_aux`` (or the layer's ``sinks``) gpt-oss' attention sinks."""
    if dropout and module.training:
        raise ValueError(f"posenc: {_model_name(module)}: attention dropout {dropout} during "
                         "training; posenc has no attention dropout (set the config's "
                         "attention_dropout to 0, or use another attn_implementation)")
    import posenc.torch as pt

    b, hq, lq, d = query.shape
    lk = key.shape[-2]
    q = query.transpose(1, 2)
    k = key.transpose(1, 2)
    v = value.transpose(1, 2)
    opts = {}
    if scaling is not None:
        opts["scale"] = float(scaling)
    if softcap is not None and softcap:
        opts["softcap"] = float(softcap)
    sinks = s_aux
    if sinks is None and isinstance(getattr(module, "sinks", None), torch.Tensor):
        sinks = module.sinks
    params = None
    if sinks is not None:
        params = {"sinks": sinks.reshape(-1)}
    mask = attention_mask
    if mask is None:
        causal = kwargs.get("is_causal", None)
        if causal is None:
            causal = getattr(module, "is_causal", True)
        opts["causal"] = bool(causal)
        if sliding_window is not None and causal:
            opts["window"] = int(sliding_window)
    elif isinstance(mask, PosencMask):
        if mask.kv_length != lk or mask.q_length != lq or mask.batch_size != b:
            _refuse(module, f"a mask made for {mask.q_length} queries and {mask.kv_length} keys "
                    f"(batch {mask.batch_size}) reached a layer with {lq} queries and {lk} keys "
                    f"(batch {b})")
        if mask.dense is not None:
            opts["mask"] = mask.dense
            opts["allow_fully_masked"] = True
            opts["query_positions"] = mask.q_offset
            opts["key_positions"] = mask.kv_offset
        else:
            opts["causal"] = bool(mask.causal)
            if mask.window is not None:
                opts["window"] = int(mask.window)
            if mask.chunk is not None:
                opts["chunk"] = int(mask.chunk)
            if mask.positions is not None:
                pos = mask.positions.to(torch.int64).expand(b, lq)
                qpos = kpos = pos
            else:
                qpos, kpos = mask.q_offset, mask.kv_offset
            if mask.chunk_shift is not None:
                shift = mask.chunk_shift.to(torch.int64).reshape(b, 1)
                if isinstance(qpos, int):
                    qpos = torch.arange(lq, dtype=torch.int64, device=shift.device) + qpos
                    kpos = torch.arange(lk, dtype=torch.int64, device=shift.device) + kpos
                qpos, kpos = qpos + shift, kpos + shift
            if isinstance(qpos, torch.Tensor) and qpos.dim() == 1:
                qpos, kpos = qpos.expand(b, lq), kpos.expand(b, lk)
            opts["query_positions"] = qpos.contiguous() if isinstance(qpos, torch.Tensor) else qpos
            opts["key_positions"] = kpos.contiguous() if isinstance(kpos, torch.Tensor) else kpos
            docs = mask.documents
            pad = mask.padding
            if docs is not None or pad is not None:
                if docs is None:
                    qdocs = torch.zeros(b, lq, dtype=torch.int32, device=query.device)
                    kdocs = torch.zeros(b, lk, dtype=torch.int32, device=query.device)
                else:
                    docs = docs.to(torch.int64).expand(b, lq)
                    docs = docs - docs.min()
                    qdocs = kdocs = docs.to(torch.int32)
                if pad is not None:
                    # a padding key gets a document id that no query has
                    outside = int(qdocs.max()) + 1
                    kdocs = kdocs.to(pad.device)
                    kdocs = torch.where(pad.to(torch.bool), kdocs,
                                        torch.full_like(kdocs, outside))
                    opts["allow_fully_masked"] = True  # the queries at padding positions
                opts["query_documents"] = qdocs.contiguous()
                opts["key_documents"] = kdocs.contiguous()
    elif isinstance(mask, torch.Tensor):
        dense = _dense_from_tensor(module, mask, lq, lk)
        opts["mask"] = dense
        opts["allow_fully_masked"] = True
        opts["query_positions"] = lk - lq if lk >= lq else 0
        opts["key_positions"] = 0
    else:
        _refuse(module, f"an attention mask of type {type(mask).__name__} (a flex BlockMask is "
                "made for attn_implementation='flex_attention')")
    if sinks is not None:
        opts["allow_fully_masked"] = True
    if "window" in opts and opts["window"] < 1:
        _refuse(module, f"a sliding window of {opts['window']}")
    # Query rows that see no key (the padding positions of a left-padded batch): eager attention
    # adds the dtype's minimum to every score of such a row, so its softmax is uniform over all
    # the keys, and autograd still carries the scores' gradient through it. posenc gives the same
    # rows the same output and gradients (_uniform_rows), so that a left-padded training step
    # whose labels score the last pad position has eager's loss and gradients.
    fix_empty = opts.get("allow_fully_masked", False) and sinks is None and lk > 0
    try:
        if fix_empty:
            out, lse = pt.attention(q, k, v, None, params=params, return_lse=True, **opts)
        else:
            out = pt.attention(q, k, v, None, params=params, **opts)
    except (ValueError, TypeError) as err:
        raise type(err)(f"posenc: {_model_name(module)}: {err}") from err
    if fix_empty:
        empty = torch.isneginf(lse)  # [batch, heads, q_len]
        if bool(empty.any()):
            scale = opts.get("scale", 1.0 / math.sqrt(d))
            out = _uniform_rows(out, q, k, v, empty, scale, opts.get("softcap"))
    return out, None


def _uniform_rows(out, q, k, v, empty, scale, softcap):
    """out with the rows `empty` [batch, heads, q_len] replaced by eager's value for a row whose
    every score is masked: the mean of v over all keys, with the gradient of a softmax at uniform
    weights (through the scores, as eager's autograd has it: the weights are softmax(s - s), whose
    value is uniform and whose gradient is the softmax's). O(rows x keys) extra memory."""
    bi, hi, ii = empty.nonzero(as_tuple=True)
    group = q.shape[2] // k.shape[2]
    wide = torch.promote_types(q.dtype, torch.float32)  # float64 models stay float64
    qr = q[bi, ii, hi].to(wide)                 # [n, d]
    kr = k[bi, :, hi // group].to(wide)         # [n, keys, d]
    vr = v[bi, :, hi // group].to(wide)         # [n, keys, v_dim]
    s = torch.einsum("nd,nkd->nk", qr, kr) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    p = torch.softmax(s - s.detach(), dim=-1)
    rows = torch.einsum("nk,nkd->nd", p, vr).to(out.dtype)
    return out.index_put((bi, ii, hi), rows)


def register():
    """Registers "posenc" with transformers' AttentionInterface and AttentionMaskInterface.

    After it, ``AutoModelForCausalLM.from_config(cfg, attn_implementation="posenc")`` (or
    ``from_pretrained(..., attn_implementation="posenc")``, or ``model.set_attn_implementation
    ("posenc")``) runs posenc's fused attention in every attention layer of the model. Calling it
    again is harmless. Returns the implementation's name, "posenc"."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("posenc.hf.register needs the transformers package (pip install "
                          "transformers)") from err
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, posenc_mask)
    return NAME

