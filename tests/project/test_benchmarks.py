"""The benchmark scripts' own logic: compile.py --merge keeps budgets measured over several device calls, and
compile_peak.py reads what is alive at a step's peak from the allocator's events, families.py checks the
issue's goals and runs every row, coverage.py writes a row per model with a summary and prints its table."""

import importlib.util
import json
import statistics
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _benchmark(name):
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _smoke(module, argv, monkeypatch) -> None:
    """Run a benchmark's ``main()`` with ``argv``; the smoke run takes one thread, given back after it."""
    import torch

    monkeypatch.setattr("sys.argv", argv)
    threads = torch.get_num_threads()
    try:
        module.main()
    finally:
        torch.set_num_threads(threads)


def test_merge_keeps_every_part_and_all_budgets_measured_over_several_calls(tmp_path):
    parts = {
        "frontier.json": {"environment": {"date": "a"}, "frontier": [1], "compile_frontier": [2]},
        "first.json": {"environment": {"date": "b"}, "budgets": [{"fraction": 0.6, "img_s": 1.0}]},
        "second.json": {"budgets": [{"fraction": 0.35, "img_s": 3.0}, {"fraction": 0.6, "img_s": 2.0}]},
    }
    for name, data in parts.items():
        (tmp_path / name).write_text(json.dumps(data))
    merged = _benchmark("compile").merge([str(tmp_path / name) for name in parts])
    assert merged["frontier"] == [1] and merged["compile_frontier"] == [2]
    assert [(r["fraction"], r["img_s"]) for r in merged["budgets"]] == [(0.6, 2.0), (0.35, 3.0)]  # the later 0.6
    assert merged["environment"] == {"date": "b"}


def test_peak_breakdown_splits_what_is_alive_at_the_peak_by_phase_and_line():
    def alloc(addr, size, line):
        return {"action": "alloc", "addr": addr, "size": size, "frames": [{"filename": "/x/model.py", "line": line}]}

    trace = [
        alloc(1, 100, 10),  # forward: a saved tensor, alive to the end
        alloc(2, 50, 11),  # forward: freed before the peak
        {"action": "free_completed", "addr": 2},
        alloc(3, 30, 20),  # backward from here
        {"action": "free_requested", "addr": 3},  # requested only, not yet completed: still counted
        alloc(4, 40, 20),
        {"action": "free_completed", "addr": 1},
        alloc(5, 10, 21),
    ]
    result = _benchmark("compile_peak").peak_breakdown(trace, backward_from=3)
    assert result["peak_bytes_in_step"] == 170 and result["peak_event"] == 5 and result["peak_in"] == "backward"
    assert result["alive_at_peak_by_phase"] == {"forward": 100, "backward": 70}
    assert [(r["where"].split(" ")[0], r["where"].split(":")[1].split(" ")[0], r["bytes"]) for r in
            result["alive_at_peak_by_line"]] == [("forward", "10", 100), ("backward", "20", 70)]  # fmt: skip


def test_multigpu_summary_compares_every_rank():
    def rank(r, choice, peaks, rate):
        return {
            "rank": r,
            "oom": {"choice": 512, "trials": [], "trained_steps": 20, "seconds": 9.0},
            "compiled": {
                "choice": choice,
                "search_s": 1.0,
                "compile_s": 0.5,
                "choice_img_s": rate,
                "oracle_img_s": 100,
            },
            "strategy": {
                "runs": [["layer1.0"]],
                "budget_bytes": 100 if r == 0 else None,  # rank zero's plan
                "step_peaks_bytes": peaks,
                "same_weights_as_plain_ddp": True,
                "max_weight_difference": 0.0,
                "plain_vs_plain_difference": 0.0,
            },
        }

    summary = _benchmark("multigpu").summarize([rank(0, 256, [90, 95], 98.0), rank(1, 256, [99, 101], 97.5)])
    assert summary["compiled"]["same_choice_on_every_rank"] and summary["compiled"]["choice_vs_oracle"] == [0.98, 0.975]
    strategy = summary["strategy"]
    assert strategy["peak_bytes_per_rank"] == [95, 101] and strategy["held_on_every_rank"] is False  # rank 1: 101
    assert summary["oom"]["same_choice_on_every_rank"] and "tuning" not in summary


def test_multigpu_summary_of_the_sharded_parts_compares_every_rank_and_keeps_a_refusal():
    def rank(r, micro, table, budget):
        return {
            "rank": r,
            "fsdp": {"skipped": "Lightning builds FSDPStrategy only on a GPU"},
            "model_parallel": {
                "choice": {"micro_batch": micro, "accumulate": 2},
                "weights_put_back": True,
                "logged_samples_per_sec": 60.0,
                "table_samples_per_sec": table,
                "budget": budget,
            },
        }

    runs = {"runs": [["net.layer4.0"]], "budget_bytes": 100, "step_peaks_bytes": [90, 95]}
    summary = _benchmark("multigpu").summarize(
        [rank(0, 8, 60.0, runs), rank(1, 8, 60.0, {**runs, "budget_bytes": None})]
    )
    parallel = summary["model_parallel"]
    assert parallel["same_choice_on_every_rank"] and parallel["weights_put_back_on_every_rank"]
    assert parallel["every_rank_holds_the_logged_figure"]
    assert parallel["budget"]["same_runs_on_every_rank"] and parallel["budget"]["peak_bytes_per_rank"] == [95, 95]
    assert summary["fsdp"] == {"skipped": "Lightning builds FSDPStrategy only on a GPU"}
    refused = {"refused": "ActivationCheckpointing(memory_budget=...) under FSDPStrategy on several devices ..."}
    parted = _benchmark("multigpu").summarize([rank(0, 8, 60.0, refused), rank(1, 16, 30.0, refused)])
    assert not parted["model_parallel"]["same_choice_on_every_rank"]
    assert not parted["model_parallel"]["every_rank_holds_the_logged_figure"]
    assert parted["model_parallel"]["budget"] == refused


def test_the_savings_goal_finds_where_ours_is_slower_than_compiles_own_setting_at_that_memory():
    frontier = [
        {"setting": "eager", "peak_bytes": 1000},
        {"setting": "compile", "peak_bytes": 950, "img_s": 10.0},
        {"setting": "compile_activation_memory_budget_0.8", "peak_bytes": 600, "img_s": 8.0},  # saves 40 %
        {"setting": "compile_activation_memory_budget_0.5", "peak_bytes": 550, "img_s": 7.0},  # 45 %
        {"setting": "compile_every_block", "peak_bytes": 300, "img_s": 6.0},  # ours, not compile's own setting
    ]
    budgets = [
        {"fraction": 0.65, "train_peak_bytes": 601, "img_s": 8.1},  # 39.9 %: just short of the 0.8's 40 %
        {"fraction": 0.5, "train_peak_bytes": 500, "img_s": 7.5},  # 50 %
    ]
    goal = _benchmark("compile").savings_goal(frontier, budgets)
    # from 39.9 % to 40 % saved the fastest of ours is the 0.5 plan (7.5) against compile's 0.8 (8.0)
    assert [p["saving"] for p in goal["shortfalls"]] == [0.4]
    assert goal["shortfalls"][0]["ours"] == {"fraction": 0.5, "img_s": 7.5}
    assert goal["shortfalls"][0]["compile"]["setting"] == "compile_activation_memory_budget_0.8"
    assert goal["points"][-1] == {"saving": 0.57, "compile": None, "ours": None}  # neither saves 57 %
    budgets[0]["train_peak_bytes"] = 600  # the same memory as compile's 0.8, and faster: met everywhere
    assert _benchmark("compile").savings_goal(frontier, budgets)["shortfalls"] == []


def test_families_goals_compare_ours_with_the_family_switch_and_say_unmet_budgets():
    families = _benchmark("families")
    rows = {
        "plain": {"step_ms": 100.0, "activation_peak_gb": 10.0},
        "family_switch": {"step_ms": 200.0, "activation_peak_gb": 4.0},
        "ours_every_block": {"step_ms": 203.0, "activation_peak_gb": 4.0},
        "ours_budget_0.6": {"step_ms": 120.0, "activation_peak_gb": 6.0, "held": True, "summary": "..."},
        "ours_budget_0.4": {"step_ms": 150.0, "activation_peak_gb": 5.0, "held": False, "summary": "budget not met"},
    }
    families.compare(rows)
    assert rows["ours_budget_0.6"]["saved_pct"] == 40.0 and rows["family_switch"]["time_cost_pct"] == 100.0
    goals = families.goals("convnext_tiny", rows)
    assert goals["saves_at_least_as_much"] and goals["within_2pct_step_time"] and goals["met"]  # 1.5 % slower
    assert goals["within_2_points_of_switch_saving"]
    assert goals["budgets_held_or_said"] == {"ours_budget_0.6": True, "ours_budget_0.4": True}
    rows["ours_every_block"].update(step_ms=205.0, activation_peak_gb=4.1)
    families.compare(rows)
    goals = families.goals("gpt2", rows)
    assert not goals["saves_at_least_as_much"] and not goals["within_2pct_step_time"] and not goals["met"]
    assert "at_switch_point" not in goals  # none of ours saves as much
    # a budget that saves as much for less time is the family's point; a few MB less saving is as much
    rows["ours_budget_0.4"].update(step_ms=150.0, activation_peak_gb=4.005)
    families.compare(rows)
    goals = families.goals("gpt2", rows)
    assert goals["at_switch_point"]["row"] == "ours_budget_0.4" and goals["at_switch_point"]["met"]
    assert goals["at_switch_point"]["step_time_vs_switch_pct"] == -25.0
    # every lever planned, at half the switch's memory: against the switch, its budget said where not met
    said = "levers: ...; budget not met: the floor"
    rows["levers_half_switch"] = {"step_ms": 210.0, "activation_peak_gb": 2.0, "held": False, "summary": said,
                                  "kinds": {"block": ["h.0"]}}  # fmt: skip
    families.compare(rows)
    levers = families.goals("gpt2", rows)
    assert levers["levers_half_switch"] == {"memory_vs_switch": 0.5, "step_time_vs_switch": 1.05, "held": False,
                                            "kinds": ["block"]}  # fmt: skip
    assert levers["budgets_held_or_said"]["levers_half_switch"] and families.AT_SWITCH["levers_half_switch"] == 0.5
    # every block + the fused loss: judged on the step's peak; the activations alone beside it, where measured
    rows["fused_loss_every_block"] = {"step_ms": 200.0, "activation_peak_gb": 1.3, "activation_only_gb": 0.5}
    rows["family_switch"]["activation_only_gb"] = 2.0
    fused = families.goals("bert", rows)["fused_loss_every_block"]
    assert fused["memory_vs_switch"] == 1.3 / 4.0 and not fused["met"]  # 0.325x: the gradients and AdamW's step in it
    assert fused["activation_only_vs_switch"] == 0.25 and fused["met_on_activation_only"]
    del rows["fused_loss_every_block"], rows["family_switch"]["activation_only_gb"]
    assert families.switch_budget(rows, "levers_half_switch") == 2 * 10**9  # bytes: half the switch's 4 GB
    assert families.switch_budget(rows, "ours_below_switch") == 0.8 * 4.0 / 10.0  # a fraction of plain's peak
    del rows["levers_half_switch"]
    # torchvision's resnet50 has no switch: its budgets are still checked; the two rebuilds are compared alike
    del rows["family_switch"]
    assert families.goals("tv_resnet50", rows) == {"budgets_held_or_said": goals["budgets_held_or_said"]}
    measured = {"resnet50": {"rows": {"ours_rebuild": {"saved_pct": 43.7}}}}
    assert families.rebuild_goal(measured) is None  # torchvision's was not measured
    measured["tv_resnet50"] = {"rows": {"ours_rebuild": {"saved_pct": 42.0}}}
    assert families.rebuild_goal(measured)["within_2_points"]
    measured["tv_resnet50"]["rows"]["ours_rebuild"]["saved_pct"] = 40.0
    assert not families.rebuild_goal(measured)["within_2_points"]


def test_families_smoke_runs_every_row_of_a_language_model_and_writes_them(tmp_path, monkeypatch):
    pytest.importorskip("transformers")

    out = tmp_path / "families.json"
    families = _benchmark("families")
    _smoke(families, ["families.py", "--smoke", "--models", "llama", "--out", str(out), "--rounds", "2"], monkeypatch)
    result = json.loads(out.read_text())
    rows = result["models"]["llama"]["rows"]
    partial = families.partial_switch_exists()  # transformers' every_n_layers: the newest installs have it
    assert list(rows) == [
        "plain", "family_switch", *(["family_switch_every_2"] if partial else []), "ours_every_block",
        "fused_loss_every_block", "fused_loss_every_block_no_sync",
        "ours_at_switch_memory", "ours_at_switch_memory_blocks", "ours_below_switch", "ours_below_switch_blocks",
        "ours_budget_0.6",
        "ours_budget_0.6_blocks", "ours_budget_0.4", "levers_at_switch_memory", "levers_half_switch",
        *(["levers_at_every_2_memory"] if partial else []),
    ]  # fmt: skip
    if partial:  # every second layer: less saved than every layer, more than none; the levers judged against it
        saved = [rows[r]["saved_pct"] for r in ("family_switch_every_2", "family_switch")]
        assert 0 < saved[0] < saved[1]
        against = result["models"]["llama"]["goals"]["levers_at_every_2_memory"]
        levers, switch = rows["levers_at_every_2_memory"], rows["family_switch_every_2"]
        assert against["memory_vs_switch"] == levers["activation_peak_gb"] / switch["activation_peak_gb"]
        assert levers["held"]
    # every lever planned, the fused loss first: what the plan says, measured, and its calls
    levers = rows["levers_at_switch_memory"]
    assert levers["fused_loss"] and levers["calls"][0] == "apply_fused_loss(model)" and levers["summary"]
    assert "levers_half_switch" in result["models"]["llama"]["goals"]
    # the fused loss keeps no logits: less than every block alone
    assert rows["fused_loss_every_block"]["saved_pct"] > rows["ours_every_block"]["saved_pct"]
    assert rows["fused_loss_every_block_no_sync"]["saved_pct"] > rows["ours_every_block"]["saved_pct"]
    assert not [r["error"] for r in rows.values() if "error" in r]
    assert all("tokens_per_sec" in r and "saved_pct" in r for name, r in rows.items() if name != "plain")
    # the activations alone: on the CPU the bytes saved for backward, which hold no gradients
    assert all(r["activation_only_gb"] == r["activation_peak_gb"] > 0 for r in rows.values())
    assert "summary" in rows["ours_budget_0.4"] and "met" in result["models"]["llama"]["goals"]
    # the whole-blocks rows plan without finer links; the others may use them
    assert rows["ours_at_switch_memory_blocks"]["parts"] == [] == rows["ours_budget_0.6_blocks"]["parts"]
    # every row is timed again, all alive, in turns of a few steps (the first untimed), and keeps that median
    turns = 2 * (families.STEPS_PER_TURN - 1)
    assert all(len(r["step_ms_interleaved"]) == turns for r in rows.values())
    assert all(r["step_ms"] == statistics.median(r["step_ms_interleaved"]) for r in rows.values())
    at_switch = result["models"]["llama"]["goals"]["at_switch_memory"]
    assert at_switch["goal"] == 0.95 and at_switch["memory_vs_switch"] > 0
    assert result["environment"]["torch"]


def test_checkpoint_overhead_smoke_measures_every_row_and_profiles_the_switch_against_ours(tmp_path, monkeypatch):
    pytest.importorskip("timm")
    import math

    import torch

    module = _benchmark("checkpoint_overhead")
    out = tmp_path / "checkpoint_overhead.json"
    _smoke(module, ["checkpoint_overhead.py", "--smoke", "--profile", "--out", str(out)], monkeypatch)
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert list(rows) == [r for r in module.ROWS if r not in module.FUSED_ROWS]  # no vocabulary: no fused loss
    assert not [r["error"] for r in rows.values() if "error" in r]
    for name, row in rows.items():
        figures = [row["step_ms"], row["activation_peak_gb"], *row["phases"].values()]
        assert all(isinstance(v, float) and math.isfinite(v) for v in figures), (name, figures)
        assert name == "plain" or math.isfinite(row["vs_switch_pct"])
    assert rows["ours_every_block"]["blocks"] == rows["wrapper_nonreentrant"]["blocks"] > 0  # the same blocks
    assert all(rows[r]["profile"]["top_self_cpu"] for r in module.PROFILED)
    assert result["profile_diff"]["b"] == "ours_every_block" and result["all_rows_finite"]
    assert result["environment"]["timm"] and "use_reentrant" in result["timm_checkpointing"]
    # the ablations' monkeypatches are undone
    wrap = module.memguard_wrap
    assert wrap.checkpoint is torch.utils.checkpoint.checkpoint
    assert wrap.CheckpointedUnit.__dict__["forward"] is not module._minimal_forward


def test_checkpoint_overhead_on_a_language_model_sets_the_switchs_blocks_beside_ours_and_the_fused_loss(
    tmp_path, monkeypatch
):
    pytest.importorskip("transformers")

    module = _benchmark("checkpoint_overhead")
    out = tmp_path / "checkpoint_overhead.json"
    rows = "family_switch,ours_every_block,ours_switch_blocks,fused_loss_switch_blocks,ours_switch_blocks_but_last"
    rows += ",wrapper_reentrant"
    argv = ["checkpoint_overhead.py", "--model", "bert", "--smoke", "--rows", rows, "--out", str(out)]
    _smoke(module, argv, monkeypatch)
    result = json.loads(out.read_text())
    got = result["rows"]
    assert result["model"] == "bert" and result["environment"]["transformers"] and result["timm_checkpointing"] is None
    # ours checkpoints the embeddings' stem as well; the switch's own blocks are the encoder's layers
    assert got["ours_switch_blocks"]["checkpointed"] == ["model.bert.encoder.layer.0", "model.bert.encoder.layer.1"]
    assert got["ours_every_block"]["blocks"] == 3
    assert got["ours_switch_blocks_but_last"]["checkpointed"] == ["model.bert.encoder.layer.0"]
    assert got["ours_switch_blocks"]["activation_peak_gb"] == got["family_switch"]["activation_peak_gb"]
    fused = got["fused_loss_switch_blocks"]
    assert fused["fused_loss"] and fused["activation_peak_gb"] < got["ours_switch_blocks"]["activation_peak_gb"]
    assert "wraps single-input blocks: the vision models only, not bert" in got["wrapper_reentrant"]["error"]


def test_coverage_writes_a_row_per_model_with_a_summary_and_prints_its_table(tmp_path, monkeypatch, capsys):
    pytest.importorskip("timm")
    pytest.importorskip("transformers")
    module = _benchmark("coverage")
    out = tmp_path / "coverage.json"
    monkeypatch.setattr("sys.argv", ["coverage.py", "--fast", "--models", "test_resnet,gpt2", "--out", str(out)])
    module.main()
    result = json.loads(out.read_text())
    assert [(r["library"], r["model"], r["covered"]) for r in result["rows"]] == [
        ("timm", "test_resnet", True),
        ("hf", "gpt2", True),
    ]
    assert result["rows"][1]["loss"] == "fused"  # the fused loss gives GPT2LMHeadModel its plain loss and gradients
    assert result["summary"]["timm"] == {
        "models": 1, "built": 1, "covered": 1, "with_switch": 1, "with_switch_covered": 1,
        "with_switch_not_covered": {}, "keeps_more_than_switch": {}, "not_covered": {}
    }  # fmt: skip
    assert result["environment"]["timm"] and result["environment"]["transformers"]
    capsys.readouterr()
    monkeypatch.setattr("sys.argv", ["coverage.py", "--table", "--out", str(out)])
    module.main()
    table = capsys.readouterr().out
    assert "## timm" in table and "| resnet | test_resnet | yes | " in table
    assert "covered, or why not | loss |" in table and table.rstrip().splitlines()[-1].endswith("| fused |")


def test_a_results_environment_names_the_model_libraries_it_ran_with():
    import timm
    import transformers

    found = _benchmark("families").environment()  # the shared record every benchmark writes
    assert found["transformers"] == transformers.__version__ and found["timm"] == timm.__version__
    assert {"gpu", "torch", "lightning", "python", "date"} <= found.keys()


def test_autocast_cache_trials_put_the_old_behaviour_back_only_inside_and_count_the_checkpointed_weights():
    import torch
    from torch import nn

    from lightning_memguard.checkpointing import checkpoint_blocks, wrap

    seen = []

    class Layer(nn.Linear):
        def forward(self, x):
            seen.append(torch.is_autocast_cache_enabled())  # inside the checkpoint
            return super().forward(x)

    bench = _benchmark("autocast_cache")
    model = nn.Sequential(Layer(8, 8), Layer(8, 8), nn.Linear(8, 3, bias=False))
    checkpoint_blocks(model, units=["0", "1"])
    assert bench.checkpointed_weight_bytes(model) == 2 * (8 * 8 + 8) * 2  # two layers' weights and biases, in bf16

    def cache_on_inside_blocks():
        seen.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(torch.ones(2, 8))
        assert len(seen) == 2
        return all(seen)

    uncached = wrap.weight_casts_uncached
    with bench.trial("cache_kept"):
        assert cache_on_inside_blocks()  # as before: the cache kept inside the checkpoint
    assert wrap.weight_casts_uncached is uncached
    with bench.trial("cache_off"):
        assert not any([cache_on_inside_blocks(), *seen])
    with pytest.raises(ValueError, match="unknown trial"), bench.trial("other"):
        pass


def test_families_runs_each_rows_steps_inside_its_plans_offload_and_leaves_offload_rows_out_by_default():
    pytest.importorskip("transformers")
    families = _benchmark("families")
    assert not set(families.OFFLOADING) & set(families.DEFAULT_ROWS)  # named in --rows, or not run
    assert all(families.AT_SWITCH[row] in (1.0, 0.5) and row in families.LEVERS for row in families.OFFLOADING)

    class Context:
        """Stands in for a plan's ActivationOffload: counts its entries, refuses to be entered twice at once."""

        def __init__(self) -> None:
            self.entered = self.open = 0

        def __enter__(self):
            assert not self.open
            self.entered, self.open = self.entered + 1, 1

        def __exit__(self, *exc):
            self.open = 0

    setting = families.Setting.make(smoke=True)
    model = families.make_model("llama", setting)
    batches = families.make_batches("llama", setting)
    assert isinstance(families.step_context(model), type(families.contextlib.nullcontext()))  # no plan: nothing
    context = Context()
    model.memguard_bench_offload = context
    families.train_steps(model, batches, setting)
    assert (context.entered, context.open) == (1, 0)  # around the row's steps, once: its host buffers reused
    rows = {"levers_half_switch_offload": {"step_ms": 1.0}}
    families.interleaved("llama", rows, setting, rounds=2, alive={"levers_half_switch_offload": model})
    assert "interleaved_error" not in rows["levers_half_switch_offload"]
    assert (context.entered, context.open) == (1 + 3, 0)  # and around each of its turns: a warm-up round and two


def test_offload_smoke_moves_only_each_blocks_input_where_every_block_is_checkpointed(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    offload = _benchmark("offload")
    argv = ["offload.py", "--smoke", "--models", "gpt2", "--out", str(tmp_path), "--profile", "checkpointed_inputs,x"]
    _smoke(offload, argv, monkeypatch)
    result = json.loads((tmp_path / "offload.json").read_text())["models"]["gpt2"]
    # a row profiled: its trace beside the results, read (on the CPU no CUDA stream: nothing on one); a row unknown
    profiled = result["profiles"]["checkpointed_inputs"]
    assert (tmp_path / profiled["trace"]).exists() and profiled["compute_stream"] is None
    assert "no row 'x' here" in result["profiles"]["x"]["error"]
    rows = {row["row"]: row for row in result["rows"]}
    assert list(rows)[-2:] == ["checkpointed", "checkpointed_inputs"]
    assert rows["checkpointed"]["moved_gb"] == 0 and rows["checkpointed"]["cost_vs_checkpointed_pct"] == 0
    inputs = rows["checkpointed_inputs"]
    assert inputs["offloaded_blocks"] == list(range(result["blocks"]))
    # each block's inputs alone (its hidden states, 2 x 64 tokens x 64 wide in float32, and a few small tensors the
    # layer is given), where offloading the blocks whole moves all they save
    hidden = result["blocks"] * 2 * 64 * 64 * 4 / 1e9
    assert hidden <= inputs["moved_gb"] < 1.05 * hidden < rows["all"]["moved_gb"] / 10
    assert "cost_vs_checkpointed_pct" in inputs and result["gradients"]["bit_identical"]


def test_a_steps_trace_says_how_much_of_each_copy_ran_beside_a_kernel_and_what_the_host_waited_on():
    offload = _benchmark("offload")

    def span(cat, name, ts, dur, stream=None):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {} if stream is None else {
            "stream": stream}}  # fmt: skip

    trace = [
        span("kernel", "gemm", 0, 1000, 7), span("kernel", "gelu", 1000, 500, 7),  # busy 0-1500 us
        span("kernel", "gemm", 2500, 1000, 7),  # after a 1000 us gap: idle
        span("kernel", "gemm", 3550, 10, 7),  # after 50 us: not idle
        span("kernel", "copy", 0, 100, 9),  # a kernel on another stream: not the compute stream's
        span("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 1200, 600, 20),  # 300 us beside a kernel, 300 not
        span("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 2400, 200, 21),  # 100 beside
        span("gpu_memset", "Memset (Device)", 3600, 5, 7),
        span("cuda_runtime", "cudaMemcpyAsync", 1100, 700), span("cuda_runtime", "cudaMemcpyAsync", 2000, 20),
        span("cuda_runtime", "cudaLaunchKernel", 0, 5),  # not a call that waits
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 0},  # no duration: not a span
    ]  # fmt: skip
    summary = offload.stream_summary(trace)
    assert summary["compute_stream"] == 7
    assert summary["streams"]["7"] == {"busy_ms": 2.515, "kernels": 4}
    assert summary["streams"]["20"] == {"busy_ms": 0.6, "kernels": 0}
    assert (summary["idle_gaps"], summary["idle_gaps_ms"]) == (1, 1.0)
    assert summary["copies"] == {
        "to_host": {"count": 1, "ms": 0.6, "hidden_ms": 0.3},
        "to_device": {"count": 1, "ms": 0.2, "hidden_ms": 0.1},
    }
    assert summary["host_waits"] == {"cudaMemcpyAsync": {"calls": 2, "ms": 0.72, "longest_ms": 0.7}}
    assert offload.stream_summary([])["compute_stream"] is None
