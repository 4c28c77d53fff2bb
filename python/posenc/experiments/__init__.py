"""posenc.experiments: experiments that train models on posenc's attention (need PyTorch).

extrapolation: train short, test long (Press, Smith & Lewis, ICLR 2022, Figure 1) with a small
byte-level language model per positional scheme; ``python3 -m posenc.experiments.extrapolation``
(docs/extrapolation.md).
"""
