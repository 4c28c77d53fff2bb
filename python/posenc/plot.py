"""posenc.plot: the figures of `posenc plot` (docs/plots.md), drawn by the C++ library.

Each function takes out= (a .png or .svg path, written atomically; returns the path; without it
the PNG bytes are returned), scale= (PNG pixel scale) and the figure's options as keywords, e.g.
``posenc.plot.heatmap(out="pe.png", length=32, dim=64)`` or
``posenc.plot.similarity(out="s.svg", scheme="rope", model="config.json")``.
"""

from ._posenc_extras import plot as _plot  # the figures (cairo), apart from the core module

heatmap = _plot.heatmap
heatmap_table = _plot.heatmap_table
clock = _plot.clock
similarity = _plot.similarity
rope_rotation = _plot.rope_rotation
bias = _plot.bias
attention = _plot.attention
extrapolation = _plot.extrapolation
kinds = list(_plot.kinds)

__all__ = ["heatmap", "heatmap_table", "clock", "similarity", "rope_rotation", "bias",
           "attention", "extrapolation", "kinds"]
