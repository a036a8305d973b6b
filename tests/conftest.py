from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import types
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch
from filelock import FileLock
from lightning.pytorch import LightningModule
from torch.utils.data import DataLoader, TensorDataset

from lightning_memguard.probes import MemoryReading

warnings.filterwarnings("ignore", message=".*does not have many workers.*")
warnings.filterwarnings("ignore", message=".*isinstance\\(treespec, LeafSpec\\)` is deprecated.*")

# One intra-op thread: the tests' models are tiny, so a second thread only waits on the first (on a loaded machine,
# seconds a step), and under pytest-xdist each worker already has a core of its own. Subprocesses (the command, the
# examples, the DDP ranks) inherit OMP_NUM_THREADS. Inter-op threads likewise; they can only be set before any
# inter-op work has started.
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)
with contextlib.suppress(RuntimeError):
    torch.set_num_interop_threads(1)


# What each test costs, measured: tests/costs.json holds every test's seconds (setup, call and teardown) from a full
# run on two cores (`make test-costs` measures them again). From it, at collection: a test that took SLOW_SECONDS or
# more is marked `slow`; a test that needs the suite's two-rank launch (its fixture `ddp_launch`, minutes for the
# first test that asks) is marked `ddp`. `make test-fast` leaves both out. A test not measured yet is neither.
COSTS = Path(__file__).with_name("costs.json")
SLOW_SECONDS = 2.0
LAUNCHES = ("ddp_launch", "two_ranks")  # the fixtures that start two-rank launches (a fixture's own fixtures count)


def pytest_collection_modifyitems(config, items) -> None:
    costs = json.loads(COSTS.read_text(encoding="utf-8")) if COSTS.exists() else {}
    for item in items:
        if any(name in LAUNCHES for name in getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.ddp)
        if costs.get(item.nodeid, 0.0) >= SLOW_SECONDS:
            item.add_marker(pytest.mark.slow)


_measured: dict[str, float] = {}


def pytest_runtest_logreport(report) -> None:
    """Under MEMGUARD_TEST_COSTS (a file name), each test's seconds are added up (on pytest-xdist's controller, which
    sees every worker's reports) and written there when the session ends."""
    if os.environ.get("MEMGUARD_TEST_COSTS"):
        _measured[report.nodeid] = _measured.get(report.nodeid, 0.0) + report.duration


def _write_costs() -> None:
    target = os.environ.get("MEMGUARD_TEST_COSTS")
    if target and _measured and not os.environ.get("PYTEST_XDIST_WORKER"):
        rounded = {k: round(v, 2) for k, v in sorted(_measured.items())}
        Path(target).write_text(json.dumps(rounded, indent=0) + "\n", encoding="utf-8")


def pytest_collection_finish(session) -> None:
    """What the test modules imported (torch, Lightning, timm, Hugging Face: millions of objects) lives for the
    whole session: kept out of the garbage collector's full passes, which the tuners' trials ask for after each
    search (as Lightning's tuner does), each pass costs milliseconds instead of a quarter of a second."""
    gc.collect()
    gc.freeze()


# The suite writes gigabytes (the spill tests save a checkpoint every few steps, the DDP launch each rank's files), and
# on a virtual machine's disk a write can cost more than the training around it. Where the machine has a RAM disk
# with room, the session's temporary files go to a folder of its own there, for the workers and every process they
# start (TMPDIR, set before pytest-xdist starts its workers); each passing test's folder is removed as the test ends
# (pyproject's tmp_path_retention_policy), and the whole folder with a session that passed.
RAM_DISK = "/dev/shm"
SESSION_TMPDIR = None
if "TMPDIR" not in os.environ and os.access(RAM_DISK, os.W_OK) and shutil.disk_usage(RAM_DISK).free > 8 * 2**30:
    SESSION_TMPDIR = os.environ["TMPDIR"] = tempfile.mkdtemp(prefix="memguard-tests-", dir=RAM_DISK)
    tempfile.tempdir = None  # read from TMPDIR again


@pytest.hookimpl(trylast=True)  # after pytest's own clean-up of its folders in it
def pytest_sessionfinish(session, exitstatus) -> None:
    _write_costs()
    if SESSION_TMPDIR is not None and exitstatus == 0:
        shutil.rmtree(SESSION_TMPDIR, ignore_errors=True)


def pytest_terminal_summary(terminalreporter, exitstatus) -> None:
    if SESSION_TMPDIR is not None and exitstatus != 0:
        terminalreporter.write_line(f"the failed tests' files are kept in {SESSION_TMPDIR} (in memory: remove it)")


class FakeProbe:
    """A card whose peak memory the test sets; it counts resets."""

    def __init__(self, capacity: int = 16 * 10**9, peak: int = 10**9, other: int = 0) -> None:
        self._capacity = capacity
        self.peak = peak
        self.other = other
        self.resets = 0
        self.reads = 0
        self.allocated_now: int | None = None  # what a step starts from, where a test says

    def capacity(self) -> int:
        return self._capacity

    def reset_peak(self) -> None:
        self.resets += 1

    def read(self) -> MemoryReading:
        self.reads += 1
        return MemoryReading(self.peak, self.peak + 1000, self._capacity, self.other, self.allocated_now)


class StepClock:
    """A clock that advances a fixed amount on every call: MemGuard calls it once at every batch start."""

    def __init__(self, tick: float = 0.1) -> None:
        self.tick = tick
        self.now = 0.0

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


class TinyModel(LightningModule):
    """A two-layer MLP on random data: fast enough for many Trainers per test."""

    def __init__(self, batch_size: int = 8, n: int = 64, val: bool = False) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.n = n
        self.val = val
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 16, generator=gen)
        self.y = torch.randint(0, 2, (n,), generator=gen)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.x, self.y), batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(TensorDataset(self.x[:16], self.y[:16]), batch_size=self.batch_size)


@pytest.fixture
def fake_probe() -> FakeProbe:
    return FakeProbe()


@pytest.fixture(autouse=True)
def _quiet_lightning() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        warnings.filterwarnings("ignore", message=".*LeafSpec.*")
        yield


def free_earlier_fits() -> None:
    """What earlier fits in this process left allocated freed before a GPU test measures: Lightning's Trainer and
    LightningModule refer to each other, so a finished fit's model, gradients and optimizer state stay on the card
    until Python's cycle collector runs, which depends on what ran before (on the H200 each earlier fit of the
    sharded adapt test held 0.43 GB more, and the adapted run spilled at step 1 instead of step 3)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def trainer_kwargs(tmp_path, **overrides):
    kwargs = dict(
        default_root_dir=tmp_path,
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    kwargs.update(overrides)
    return kwargs


def fused_calls(monkeypatch) -> list[bool]:
    """Record each call of the rebuild's fused-kernel entry (``checkpointing._fused.fused``): True where the Triton
    kernel ran, False where it declined and PyTorch's kernels did the work."""
    from lightning_memguard.checkpointing import _fused

    ran: list[bool] = []
    fused = _fused.fused

    def counted(*args, **kwargs):
        out = fused(*args, **kwargs)
        ran.append(out is not None)
        return out

    monkeypatch.setattr(_fused, "fused", counted)
    return ran


def planner_step_times(monkeypatch, seconds) -> None:
    """Make the compiled planner's step times ``seconds(setting, blocks, split)``: compile's
    ``activation_memory_budget`` in force, how many blocks are checkpointed, whether the model is split into graphs
    (the state each measurement runs in), so that this CPU's timing decides nothing."""
    from lightning_memguard import _compiler
    from lightning_memguard.checkpointing.measure import StepMeter
    from lightning_memguard.checkpointing.wrap import GraphSplit, is_checkpointed

    def fake(meter, steps=3):
        modules = list(_compiler.unwrapped(meter.model).modules())
        blocks = sum(is_checkpointed(m) for m in modules)
        split = any(isinstance(m, GraphSplit) for m in modules)
        return seconds(torch._functorch.config.activation_memory_budget, blocks, split)

    monkeypatch.setattr(StepMeter, "seconds", fake)


def ticking_planner_clocks(monkeypatch) -> None:
    """The planners' clocks (a link's forward in ``checkpointing.measure``, a pointwise recomputation in
    ``levers.pointwise``) tick once a reading, 1 ms each: a link's time is the readings inside it, so plans follow the
    step's structure and not this machine's load (under load, a block timed faster than its parts, or two fits of one
    setting choosing apart)."""
    from lightning_memguard.checkpointing import measure
    from lightning_memguard.levers import pointwise

    ticks = iter(range(10**9))
    ticking = types.SimpleNamespace(perf_counter=lambda: next(ticks) * 1e-3)
    monkeypatch.setattr(measure, "time", ticking)
    monkeypatch.setattr(pointwise, "time", ticking)


def session_folder(tmp_path_factory) -> Path:
    """This test session's temporary folder, shared by its pytest-xdist workers (for work done once a session)."""
    root = tmp_path_factory.getbasetemp()
    return root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root


def ddp_scenarios(tmp_path_factory, name: str, specs: Sequence[str], timeout: float) -> Path:
    """Run the DDP scenarios ``specs`` (``"script:scenario"``) in one two-rank launch of ``ddp_run.py``, once per test
    session: under pytest-xdist the workers share the launch through a lock in their common temporary folder, so a
    module's tests may run on either worker. Returns the launch's folder: each scenario's results are under
    ``<folder>/<script>/<scenario>/``; ``launch.json`` holds the return code (None: timed out) and stderr's tail,
    ``stderr.txt`` all of stderr. A last spec ending in ``!`` may end the launch with its error (see ddp_run.py)."""
    out = session_folder(tmp_path_factory) / f"ddp-{name}"
    with FileLock(str(out) + ".lock"):
        record = out / "launch.json"
        if not record.exists():
            out.mkdir(exist_ok=True)
            env = {
                k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_PORT")
            }
            env["PYTHONWARNINGS"] = "ignore"
            script = os.path.join(os.path.dirname(__file__), "ddp_run.py")
            try:
                proc = subprocess.run(
                    [sys.executable, script, str(out), *specs], capture_output=True, text=True, timeout=timeout,
                    env=env, cwd=out,
                )  # fmt: skip
                launch, stderr = {"returncode": proc.returncode}, proc.stderr
            except subprocess.TimeoutExpired as err:
                stderr = err.stderr.decode(errors="replace") if isinstance(err.stderr, bytes) else err.stderr or ""
                launch, stderr = {"returncode": None}, f"the launch did not end within {timeout} s\n{stderr}"
            (out / "stderr.txt").write_text(stderr, encoding="utf-8")  # all of it
            record.write_text(json.dumps({**launch, "stderr": stderr[-6000:]}), encoding="utf-8")
    return out


def ddp_scenario_results(out: Path, spec: str, filename: str) -> dict[int, dict]:
    """Each rank's results of one scenario of a ``ddp_scenarios`` launch: ``filename`` with ``{rank}`` in it. Fails,
    naming the scenario, where a rank crashed in it or wrote nothing."""
    launch = json.loads((out / "launch.json").read_text(encoding="utf-8"))
    folder = out.joinpath(*spec.split(":", 1))
    for rank in (0, 1):
        crash = folder / f"crash-rank{rank}.txt"
        if crash.exists():
            pytest.fail(f"scenario {spec}: rank {rank} raised\n{crash.read_text(encoding='utf-8')}")
    results = {}
    for rank in (0, 1):
        path = folder / filename.format(rank=rank)
        if not path.exists():
            why = "a rank was left waiting?" if launch["returncode"] is None else f"exit code {launch['returncode']}"
            pytest.fail(f"scenario {spec}: rank {rank} wrote nothing ({why}); stderr, all of it in {out}/stderr.txt:\n"
                        f"{launch['stderr']}")  # fmt: skip
        results[rank] = json.loads(path.read_text(encoding="utf-8"))
    return results


# test_ddp.py's, test_ddp_guard.py's, test_adapt.py's and test_checkpointing_strategies.py's DDP scenarios, in one
# launch: the compiled ones late (strategy's compiled scenario fixes the planner's step times for good),
# planning_fails last (it ends the launch)
DDP_SCENARIOS = [
    "ddp_guard_run:mid-stop",
    "ddp_guard_run:last-raise",
    "ddp_spill_run:raise-0",
    "ddp_spill_run:raise-1",
    "ddp_spill_run:stop-1",
    "ddp_tuner_run:accumulation",
    "ddp_tuner_run:oom",
    "ddp_tuner_run:oom_backward",
    "ddp_strategy_run:eager",
    "ddp_adapt_run:adapt",
    "ddp_adapt_run:savers",
    "ddp_adapt_run:planning_raises",
    "ddp_tuner_run:oom_compiled",
    "ddp_strategy_run:compiled",
    "strategy_cells_run:ddp",
    "sharded_run:batch_size",
    "sharded_run:accumulation",
    "sharded_run:guard",
    "sharded_run:adapt",
    "sharded_run:checkpointing",
    "sharded_run:budget",
    "sharded_run:oom_forward",
    "sharded_run:oom_backward",
    "sharded_run:oom_head",
    "sharded_run:oom_stem",
    "sharded_run:oom_accumulation",
    "ddp_strategy_run:planning_fails!",
]


@pytest.fixture(scope="session")
def ddp_launch(tmp_path_factory) -> Path:
    """The folder of the one launch that runs ``DDP_SCENARIOS`` (see ``ddp_scenarios``)."""
    return ddp_scenarios(tmp_path_factory, "memguard", DDP_SCENARIOS, timeout=900)
