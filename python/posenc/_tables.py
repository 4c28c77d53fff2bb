"""Which axis of each parameter table indexes the heads, for the code that reads a head count
from the tables (posenc.testing) or slices them to a subset of heads (posenc.torch.distributed).

Read from the scheme registry (posenc.schemes(): each param's "layout", e.g. "[num_buckets,
heads]", gives the head axis as the place of "heads"), plus the tables that every scheme takes
and no scheme lists (EXTRA_TABLE_LAYOUTS). Tables whose layout has no "heads" entry (Transformer-
XL's r_net, [heads * head_dim, d_model]) or more than one form (Shaw's rel_k / rel_v, [2K+1,
head_dim] or [2K+1, heads, head_dim]) are not in TABLE_HEAD_AXIS: their users handle them by
name.
"""

from . import _posenc

# Tables outside the registry's params, in its layout notation (docs/attention.md, Parameter
# names): the attention sinks, one logit per query head.
EXTRA_TABLE_LAYOUTS = {"sinks": "[heads]"}


def _head_axes(layouts):
    """{name: axis} for the layouts (name, layout string) with one form and a "heads" entry."""
    axes = {}
    for name, layout in layouts:
        if " or " in layout:
            continue
        dims = [d.strip() for d in layout.strip().strip("[]").split(",")]
        if "heads" in dims:
            axes[name] = dims.index("heads")
    return axes


TABLE_HEAD_AXIS = _head_axes(
    [(p["name"], p["layout"]) for s in _posenc.schemes() for p in s["params"]]
    + list(EXTRA_TABLE_LAYOUTS.items()))
