"""posenc.hf.patch: fused positional attention for the bias families."""


def patch(model):
    raise NotImplementedError("posenc.hf.patch is not built yet")
