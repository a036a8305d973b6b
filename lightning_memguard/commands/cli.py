"""The ``memguard`` command: demo, doctor, sweep and plan."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

PRECISIONS = ("32-true", "16-mixed", "bf16-mixed")


@dataclass(frozen=True)
class DeviceDefaults:
    """What sweep and plan measure where the command line does not say: on CUDA, sized for a GPU; on the CPU, sized
    so that ``memguard sweep`` and ``memguard plan --effective-batch 256`` finish well within two minutes on two
    cores (resnet50 at 224 px takes many minutes there)."""

    device: str  # as the settings line names it
    model: str
    image_size: int
    batch_sizes: str  # sweep
    steps: int  # sweep: timed optimizer steps per batch size
    warmup: int  # sweep: untimed optimizer steps before them
    trial_steps: int  # plan: timed optimizer steps per micro-batch
    trial_warmup: int  # plan: untimed optimizer steps before them


CUDA_DEFAULTS = DeviceDefaults("CUDA", "resnet50", 224, "32,64,128,256", 16, 3, 3, 2)
CPU_DEFAULTS = DeviceDefaults("the CPU", "resnet18", 32, "8,16,32,64", 6, 2, 1, 1)
_DEFAULTED = {"model": "--model", "image_size": "--image-size", "batch_sizes": "--batch-sizes", "steps": "--steps",
              "trial_steps": "--steps"}  # fmt: skip


REPORT_HELP = "folder for a memory report per configuration tried (which modules hold the memory: JSON and a page)"


def _on_both(field: str, unit: str = "") -> str:
    return f"default: {getattr(CUDA_DEFAULTS, field)}{unit} on CUDA, {getattr(CPU_DEFAULTS, field)}{unit} on the CPU"


INTERRUPTED = 130  # the exit code of a command stopped by Ctrl+C, as a shell gives it


class UsageError(Exception):
    """Bad input: reported on one line with exit code 2."""


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Options show their default; those whose default depends on the device (None here) say so in their help."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or isinstance(action.default, bool):
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:  # one line, exit code 2, no usage dump
        self.exit(2, f"memguard: error: {message}\n")


MODEL_FORMS = (
    "a torchvision classification model's name (resnet50), else a timm model's (resnet10t; needs timm), or your own as"
    " package.module:Callable, a class or function that builds with no arguments an nn.Module from images to class"
    " scores, or a LightningModule with its own data and a batch_size attribute (package.module is looked for in the"
    " current folder too)"
)


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help=f"{MODEL_FORMS} ({_on_both('model')})")
    p.add_argument(
        "--image-size",
        type=int,
        default=None,
        help=f"pixels per side ({_on_both('image_size', ' px')}; a model that cannot take it: its own size)",
    )
    p.add_argument("--precision", choices=PRECISIONS, default=None, help="default: bf16-mixed on CUDA, else 32-true")
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--emulate-capacity", default=None, help="run on an emulated card with sysmem fallback: '16GB'")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: CUDA if there is a GPU")
    p.add_argument(
        "--verbose", action="store_true", help="show Lightning's messages and MemGuard's table for every run"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="memguard",
        description="Keep GPU training fast and honest about memory. Sweep and plan measure "
        f"{CUDA_DEFAULTS.model} at {CUDA_DEFAULTS.image_size} px on CUDA and {CPU_DEFAULTS.model} at "
        f"{CPU_DEFAULTS.image_size} px on the CPU unless told otherwise.",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    demo = sub.add_parser("demo", help="train a ResNet on synthetic images with MemGuard and print its table")
    demo.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: CUDA if there is a GPU")
    demo.add_argument("--epochs", type=int, default=None, help="default: 3")
    demo.add_argument("--out", default="demo_logs", help="folder for the CSV logs")

    doctor = sub.add_parser("doctor", help="this machine's risk of the silent sysmem spill")
    doctor.add_argument(
        "--probe",
        action="store_true",
        help="try to allocate more memory than the GPU has (only the fallback accepts it)",
    )
    doctor.add_argument("--json", action="store_true")

    sweep = sub.add_parser("sweep", help="step time, peak memory and throughput per batch size, as a table and a plot")
    _model_args(sweep)
    sweep.add_argument("--batch-sizes", default=None, help=f"comma-separated ({_on_both('batch_sizes')})")
    sweep.add_argument("--checkpoint", action="store_true", help="activation checkpointing of every block")
    sweep.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    sweep.add_argument(
        "--steps", type=int, default=None, help=f"timed optimizer steps per batch size ({_on_both('steps')})"
    )
    _compile_args(sweep)
    sweep.add_argument("--out", default="memguard-sweep", help="folder for sweep.csv and sweep.png")
    sweep.add_argument("--report", default=None, metavar="DIR", help=REPORT_HELP)

    plan = sub.add_parser("plan", help="measure micro-batch x accumulation for an effective batch; print the choice")
    _model_args(plan)
    plan.add_argument("--effective-batch", type=int, required=True, help="samples per optimizer step")
    plan.add_argument("--min-micro-batch", type=int, default=8, help="smallest micro-batch to try")
    plan.add_argument(
        "--steps",
        dest="trial_steps",
        type=int,
        default=None,
        help=f"timed optimizer steps per micro-batch ({_on_both('trial_steps')})",
    )
    _compile_args(plan)
    plan.add_argument("--report", default=None, metavar="DIR", help=REPORT_HELP)
    plan.add_argument(
        "--levers",
        default=None,
        metavar="BUDGET",
        help="instead of the micro-batch search: the levers' plan (checkpointing blocks or their parts, recomputing"
        " their pointwise chains, offload on CUDA) for one batch of --effective-batch images to meet BUDGET, a"
        " fraction of its peak (0.5) or a size ('6GB'), each choice measured",
    )
    return parser


def fill_device_defaults(args: argparse.Namespace, cuda: bool) -> list[str]:
    """Set the options the command line left out (None) to the device's defaults; return their flags."""
    defaults = CUDA_DEFAULTS if cuda else CPU_DEFAULTS
    filled = []
    for name, flag in _DEFAULTED.items():
        if name in vars(args) and getattr(args, name) is None:
            setattr(args, name, getattr(defaults, name))
            filled.append(flag)
    return filled


def _steps(count: int, what: str) -> str:
    return f"{count} {what}" if count == 1 else f"{count} {what}s"


def _settings_line(command: str, cuda: bool, precision: str, what: str, filled: Sequence[str]) -> str:
    """One line at the start: what this run measures, and which of it are the device's defaults."""
    device = (CUDA_DEFAULTS if cuda else CPU_DEFAULTS).device
    note = f" ({device}'s defaults for {', '.join(filled)}; pass them for others)" if filled else ""
    return f"memguard {command} on {device}: {what}, {precision}{note}"


def _compile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the model: one static graph per batch size, compile time apart from the timed steps",
    )
    p.add_argument("--compile-backend", default=None, help="torch.compile's backend with --compile (default inductor)")


def _positive(name: str, value: int) -> int:
    if value < 1:
        raise UsageError(f"{name} must be >= 1, got {value}")
    return value


def _model_source(text: str) -> Any:
    """What ``--model`` names (a :class:`lightning_memguard.commands.sweep.ModelSource`); bad input if it names
    nothing."""
    from lightning_memguard.commands.sweep import model_source

    try:
        return model_source(text)
    except ValueError as err:
        raise UsageError(str(err)) from None


def _levers_budget(text: str | None) -> float | int | None:
    """``--levers``' budget: a fraction in (0, 1] (``0.5``) or a size (``6GB``), as ``memory_budget`` takes it."""
    if text is None:
        return None
    from lightning_memguard.core.checks import check_memory_budget

    try:
        value: float | str = float(text)
    except ValueError:
        value = text
    try:
        return check_memory_budget(value)
    except (TypeError, ValueError) as err:
        raise UsageError(f"--levers {text}: {str(err).replace('`memory_budget`', 'the budget')}") from None


def _batch_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UsageError(f"--batch-sizes must be integers separated by commas, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise UsageError(f"--batch-sizes must be integers >= 1, got {text!r}")
    return tuple(sorted(set(sizes)))


def _check_device(device: str) -> None:
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda, but no CUDA GPU is available")


def _use_cuda(device: str) -> bool:
    """Whether the run trains on CUDA (``--device auto``: if there is a GPU); ``--device cuda`` without one is bad
    input."""
    import torch

    _check_device(device)
    return torch.cuda.is_available() if device == "auto" else device == "cuda"


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


@dataclass(frozen=True)
class _ModelInput:
    """What the model is measured on: ``image_size`` (None: a LightningModule's own data), the classes its network
    scores, and how the settings line names it."""

    image_size: int | None
    num_classes: int
    described: str


def _forward(source: Any, image_size: int, batch: int) -> Any:
    """One training forward of the model on the meta device (no memory, no arithmetic): its output, or the error.
    Where the meta device cannot run the model, the CPU decides."""
    import warnings

    import torch

    def run(device: str) -> Any:
        with warnings.catch_warnings(), torch.device(device):
            warnings.simplefilter("ignore")
            net = source.build()
            net.train()
            return net(torch.randn(batch, 3, image_size, image_size))

    try:
        return run("meta")
    except Exception:  # the meta device lacks some kernels: only a real run can tell
        pass
    try:
        return run("cpu")
    except Exception as err:
        return err


def _check_model_input(
    source: Any, image_size: int, given: bool, channels_last: bool, cuda: bool, smallest_batch: int, batch_option: str
) -> _ModelInput:
    """Before any training: a model that cannot take the image size (ViT's fixed size, Inception's minimum), a network
    whose output is not class scores, or BatchNorm that cannot train on one sample, is bad input. Where the device's
    default size (not ``given``) does not fit the model, its own size (torchvision's ``vit_b_16``: 224 px) is taken,
    and said; an error never names a flag the user did not pass."""
    import torch

    if source.lightning:
        for flag, passed in (("--image-size", given), ("--channels-last", channels_last)):
            if passed:
                raise UsageError(
                    f"{flag}: {source.text} is a LightningModule, which brings its own data; leave {flag} out"
                )
        return _ModelInput(None, 0, f"{source.text} (a LightningModule, on its own data)")
    note = ""
    out = _forward(source, image_size, 2)
    if isinstance(out, BaseException):
        if given:
            raise UsageError(f"--model {source.text} cannot take --image-size {image_size}: {_first_line(out)}")
        device = (CUDA_DEFAULTS if cuda else CPU_DEFAULTS).device
        refused, own = out, source.own_size
        if own is None or own == image_size or isinstance(out := _forward(source, own, 2), BaseException):
            raise UsageError(
                f"--model {source.text} cannot take images of {image_size} px, {device}'s default size (pass"
                f" --image-size for another): {_first_line(refused)}"
            )
        note = f" ({source.text}'s own size: it cannot take {device}'s default of {image_size} px)"
        image_size = own
    num_classes = 1000  # a torchvision or timm classifier, as built by name
    if source.family == "network":
        if not isinstance(out, torch.Tensor) or out.ndim != 2:
            got = f"of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else f"a {type(out).__name__}"
            raise UsageError(
                f"--model {source.text}: its output for a batch of images is {got}, not class scores of shape (batch,"
                " classes); give a LightningModule with its own training_step instead"
            )
        num_classes = int(out.shape[1])
    if smallest_batch == 1 and isinstance(err := _forward(source, image_size, 1), BaseException):
        raise UsageError(
            f"{batch_option}: {source.text} at {image_size} px cannot train on a batch of 1 sample"
            f" ({_first_line(err)}); use batches of 2 or more"
        )
    return _ModelInput(image_size, num_classes, f"{source.text} at {image_size} px{note}")


def _not_defaults(filled: list[str], model: _ModelInput, default_size: int) -> list[str]:
    """The flags of ``filled`` whose default was not used after all: the image size, where the model took its own or
    brings its own data."""
    return [f for f in filled if f != "--image-size" or model.image_size == default_size]


def _writable(folder: str) -> str:
    try:
        os.makedirs(folder, exist_ok=True)
        probe = os.path.join(folder, ".memguard-write-test")
        with open(probe, "w", encoding="utf-8") as f:
            f.write("")
        os.remove(probe)
    except OSError as err:
        raise UsageError(f"cannot write to {folder!r}: {err.strerror or err}") from None
    return folder


def _report_folder(folder: str | None, backend: str | None) -> str | None:
    """``--report DIR``: a folder that can be written, not beside ``--compile`` (a module's hooks would compile the
    graph again)."""
    if folder is None:
        return None
    if backend is not None:
        raise UsageError(
            "--report measures each module's memory through hooks that a compiled graph does not run; leave out"
            " --compile for the report"
        )
    return _writable(folder)


def _capacity(text: str | None) -> int | None:
    if text is None:
        return None
    from lightning_memguard.core.units import parse_bytes

    try:
        return parse_bytes(text, "--emulate-capacity")
    except ValueError as err:
        raise UsageError(str(err).replace("`", "")) from None


def _precision(arg: str | None, device: str) -> str:
    return arg or ("bf16-mixed" if _use_cuda(device) else "32-true")


def _compile_backend(compile_: bool, backend: str | None, device: str) -> str | None:
    """The torch.compile backend asked for (None: eager), checked before any training: a known name, and what it
    needs on this device (inductor: a C++ compiler on the CPU, Triton on CUDA; PyTorch's Windows wheels bring no
    Triton)."""
    if not compile_:
        if backend is not None:
            raise UsageError("--compile-backend needs --compile")
        return None
    import torch

    from lightning_memguard import _compiler

    backend = backend or "inductor"
    known = _compiler.backends()
    if backend not in known:
        raise UsageError(f"unknown --compile-backend {backend!r}: use one of {', '.join(known)}")
    cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    missing = _compiler.inductor_missing(cuda) if backend == "inductor" else None
    if missing == "triton":
        raise UsageError(
            "--compile with inductor on CUDA needs Triton, which this PyTorch lacks (on Windows: pip install "
            "triton-windows); or use --compile-backend aot_eager"
        )
    if missing == "c++":
        raise UsageError(
            "--compile with inductor on the CPU needs a C++ compiler (g++ or clang++, or cl on Windows, or $CXX), "
            "and none was found; install one, or use --compile-backend aot_eager"
        )
    return backend


def _doctor(args: argparse.Namespace) -> int:
    from lightning_memguard.commands.doctor import collect, format_report

    info = collect(probe=args.probe)
    print(json.dumps(info, indent=2) if args.json else format_report(info))
    return 0


def _check_before_torch(args: argparse.Namespace) -> None:
    """Sweep's and plan's input that can be checked without torch, checked first: importing torch takes seconds, and a
    mistyped argument should answer at once. The model, the device and the compile backend need torch, and come
    after."""
    if getattr(args, "batch_sizes", None) is not None:
        _batch_sizes(args.batch_sizes)
    for flag, name in (("--image-size", "image_size"), ("--accumulate", "accumulate"), ("--steps", "steps"),
                       ("--steps", "trial_steps"), ("--effective-batch", "effective_batch"),
                       ("--min-micro-batch", "min_micro_batch")):  # fmt: skip
        if getattr(args, name, None) is not None:
            _positive(flag, getattr(args, name))
    if args.command == "plan" and args.min_micro_batch > args.effective_batch:
        raise UsageError(
            f"--min-micro-batch {args.min_micro_batch} is larger than --effective-batch {args.effective_batch}: no"
            f" micro-batch can be; lower --min-micro-batch to at most {args.effective_batch}"
        )
    _capacity(args.emulate_capacity)
    if args.compile_backend is not None and not args.compile:
        raise UsageError("--compile-backend needs --compile")
    if args.command == "sweep":
        _writable(args.out)
    _report_folder(args.report, "--compile" if args.compile else None)


def _sweep(args: argparse.Namespace) -> int:
    cuda = _use_cuda(args.device)
    given_size = args.image_size is not None
    filled = fill_device_defaults(args, cuda)
    source = _model_source(args.model)
    sizes = _batch_sizes(args.batch_sizes)
    _positive("--image-size", args.image_size)
    _positive("--accumulate", args.accumulate)
    _positive("--steps", args.steps)
    capacity = _capacity(args.emulate_capacity)
    precision = _precision(args.precision, args.device)
    backend = _compile_backend(args.compile, args.compile_backend, args.device)
    out = _writable(args.out)
    report = _report_folder(args.report, backend)
    model = _check_model_input(
        source, args.image_size, given_size, args.channels_last, cuda, sizes[0], "--batch-sizes 1"
    )
    filled = _not_defaults(filled, model, args.image_size)

    import torch
    from tqdm import tqdm

    from lightning_memguard.commands.sweep import SweepConfig, plot, run_folders, run_one, sweep_title, write_csv
    from lightning_memguard.core.epoch_record import format_sweep_table

    warmup = (CUDA_DEFAULTS if cuda else CPU_DEFAULTS).warmup
    what = (f"{model.described}, batch sizes {','.join(map(str, sizes))}, {warmup} warm-up +"
            f" {_steps(args.steps, 'timed step')} each")  # fmt: skip
    print(_settings_line("sweep", cuda, precision, what, filled), file=sys.stderr, flush=True)
    cfg = SweepConfig(args.model, sizes, model.image_size or 0, precision, args.channels_last, args.checkpoint,
                      args.accumulate, args.steps, warmup, capacity, args.device, backend, model.num_classes,
                      source, report)  # fmt: skip
    rows, capacity_gb = [], 0.0
    interrupted: int | None = None  # the batch size being measured when Ctrl+C came
    with run_folders() as root, tqdm(sizes, desc="memguard sweep", unit="batch size", file=sys.stderr) as bar:
        try:
            for batch in bar:
                bar.set_postfix_str(f"batch {batch}")  # the size being measured, shown while it trains
                interrupted = batch
                row, capacity_gb = run_one(cfg, batch, root)
                rows.append(row)
            interrupted = None
        except KeyboardInterrupt:  # keep what was measured: the rows so far are the table
            pass
    if interrupted is not None:
        kept = f"the table and sweep.csv hold the {_steps(len(rows), 'batch size')} measured before it"
        print(f"memguard sweep: interrupted (Ctrl+C) while measuring batch size {interrupted}; "
              + (kept if rows else "nothing was measured, nothing written"), file=sys.stderr, flush=True)  # fmt: skip
        if not rows:
            return INTERRUPTED
    print(format_sweep_table(rows, capacity_gb))
    write_csv(rows, os.path.join(out, "sweep.csv"))
    device = torch.cuda.get_device_name() if cuda else "the CPU"
    png = os.path.join(out, "sweep.png")
    if plot(rows, capacity_gb, png, sweep_title(cfg, device)):
        print(f"wrote {os.path.join(out, 'sweep.csv')} and {png}")
    else:
        print(f"wrote {os.path.join(out, 'sweep.csv')} (install matplotlib for the plot)")
    return 0 if interrupted is None else INTERRUPTED


def _plan(args: argparse.Namespace) -> int:
    cuda = _use_cuda(args.device)
    given_size = args.image_size is not None
    filled = fill_device_defaults(args, cuda)
    source = _model_source(args.model)
    _positive("--effective-batch", args.effective_batch)
    _positive("--min-micro-batch", args.min_micro_batch)
    if args.min_micro_batch > args.effective_batch:
        raise UsageError(
            f"--min-micro-batch {args.min_micro_batch} is larger than --effective-batch {args.effective_batch}: no"
            f" micro-batch can be; lower --min-micro-batch to at most {args.effective_batch}"
        )
    _positive("--image-size", args.image_size)
    _positive("--steps", args.trial_steps)
    levers = _levers_budget(args.levers)
    if levers is not None and source.lightning:
        raise UsageError(
            f"--levers plans a network's levers on images; {source.text} is a LightningModule: call"
            " plan_levers(model, batch, memory_budget=...) on its network with one of its batches"
        )
    capacity = _capacity(args.emulate_capacity)
    precision = _precision(args.precision, args.device)
    backend = _compile_backend(args.compile, args.compile_backend, args.device)
    report = _report_folder(args.report, backend)
    from lightning_memguard.tuning.search import accumulation_candidates

    smallest = accumulation_candidates(args.effective_batch, args.min_micro_batch)[0][0]
    model = _check_model_input(source, args.image_size, given_size, args.channels_last, cuda, smallest,
                               f"micro-batch {smallest} (--min-micro-batch)")  # fmt: skip
    filled = _not_defaults(filled, model, args.image_size)
    if levers is not None:
        what = f"{model.described}, the levers for one batch of {args.effective_batch} to meet {args.levers}"
        print(_settings_line("plan", cuda, precision, what, filled), file=sys.stderr, flush=True)
        from lightning_memguard.commands.plan import run_levers

        return run_levers(source, model.image_size or 0, args.effective_batch, levers, cuda)
    warmup = (CUDA_DEFAULTS if cuda else CPU_DEFAULTS).trial_warmup
    what = (f"{model.described}, micro-batches from {smallest} up to {args.effective_batch},"
            f" {warmup} warm-up + {_steps(args.trial_steps, 'timed optimizer step')} each")  # fmt: skip
    print(_settings_line("plan", cuda, precision, what, filled), file=sys.stderr, flush=True)
    from lightning_memguard.commands.plan import PlanConfig, run_plan

    cfg = PlanConfig(source, model.num_classes, model.image_size, args.effective_batch, args.min_micro_batch,
                     args.channels_last, precision, cuda, backend, capacity, warmup, args.trial_steps,
                     report)  # fmt: skip
    return run_plan(cfg, smallest)


@contextlib.contextmanager
def _quiet_lightning(quiet: bool) -> Iterator[None]:
    """Sweep and plan run many short Trainers: keep Lightning's per-run messages (its banner, tips, "`Trainer.fit`
    stopped") and MemGuard's table of each run off the screen meanwhile. Lightning is imported first: importing it
    sets its loggers' levels, and would undo these."""
    if quiet:
        import lightning.pytorch  # noqa: F401

    loggers = [logging.getLogger(n) for n in ("lightning.pytorch", "lightning.fabric")] if quiet else []
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def main(argv: Sequence[str] | None = None) -> int:
    return _run(build_parser().parse_args(argv))


def _run(args: argparse.Namespace) -> int:
    try:
        if args.command in ("sweep", "plan"):
            _check_before_torch(args)
            with _quiet_lightning(not args.verbose):
                return _sweep(args) if args.command == "sweep" else _plan(args)
        if args.command == "demo":
            if args.epochs is not None:
                _positive("--epochs", args.epochs)
            _writable(args.out)
            # at once, before the imports: on a fresh install, loading torch and Lightning alone can take a minute
            print("memguard demo: a short training run of a ResNet on synthetic images with MemGuard, then its table"
                  " of peak memory against throughput; importing torch and Lightning first", flush=True)  # fmt: skip
            started = time.perf_counter()
            _check_device(args.device)
            from lightning_memguard.commands.demo import run_demo

            print(f"memguard demo: imported in {time.perf_counter() - started:.1f} s", flush=True)
            run_demo(args.device, args.epochs, args.out)
            return 0
        return _doctor(args)
    except UsageError as err:
        print(f"memguard: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
