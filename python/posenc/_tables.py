"""Which axis of each parameter table indexes the heads, for the code that reads a head count
from the tables (posenc.testing) or slices them to a subset of heads (posenc.torch.distributed).

Read from the scheme registry (posenc.schemes(): each param's declared "head_axis"), plus the
tables that every scheme takes and no scheme lists (the attention sinks, one logit per query
head). Tables without a head axis (Transformer-XL's r_net, [heads * head_dim, d_model]) or with
more than one form (Shaw's rel_k / rel_v, [2K+1, head_dim] or [2K+1, heads, head_dim]) are not
in TABLE_HEAD_AXIS: their users handle them by name.
"""

from . import _posenc

# Tables outside the registry's params: the attention sinks [heads].
EXTRA_TABLE_HEAD_AXIS = {"sinks": 0}

TABLE_HEAD_AXIS = {p["name"]: p["head_axis"] for s in _posenc.schemes() for p in s["params"]
                   if p["head_axis"] is not None}
TABLE_HEAD_AXIS.update(EXTRA_TABLE_HEAD_AXIS)
