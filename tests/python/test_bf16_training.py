"""bf16 training with POSENC_BF16_DOT=1: float32 tensors holding bf16 values (what
posenc.torch.attention computes on for bf16 tensors that need gradients), the output and the
gradients against the float64 reference and against the float32 products. On a processor with
AVX512_BF16 the switch makes the score tiles come from vdpbf16ps, so the bits differ from the
float32 products' (the path ran) within the same bound; elsewhere they are the same bits. The switch is read once per
process: each setting runs in its own interpreter."""
import os
import subprocess
import sys

import pytest
import torch

SCRIPT = r"""
import sys
import torch
import posenc.torch as pt

torch.manual_seed(0)
B, L, H, HK, D = 1, 77, 4, 2, 40
def b16(*shape):
    return torch.randn(*shape).bfloat16().float()
q, k, v = b16(B, L, H, D), b16(B, L, HK, D), b16(B, L, HK, D)
w = b16(B, L, H, D)   # the gradient of the output: bf16 values too
grads = {}
for scheme, kw in (("none", {}), ("alibi", {}), ("rope", {})):
    for dtype in (torch.float32, torch.float64):
        xs = [x.detach().to(dtype).clone().requires_grad_() for x in (q, k, v)]
        out = pt.attention(*xs, scheme, causal=True, **kw)
        (out * w.to(dtype)).sum().backward()
        grads[(scheme, str(dtype))] = [out.detach()] + [x.grad for x in xs]
torch.save(grads, sys.argv[1])
"""


def _grads(tmp_path, setting):
    path = tmp_path / f"grads_{setting}.pt"
    env = dict(os.environ, POSENC_BF16_DOT=setting)
    subprocess.run([sys.executable, "-c", SCRIPT, str(path)], env=env, check=True, timeout=300)
    return torch.load(path)


def _has_avx512_bf16():
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " avx512_bf16" in line for line in f)
    except OSError:
        return False


def test_bf16_values_with_the_switch(tmp_path):
    on, off = _grads(tmp_path, "1"), _grads(tmp_path, "0")
    for scheme in ("none", "alibi", "rope"):
        ref = on[(scheme, "torch.float64")]
        for name, a, b, r in zip(("out", "dq", "dk", "dv"), on[(scheme, "torch.float32")],
                                 off[(scheme, "torch.float32")], ref):
            scale = max(1.0, r.abs().max().item())
            for got in (a, b):
                err = (got.double() - r).abs().max().item()
                assert err <= 1e-5 * scale, f"{scheme} {name}: error {err} (max |ref| {scale})"
            same = torch.equal(a, b)
            if scheme == "rope" or not _has_avx512_bf16():
                # RoPE rotates its rows in float32; without the instruction the switch does nothing
                assert same, f"{scheme} {name}: bits changed without vdpbf16ps"
            else:
                assert not same, f"{scheme} {name}: the vdpbf16ps score tiles did not run"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
