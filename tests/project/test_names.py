"""Names a reader follows lead somewhere: no two modules of the package share a name, and every module or file the
package's docstrings and comments, the docs and the README name exists."""

from __future__ import annotations

import collections
import importlib
import pathlib
import re

import pytest
import torch

import lightning_memguard

PACKAGE = pathlib.Path(lightning_memguard.__file__).parent
REPO = PACKAGE.parent
TEXTS = [*sorted(PACKAGE.rglob("*.py")), *sorted((REPO / "docs").rglob("*.md")), REPO / "README.md",
         PACKAGE / "checkpointing" / "README.md"]  # fmt: skip

DOTTED = re.compile(r"(?<![\w.])lightning_memguard(?:\.\w+)+")
FILE = re.compile(r"(?<![\w./-])((?:\w+/)*\w+\.py)\b")


def _module_files() -> list[pathlib.Path]:
    return [p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"]


def test_no_two_modules_share_a_name():
    names = collections.Counter(p.name for p in _module_files())
    assert sorted(n for n, k in names.items() if k > 1) == []


def _resolves(dotted: str) -> bool:
    """``dotted`` is a module of the package, or a module and attributes inside it."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[cut:]:
            if not hasattr(obj, attribute):
                return False
            obj = getattr(obj, attribute)
        return True
    return False


def _named_files() -> set[str]:
    files = {str(p.relative_to(REPO)) for p in REPO.rglob("*.py") if ".venv" not in p.parts and ".git" not in p.parts}
    return files


def _file_exists(reference: str, files: set[str]) -> bool:
    """A path named in a text: the repository's, the package's, or a short form (``callbacks/memguard.py``) that
    ends one of the package's paths; a torch source (``torch/autograd/function.py``) in the installed torch; a
    placeholder in capitals (``benchmarks/NAME.py``) is none."""
    if reference.startswith("torch/"):
        return (pathlib.Path(torch.__file__).parent.parent / reference).is_file()
    if pathlib.Path(reference).stem.isupper():
        return True
    return any(f == reference or f.endswith(f"/{reference}") for f in files)


MODULE_OF_PACKAGE = re.compile(r":(?:mod|class|func|meth|attr|data):`~?(\.+)(\w+)")  # the first name: a module


def test_every_module_named_relatively_exists():
    """A module named from its package (``:mod:`.graphs``` in ``_compiler/``, ``:mod:`..surgery``` one package up)
    exists: a package's face that lists its modules lists ones that exist."""
    missing = [
        f"{face.relative_to(REPO)}: {dots}{name}"
        for face in PACKAGE.rglob("*.py")
        for dots, name in MODULE_OF_PACKAGE.findall(face.read_text(encoding="utf-8"))
        if not (face.parents[len(dots) - 1] / f"{name}.py").is_file()
        and not (face.parents[len(dots) - 1] / name / "__init__.py").is_file()
    ]
    assert missing == []


def test_every_module_and_file_named_in_the_docstrings_and_the_docs_exists():
    files = _named_files()
    missing = []
    for text in TEXTS:
        # a table's "before" row names the files as they were, and a placeholder (benchmarks/NAME.py) none
        lines = text.read_text(encoding="utf-8").splitlines()
        content = "\n".join(line for line in lines if not line.startswith("| before"))
        where = text.relative_to(REPO)
        missing += [f"{where}: {name}" for name in sorted(set(DOTTED.findall(content))) if not _resolves(name)]
        missing += [f"{where}: {name}" for name in sorted(set(FILE.findall(content))) if not _file_exists(name, files)]
    assert missing == []


@pytest.mark.parametrize(
    ("reference", "exists"),
    [("lightning_memguard.core.units", True), ("lightning_memguard.core.units.parse_bytes", True),
     ("lightning_memguard.core.nowhere", False), ("lightning_memguard.core.units.nothing", False)],
)  # fmt: skip
def test_a_dotted_name_resolves_only_where_it_exists(reference, exists):
    assert _resolves(reference) is exists


def test_a_short_path_resolves_only_where_a_file_ends_so():
    files = {"lightning_memguard/callbacks/memguard.py", "tests/core/test_core.py"}
    assert _file_exists("callbacks/memguard.py", files)
    assert _file_exists("memguard.py", files)
    assert not _file_exists("callbacks/_private.py", files)
