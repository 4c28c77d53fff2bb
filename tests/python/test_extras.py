"""posenc.check(), rope_precision(), the figures, the demo page and the benchmark suite."""

import os

import numpy as np

import posenc


def test_check_rows_measure_the_seeds_claims():
    rows = posenc.check()
    assert len(rows) >= 10
    assert all(isinstance(r, posenc.CheckRow) for r in rows)
    assert all(r.passed for r in rows), [r for r in rows if not r.passed]
    schemes = {r.scheme for r in rows}
    assert {"none", "sinusoidal", "rope", "alibi", "t5"} <= schemes
    dot = [r for r in rows if "7.4852" in r.expect]
    assert dot and abs(dot[0].measured - 7.4852) < 5e-5


def test_rope_precision_rows():
    rows = posenc.rope_precision([1 << 16, 1 << 20])
    assert [r.position for r in rows] == [1 << 16, 1 << 20]
    assert all(r.accurate_error < 1e-6 for r in rows)
    assert rows[1].float32_error > 10 * rows[1].accurate_error


def test_plots_write_png_and_svg_and_return_bytes(tmp_path):
    path = posenc.plot.heatmap(out=tmp_path / "h.png", length=16, dim=32)
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    svg = posenc.plot.bias(out=str(tmp_path / "b.svg"), scheme="t5", length=12, causal=True)
    assert open(svg).read(200).lstrip().startswith("<?xml") or "<svg" in open(svg).read()
    data = posenc.plot.similarity(scheme="alibi", max_offset=8, width=300)
    assert data[:4] == b"\x89PNG"
    for kind in (posenc.plot.clock, posenc.plot.rope_rotation, posenc.plot.attention,
                 posenc.plot.extrapolation):
        assert kind(width=300)[:4] == b"\x89PNG"
    table = np.random.default_rng(0).standard_normal((20, 16)).astype(np.float32)
    assert posenc.plot.heatmap_table(table, length=0)[:4] == b"\x89PNG"
    assert set(posenc.plot.kinds) >= {"heatmap", "clock", "bias"}


def test_demo_writes_the_page(tmp_path):
    index = posenc.demo(tmp_path / "demo", skip_checks=True, format="svg")
    assert os.path.exists(index)
    assert len([f for f in os.listdir(tmp_path / "demo") if f.endswith(".svg")]) >= 5


def test_bench_quick_entry():
    rows = posenc.bench(quick=True, filter="rope_neox", threads=1)
    assert rows and rows[0]["name"].startswith("rope_neox")
    assert rows[0]["median_s"] > 0 and rows[0]["gbps"] > 0


def test_bench_fma_peak_and_vs_fma_peak():
    """fma_peak names its target; a compute-bound entry gets vs_fma_peak = its GFLOP/s over the
    peak's; a bandwidth entry gets none; "=NAME" selects that name only."""
    rows = posenc.bench(quick=True, filter="fma_peak,=sgemm,rope_neox", threads=1)
    by = {r["name"]: r for r in rows}
    assert set(by) == {"fma_peak", "sgemm"} | {n for n in by if n.startswith("rope_neox")}
    peak = by["fma_peak"]
    assert peak["gflops"] > 0 and peak["target"] and peak["lanes"] >= 1 and peak["chains"] >= 8
    assert "vs_fma_peak" not in peak
    assert abs(by["sgemm"]["vs_fma_peak"] - by["sgemm"]["gflops"] / peak["gflops"]) <= 1e-12
    assert all("vs_fma_peak" not in r for n, r in by.items() if n.startswith("rope_neox"))


def test_the_core_module_loads_without_the_figures_and_the_benchmarks():
    """import posenc loads the core extension only; posenc.plot and posenc.bench load the extras
    module (cairo, the benchmark harness) on first use, and its errors are posenc's."""
    import subprocess
    import sys
    code = ("import sys, posenc\n"
            "assert 'posenc._posenc_extras' not in sys.modules\n"
            "posenc.attention\n"
            "assert 'posenc._posenc_extras' not in sys.modules\n"
            "png = posenc.plot.heatmap(length=8, dim=8)\n"
            "assert png[:4] == b'\\x89PNG' and 'posenc._posenc_extras' in sys.modules\n"
            "try:\n"
            "    posenc.plot.heatmap(length=-1, dim=8)\n"
            "except posenc.InvalidValueError as e:\n"
            "    assert 'length' in str(e)\n"
            "else:\n"
            "    raise AssertionError('accepted length=-1')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
