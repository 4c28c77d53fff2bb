"""The extrapolation experiment (posenc.experiments.extrapolation, docs/extrapolation.md): its
--quick run as that page gives it (every scheme trains, evaluation at 4 x L_train runs, the
float32 fused training matches the float64 reference), the corpus split, and merging seeds.
Nothing here asserts which scheme extrapolates best."""

import copy
import json
import math
import os
import shutil
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")
from posenc.experiments import extrapolation as ex  # noqa: E402

ALL = list(ex.SCHEMES)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A fresh cache directory, so that the run extracts the KJV itself."""
    if shutil.which("bible") is None:
        pytest.skip("Debian's bible-kjv is not installed (bash scripts/deps.sh installs it)")
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def quick(tmp_path_factory, cache):
    out = tmp_path_factory.mktemp("quick")
    env = dict(os.environ, XDG_CACHE_HOME=str(cache))
    t = time.time()
    r = subprocess.run([sys.executable, "-m", "posenc.experiments.extrapolation", "--quick",
                        "--out", str(out)], env=env, capture_output=True, text=True,
                       timeout=600)
    seconds = time.time() - t
    assert r.returncode == 0, r.stderr[-3000:]
    with open(out / "results.json") as f:
        return out, json.load(f), r, seconds


def test_quick_run_trains_every_scheme_and_evaluates_at_4x(quick):
    out, res, r, seconds = quick
    assert seconds < 180, seconds
    s = res["settings"]
    assert s["quick"] and s["schemes"] == ALL and s["seeds"] == [0]
    lt = s["train_length"]
    assert set(res["schemes"]) == set(ALL)
    for name, v in res["schemes"].items():
        run = v["by_seed"]["0"]
        assert run["final_train_loss"] < run["first_train_loss"] - 1.0, (name, run)
        assert v["lengths"] == [lt, 2 * lt, 4 * lt]
        assert len(v["train_loss"]) == len(v["train_loss_steps"]) >= 2
        assert v["train_loss"][-1] < v["train_loss"][0], name
        assert v["seconds"] > 0
        if name == "learned":
            # The table has L_train rows: longer windows are refused by posenc, not clamped.
            assert v["ppl"][0] is not None and v["ppl"][1:] == [None, None]
            assert "cannot extrapolate" in v["eval_errors"][str(4 * lt)]
        else:
            assert all(p is not None and 1 < p < 256 for p in v["ppl"]), (name, v["ppl"])
            assert v["eval_errors"] == {}
            assert len(v["position_nll"]) == 4  # chunks of L_train in windows of 4 x L_train
    assert "ETA" in r.stderr and "tok/s" in r.stderr


def test_quick_run_float32_fused_training_matches_the_float64_reference(quick):
    _, res, _, _ = quick
    chk = res["reference_check"]
    assert set(chk["schemes"]) == set(ALL)
    for name, c in chk["schemes"].items():
        assert len(c["float32"]) == len(c["float64"]) == c["steps"] >= 8
        # float32 rounding drift only ...
        assert c["max_relative_difference"] <= chk["tolerance"] <= 2e-6, (name, c)
        # ... while leaving out the scheme's contribution (or its table gradients) shows.
        if name != "nope":
            assert c["control_relative_difference"] > 10 * chk["tolerance"], (name, c)


def test_quick_run_writes_table_and_figures(quick):
    out, res, r, _ = quick
    md = (out / "results.md").read_text()
    assert "| scheme |" in md and "| ALiBi |" in md and "cannot extrapolate" in md
    assert r.stdout == md
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pytest.skip("python3-matplotlib not installed: no figures")
    for stem in ("extrapolation", "position-loss"):
        assert (out / f"{stem}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert "<svg" in (out / f"{stem}.svg").read_text()[:2000]


def test_kjv_split_by_book(quick, cache):
    raw = (cache / "posenc" / "kjv.txt").read_text()
    train, valid, info = ex.kjv_split(raw)
    assert info["valid_books"] == ["Josh", "Eccl", "Mark", "Rom"]
    assert len(info["train_books"]) == 62
    assert train.startswith("In the beginning God created the heaven and the earth.\n")
    assert valid.startswith("Now after the death of Moses the servant of the LORD")  # Joshua 1:1
    assert valid.endswith("Jesus Christ for ever. Amen.\n\n")  # Romans 16:27
    assert len(train.encode()) > 3_000_000 and 200_000 < len(valid.encode()) < 400_000
    assert "Now after the death of Moses" not in train and "In the beginning" not in valid
    assert not any(ch.isdigit() for ch in valid[:5000])  # references removed
    _, res, _, _ = quick
    assert res["settings"]["corpus_info"]["train_bytes"] == len(train.encode())
    with pytest.raises(ValueError, match="unknown validation books"):
        ex.kjv_split(raw, valid_books=("Mark", "Gospel of Thomas"))


def test_merge_seeds_gives_mean_and_spread(quick, tmp_path):
    out, res, _, _ = quick
    other = copy.deepcopy(res)
    other["settings"]["seeds"] = [1]
    for v in other["schemes"].values():
        run = v["by_seed"].pop("0")
        run["ppl"] = [None if p is None else p * 1.5 for p in run["ppl"]]
        v["by_seed"]["1"] = run
    (tmp_path / "s1").mkdir()
    (tmp_path / "s1" / "results.json").write_text(json.dumps(other))
    merged = ex.merge([str(out), str(tmp_path / "s1")], str(tmp_path / "m"))
    assert merged["settings"]["seeds"] == [0, 1]
    for name, v in merged["schemes"].items():
        assert v["seeds"] == [0, 1]
        for p, lo, hi, p0 in zip(v["ppl"], v["ppl_min"], v["ppl_max"],
                                 res["schemes"][name]["ppl"]):
            if p0 is None:
                assert p is None
            else:
                assert math.isclose(lo, p0) and math.isclose(hi, 1.5 * p0)
                assert math.isclose(p, 1.25 * p0)
    assert "[" in (tmp_path / "m" / "results.md").read_text()  # the spread in brackets
    other["settings"]["steps"] += 1
    (tmp_path / "s1" / "results.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="differs in steps"):
        ex.merge([str(out), str(tmp_path / "s1")], str(tmp_path / "m2"))
