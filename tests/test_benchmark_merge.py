"""benchmarks/compile.py --merge: budgets measured over several device calls end up in one file."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _compile_benchmark():
    spec = importlib.util.spec_from_file_location("compile_benchmark", ROOT / "benchmarks" / "compile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_merge_keeps_every_part_and_all_budgets_measured_over_several_calls(tmp_path):
    parts = {
        "frontier.json": {"environment": {"date": "a"}, "frontier": [1], "compile_frontier": [2]},
        "first.json": {"environment": {"date": "b"}, "budgets": [{"fraction": 0.6, "img_s": 1.0}]},
        "second.json": {"budgets": [{"fraction": 0.35, "img_s": 3.0}, {"fraction": 0.6, "img_s": 2.0}]},
    }
    for name, data in parts.items():
        (tmp_path / name).write_text(json.dumps(data))
    merged = _compile_benchmark().merge([str(tmp_path / name) for name in parts])
    assert merged["frontier"] == [1] and merged["compile_frontier"] == [2]
    assert [(r["fraction"], r["img_s"]) for r in merged["budgets"]] == [(0.6, 2.0), (0.35, 3.0)]  # the later 0.6
    assert merged["environment"] == {"date": "b"}
