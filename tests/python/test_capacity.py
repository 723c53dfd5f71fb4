"""zeroshard capacity (zeroshard.capacity): the largest model found by really training is bracketed
to the resolution (a fitting trial at the answer, a failing one just above it, for the reason the
budget names), its ledger peaks are within the budgets, the plan equals the ledger at every trial,
and the report and its three plots are written."""
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

pytest.importorskip("matplotlib")
from zeroshard import capacity  # noqa: E402

GIB = float(1 << 30)


def test_finds_the_largest_model_within_the_budgets(tmp_path, capsys):
    out, swap = tmp_path / "out", tmp_path / "swap"
    swap.mkdir()
    args = ["--memory-gib", "0.06", "--nvme-gib", "0.03", "--nvme-path", str(swap),
            "--configs", "1:device:device,3:nvme:nvme", "--units", "4", "--steps", "1",
            "--resolution", "0.05", "--out", str(out)]
    assert capacity.main(args) == 0
    rep = json.loads((out / "report.json").read_text())
    assert [(r["stage"], r["optimizer"], r["params_tier"]) for r in rep["results"]] == [
        (1, "device", "device"), (3, "nvme", "nvme")]
    for r in rep["results"]:
        trials = r["trials"]
        fit = [t for t in trials if t["fits"]]
        fail = [t for t in trials if not t["fits"]]
        assert fit and fail, r
        best = max(fit, key=lambda t: t["params"])
        assert best["params"] == r["largest"] > 0
        above = min((t for t in fail if t["params"] > best["params"]), key=lambda t: t["params"])
        assert above["params"] <= best["params"] * 1.05 + 4 * 2, (best, above)
        # The budget that stops the larger model is the one this configuration fills.
        assert above["why_not"] == ("memory" if r["optimizer"] == "device" else "nvme"), above
        assert best["peak"]["device"] + best["peak"]["host"] <= 0.06 * GIB
        assert best["peak"]["nvme"] <= 0.03 * GIB
        assert best["step_s"] > 0
        for t in trials:  # the planner's bytes are the engine's
            if "ledger" in t:
                assert t["planned"] == t["ledger"], t
        # The planner's answer is the real one within the resolution.
        assert abs(r["planned_largest"] - r["largest"]) <= 0.05 * r["largest"] + 16
    md = (out / "report.md").read_text()
    assert "| 1 | device | device |" in md and "| 3 | nvme | nvme |" in md
    for name in ("bytes_per_tier.svg", "step_time.svg", "largest_model.svg"):
        root = ET.parse(out / name).getroot()
        assert root.tag.endswith("svg"), name
    err = capsys.readouterr().err
    assert "[####################] largest" in err  # the progress bar, completed
    assert os.listdir(swap) == []  # every trial's swap files are gone


def test_refuses_budgets_it_cannot_try(tmp_path):
    with pytest.raises(SystemExit):
        capacity.main(["--memory-gib", "100000", "--out", str(tmp_path)])  # above this machine
    with pytest.raises(SystemExit):
        capacity.main(["--memory-gib", "0.01", "--nvme-gib", "1", "--out", str(tmp_path)])
    r = subprocess.run([sys.executable, "-m", "zeroshard.capacity", "--memory-gib", "0.01",
                        "--configs", "3:nvme:nvme", "--out", str(tmp_path)],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "needs --nvme-path and --nvme-gib" in r.stderr
