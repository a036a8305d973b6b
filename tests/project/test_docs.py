"""The code blocks of README.md, docs/*.md and the checkpointing method card run, or are checked, so they cannot rot.

Every fenced block of those pages is one of these, by its fence's language:

- ``python``: run. The python blocks of one page run in order, in one namespace, so a block may use what an
  earlier block of the same page defined (an import block, then a usage block); each page has a namespace and a
  temporary working folder of its own. All pages run, page after page, in one fresh Python process on the CPU
  (``CUDA_VISIBLE_DEVICES=""``, one thread), so torch and Lightning are imported once; pages share only what
  modules keep. Tracebacks name the page and its line. A failing block fails its own test, and the page's later
  blocks fail as not reached. Each block must finish within seconds on a CPU (a test fails past
  ``BLOCK_LIMIT_S``): an example that would be slow is made small in the doc itself.
- A python block that cannot run on a CPU in seconds (a CUDA GPU, a large download, minutes of compiling) is not
  run only where the doc says so, on the line right before its fence: ``<!-- not run: needs a CUDA GPU -->``. Its
  syntax is still checked and its imports still run (in its page's namespace, in order); its test is reported as
  skipped, with the page, the line and the reason (``pytest -ra`` lists them). Keep these few.
- ``bash``, ``sh``, ``console``, ``bat``: not run; each command is checked (see ``check_command``): a ``memguard``
  (or ``python -m lightning_memguard``) subcommand exists in the CLI's parser, with every option named, and the
  whole command parses where it holds no placeholder; a ``make`` target exists in the Makefile; a script path
  exists, and the script defines every ``--option`` given to it (``bash benchmarks/run_gpu.sh``: every step named);
  ``python -m MODULE`` can be imported; ``pip install ".[EXTRA]"`` names extras of pyproject.toml; ``pytest -m``
  names registered markers and existing test paths.
- ``yaml``: a LightningCLI config: each ``class_path`` imports and constructs with its ``init_args``.
- ``text``: output or illustration; not checked. A block of any other language, or none, fails.

The same command checks apply to commands in inline code in the prose (`` `python benchmarks/spill.py` ``,
`` `memguard doctor --probe` ``, `` `make test` ``), except that a fragment such as `` `memguard plan --compile` ``
need not parse whole. Placeholders (``...``, ``NAME``, ``OUT_DIR``) are left alone.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import glob
import importlib
import importlib.util
import io
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass

import pytest
from conftest import session_folder
from filelock import FileLock

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGES = [
    "README.md",
    *sorted(os.path.relpath(p, ROOT).replace(os.sep, "/") for p in glob.glob(f"{ROOT}/docs/*.md")),
    "lightning_memguard/checkpointing/README.md",  # the method card
]
SHELL = {"bash", "sh", "console", "bat"}
KNOWN = {"python", "yaml", "text", *SHELL}
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
NOT_RUN = re.compile(r"<!--\s*not run:\s*(.+?)\s*-->")
TIMEOUT_S = 600  # all the pages together
BLOCK_LIMIT_S = 120  # one block, on a busy two-core machine


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # of the opening fence, 1-based
    lang: str
    source: str
    not_run: str | None  # the reason, from a marker on the line before the fence

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def _read(page: str) -> str:
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return f.read()


def parse_blocks(page: str, text: str) -> tuple[list[Block], str]:
    """The fenced blocks of ``text``, and the prose around them (the blocks' lines blanked)."""
    blocks, prose, lines = [], [], text.splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            prose.append(lines[i])
            i += 1
            continue
        indent, fence, lang = m.groups()
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        body = [line[len(indent) :] if line.startswith(indent) else line.lstrip() for line in lines[i + 1 : end]]
        before = lines[i - 1] if i else ""
        marker = NOT_RUN.search(before)
        blocks.append(Block(page, i + 1, lang.lower(), "\n".join(body) + "\n", marker.group(1) if marker else None))
        prose.extend([""] * (end + 1 - i))
        i = end + 1
    return blocks, "\n".join(prose)


BLOCKS: list[Block] = []
PROSE: dict[str, str] = {}
for _page in PAGES:
    _blocks, PROSE[_page] = parse_blocks(_page, _read(_page))
    BLOCKS.extend(_blocks)


def _of(*langs: str) -> list[Block]:
    return [b for b in BLOCKS if b.lang in langs]


def test_every_block_is_run_checked_or_text():
    unknown = [f"{b.id} ```{b.lang}" for b in BLOCKS if b.lang not in KNOWN]
    assert not unknown, f"fence languages must be one of {sorted(KNOWN)} (text for output or illustration): {unknown}"
    stray = [b.id for b in BLOCKS if b.not_run and b.lang != "python"]
    assert not stray, f"a `not run` marker is for python blocks only: {stray}"


# ---- python blocks ----

# Runs in a fresh interpreter: every page's python blocks, page after page; each page in a namespace of its own and a
# working folder of its own. Writes {block id: {"error": traceback or None, "s": seconds}} after each block.
_RUNNER = r"""
import ast, json, os, sys, time, traceback
blocks, out = json.load(open(sys.argv[1], encoding="utf-8")), sys.argv[2]
namespaces, failed, results = {}, set(), {}
for b in blocks:
    if b["page"] in failed:
        continue
    namespace = namespaces.setdefault(b["page"], {"__name__": "__main__"})
    os.chdir(b["folder"])
    started, error = time.perf_counter(), None
    try:
        tree = ast.parse("\n" * b["line"] + b["source"], b["page"])  # line numbers as in the page
        if b["imports_only"]:
            tree.body = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
        exec(compile(tree, b["page"], "exec"), namespace)
    except SystemExit as e:
        error = None if e.code in (None, 0) else traceback.format_exc()
    except BaseException:
        error = traceback.format_exc()
    results[b["id"]] = {"error": error, "s": round(time.perf_counter() - started, 2)}
    if error:
        failed.add(b["page"])
    with open(out, "w", encoding="utf-8") as f:
        json.dump(results, f)
"""


@pytest.fixture(scope="session")
def python_results(tmp_path_factory) -> tuple[dict[str, dict], str]:
    """Runs every page's python blocks once, in one fresh process; returns the results by block id, and the log.
    Once a session: under pytest-xdist the workers share the run through a lock in their common temporary folder."""
    folder = session_folder(tmp_path_factory) / "docs-python-blocks"
    out = folder / "results.json"
    with FileLock(str(folder) + ".lock"):
        if not (folder / "log.txt").exists():
            folder.mkdir(exist_ok=True)
            (folder / "log.txt").write_text(_run_python_blocks(folder, out), encoding="utf-8")
        log = (folder / "log.txt").read_text(encoding="utf-8")
    results = {}
    if out.exists():
        with open(out, encoding="utf-8") as f:
            results = json.load(f)
    return results, log


def _run_python_blocks(folder, out) -> str:
    blocks = []
    for block in _of("python"):
        page_folder = folder / re.sub(r"\W", "_", block.page)
        page_folder.mkdir(exist_ok=True)
        blocks.append({"page": block.page, "line": block.line, "id": block.id, "source": block.source,
                       "imports_only": bool(block.not_run), "folder": str(page_folder)})  # fmt: skip
    with open(folder / "blocks.json", "w", encoding="utf-8") as f:
        json.dump(blocks, f)
    path = os.pathsep.join([ROOT, *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONPATH": path,
           "PYTHONWARNINGS": "ignore"}  # fmt: skip
    try:
        proc = subprocess.run([sys.executable, "-c", _RUNNER, str(folder / "blocks.json"), str(out)], cwd=folder,
                              env=env, capture_output=True, text=True, timeout=TIMEOUT_S)  # fmt: skip
        return proc.stdout[-3000:] + proc.stderr[-3000:]
    except subprocess.TimeoutExpired:
        return f"the blocks ran past {TIMEOUT_S} s"


@pytest.mark.parametrize("block", _of("python"), ids=lambda b: b.id)
def test_python_block(block, python_results):
    ast.parse(block.source, block.page)
    results, log = python_results
    if block.id not in results:
        pytest.fail(f"{block.id} was not reached (an earlier block of the page failed, or the run hung)\n{log}")
    result = results[block.id]
    assert result["error"] is None, f"{block.id} failed:\n{result['error']}\n{log}"
    assert result["s"] <= BLOCK_LIMIT_S, f"{block.id} took {result['s']} s: make the example smaller"
    if block.not_run:
        pytest.skip(f"{block.id} not run: {block.not_run} (syntax and imports checked)")


# ---- commands: shell blocks and inline code ----


@functools.cache
def _cli() -> argparse.ArgumentParser:
    from lightning_memguard.commands.cli import build_parser

    return build_parser()


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    actions = [a for a in _cli()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(actions[0].choices)


@functools.cache
def _make_targets() -> set[str]:
    return set(re.findall(r"^([\w.-]+)\s*:(?!=)", _read("Makefile"), re.M))


@functools.cache
def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def _placeholder(token: str) -> bool:
    return "..." in token or "<" in token or bool(re.fullmatch(r"[A-Z][A-Z0-9_]*", token))


def _script_path(token: str) -> bool:
    return bool(re.fullmatch(r"[\w./-]+\.(py|sh)", token)) and "/" in token


def _check_path(token: str) -> list[str]:
    stem = os.path.splitext(os.path.basename(token))[0]
    if _placeholder(stem) or os.path.exists(os.path.join(ROOT, token)):
        return []
    return [f"{token} does not exist"]


def _check_memguard(args: list[str], whole: bool) -> list[str]:
    if not args or _placeholder(args[0]):
        return []
    parsers = _subparsers()
    if "|" in args:  # `memguard doctor | sweep | plan`: subcommands named
        return [f"`memguard {a}`: no such subcommand" for a in args if a != "|" and a not in parsers]
    if args[0] not in parsers:
        return [f"`memguard {args[0]}`: no such subcommand (the parser has {sorted(parsers)})"]
    known = set(parsers[args[0]]._option_string_actions)
    errors = [f"`memguard {args[0]} {opt}`: no such option" for opt in args[1:]
              if opt.startswith("--") and opt.split("=")[0] not in known]  # fmt: skip
    if whole and not errors and not any(_placeholder(a) for a in args) and not {"-h", "--help"} & set(args):
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                _cli().parse_args(args)
        except SystemExit:
            errors.append(f"`memguard {' '.join(args)}` does not parse")
    return errors


def _check_script(path: str, args: list[str]) -> list[str]:
    errors = _check_path(path)
    if errors or _placeholder(os.path.splitext(os.path.basename(path))[0]):
        return errors
    source = _read(path)
    if path.endswith(".py"):
        defined = set(re.findall(r"add_argument\(\s*[\"'](--[\w-]+)", source)) | {"--help", "-h"}
        errors += [f"`{path} {a}`: the script defines no such option" for a in args
                   if a.startswith("--") and a.split("=")[0] not in defined]  # fmt: skip
    elif os.path.basename(path) == "run_gpu.sh":
        steps = set(re.findall(r"\bwant (\w+)", source))
        errors += [f"`{path}`: no step {a!r} (steps: {sorted(steps)})" for a in args[1:] if not _placeholder(a)
                   and a not in steps]  # fmt: skip
    return errors


def _check_pytest(args: list[str]) -> list[str]:
    markers = {m.split(":")[0].strip() for m in _pyproject()["tool"]["pytest"]["ini_options"]["markers"]}
    errors = []
    for i, arg in enumerate(args):
        if arg == "-m" and i + 1 < len(args):
            names = set(re.findall(r"\w+", args[i + 1])) - {"and", "or", "not"}
            errors += [f"`pytest -m {args[i + 1]}`: no marker {n!r}" for n in sorted(names - markers)]
        elif _script_path(arg) or arg.startswith("tests/"):
            errors += _check_path(arg.split("::")[0])
    return errors


def check_command(words: list[str], whole: bool = True) -> list[str]:
    """What is wrong with one command (already split, comments and brackets gone); [] if nothing is. ``whole``: the
    command is meant to be typed as it stands (a shell block), not a fragment of prose (`memguard plan --compile`)."""
    while words and re.fullmatch(r"\w+=\S*", words[0]):  # VAR=value before the command
        words = words[1:]
    if not words:
        return []
    program, args = re.split(r"[\\/]", words[0])[-1].removesuffix(".exe"), words[1:]
    if program == "memguard":
        return _check_memguard(args, whole)
    if program == "make":
        return [f"`make {t}`: no such target in the Makefile" for t in args if t not in _make_targets()]
    if program in {"bash", "sh"} and args and _script_path(args[0]):
        return _check_script(args[0], args[1:])
    if program == "pytest":
        return _check_pytest(args)
    if program not in {"python", "python3"} or not args:
        return []
    if args[0] != "-m":
        return _check_script(args[0], args[1:]) if _script_path(args[0]) else []
    if len(args) < 2:
        return ["`python -m` names no module"]
    module, rest = args[1], args[2:]
    if module == "pip" and rest[:1] == ["install"]:
        extras = set(_pyproject()["project"]["optional-dependencies"])
        wanted = {e.strip() for a in rest for m in re.findall(r"\.\[([\w,\s-]+)\]", a) for e in m.split(",")}
        return [f"`pip install .[{e}]`: no such extra in pyproject.toml" for e in sorted(wanted - extras)]
    # pip is never looked up: setuptools' distutils shim, asked for `pip`, hands later imports of distutils to the
    # standard library for the rest of the process, and Inductor's C++ builder then fails on it
    if module != "pip" and importlib.util.find_spec(module.split(".")[0]) is None:
        return [f"`python -m {module}`: no such module here"]
    if module in {"lightning_memguard", "lightning_memguard.commands.cli"}:
        return _check_memguard(rest, whole)
    if module == "pytest":
        return _check_pytest(rest)
    return []


def command_lines(source: str, lang: str) -> list[list[str]]:
    """A shell block's commands, split into words: continuations joined, comments, prompts and brackets gone."""
    commands = []
    for line in re.sub(r"\\\n", " ", source).splitlines() if lang != "bat" else source.splitlines():
        line = re.sub(r"^\s*(\$|PS>|>)\s+", "", line)
        if lang == "bat":
            words = [w.strip("\"'") for w in shlex.split(line, posix=False)]
            words = words[: next((i for i, w in enumerate(words) if w in {"REM", "::"}), len(words))]
        else:
            words = shlex.split(line, comments=True)
        words = [w.strip("[]") for w in words]
        if any(words):
            commands.append([w for w in words if w])
    return commands


@pytest.mark.parametrize("block", _of(*SHELL), ids=lambda b: b.id)
def test_shell_block(block):
    commands = command_lines(block.source, block.lang)
    assert commands, f"{block.id}: no command in a {block.lang} block (output is ```text)"
    errors = [e for words in commands for e in check_command(words)]
    assert not errors, f"{block.id}:\n" + "\n".join(errors)


INLINE_COMMAND = re.compile(r"^(\w+=\S+\s+)*(\.venv/\S+/)?(memguard|make|python3?|bash|pytest)\s")


def _split(command: str) -> list[str]:
    try:
        return shlex.split(command)
    except ValueError:  # an apostrophe in prose
        return command.split()


@pytest.mark.parametrize("page", PAGES)
def test_commands_in_prose(page):
    spans = [" ".join(s.split()).replace("\\", "/") for s in re.findall(r"`([^`]+)`", PROSE[page])]
    commands = [s for s in spans if INLINE_COMMAND.match(s + " ")]
    errors = [f"`{s}`: {e}" for s in commands for e in check_command([w.strip("[]") for w in _split(s)], whole=False)]
    assert not errors, f"{page}:\n" + "\n".join(errors)


# ---- yaml blocks: LightningCLI configs ----


def _class_paths(node):
    if isinstance(node, dict):
        if "class_path" in node:
            yield node["class_path"], node.get("init_args") or {}
        for value in node.values():
            yield from _class_paths(value)
    elif isinstance(node, list):
        for value in node:
            yield from _class_paths(value)


@pytest.mark.parametrize("block", _of("yaml"), ids=lambda b: b.id)
def test_yaml_block(block):
    yaml = pytest.importorskip("yaml")
    found = list(_class_paths(yaml.safe_load(block.source)))
    assert found, f"{block.id}: no class_path in the config"
    for class_path, init_args in found:
        module, _, name = class_path.rpartition(".")
        getattr(importlib.import_module(module), name)(**init_args)


# ---- the checks themselves ----


def test_the_checks_catch_rot():
    assert check_command(["memguard", "sweeps"]) and check_command(["memguard", "sweep", "--no-such-option"])
    assert check_command(["memguard", "plan"])  # --effective-batch is required: the line does not parse
    assert not check_command(["memguard", "plan", "--effective-batch", "N"])  # a placeholder: names only
    assert check_command(["make", "no-such-target"]) and not check_command(["make", "test"])
    assert check_command(["python", "examples/no_such.py"]) and not check_command(["python", "benchmarks/NAME.py"])
    assert check_command(["python", "benchmarks/spill.py", "--no-such-option"])
    assert check_command(["bash", "benchmarks/run_gpu.sh", "OUT", "no_such_step"])
    assert check_command(["python", "-m", "pytest", "-m", "no_such_marker"])
    assert check_command(["python", "-m", "pip", "install", "-e", ".[no-such-extra]"])
    blocks, prose = parse_blocks("x.md", "a\n<!-- not run: why -->\n```python\nx = 1\n```\n`make demo`\n")
    assert blocks == [Block("x.md", 3, "python", "x = 1\n", "why")] and "x = 1" not in prose


def test_checking_a_pip_line_leaves_torch_able_to_build_cpp():
    """Looking ``pip`` up through the import system would switch setuptools' distutils shim to the standard library
    for the rest of the process, and the suite's Inductor tests would then fail in a C++ build that has nothing to do
    with the docs."""
    script = (
        "import sys; sys.path[:0] = ['tests', 'tests/project']\n"
        "from test_docs import check_command\n"
        "assert not check_command(['python', '-m', 'pip', 'install', '-e', '.[dev]'])\n"
        "assert not check_command(['python', '-m', 'pip', 'list'])\n"
        "import torch.utils.cpp_extension\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
