"""`make`'s install: uv installs from the package sources pip is set to use (tools/pip_indexes.py)."""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "tools", "pip_indexes.py")


def _uv_options(listing: str) -> list[str]:
    spec = importlib.util.spec_from_file_location("pip_indexes", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.uv_options(listing)


def test_the_sources_pip_is_set_to_use_are_uvs_with_pips_precedence():
    listing = "\n".join([
        "global.index-url='https://mirror.example/simple'",
        "global.extra-index-url='file:///opt/a/simple file:///opt/b/simple'",
        "global.find-links='/opt/old'",
        "install.find-links='/opt/install'",
        ":env:.find-links='/opt/wheels'",  # PIP_FIND_LINKS
        "global.constraint='/etc/pip/constraints.txt'",
        "global.cert='/etc/ssl/certs/ca.crt'",  # not a package source
        "global.timeout='60'",
    ])  # fmt: skip
    assert _uv_options(listing) == [
        "--index-url=https://mirror.example/simple",
        "--extra-index-url=file:///opt/a/simple", "--extra-index-url=file:///opt/b/simple",
        "--find-links=/opt/wheels",
        "--constraint=/etc/pip/constraints.txt",
    ]  # fmt: skip
    assert _uv_options("install.find-links='/opt/install'\nglobal.find-links='/opt/old'") == [
        "--find-links=/opt/install"
    ]


def test_nothing_set_for_pip_leaves_uv_on_pypi():
    assert _uv_options("") == []
    assert _uv_options("global.timeout='60'\n") == []


# ---------------------------------------------------------------- the documented install from a clone

ROOT = os.path.dirname(os.path.dirname(TOOL))


def _install_lines(doc: str) -> list[str]:
    """The ``pip install`` lines a user types into an existing environment, as ``doc`` gives them (the ones inside a
    fresh ``.venv`` start with its python)."""
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip().startswith("pip install")]


def test_the_documented_install_into_an_existing_environment_installs_the_clone(tmp_path):
    # the package is not on PyPI: the README and docs/windows.md give one line, run from the clone's folder
    lines = {doc: _install_lines(doc) for doc in ("README.md", "docs/windows.md")}
    assert lines == {"README.md": ['pip install -e ".[windows]"'], "docs/windows.md": ['pip install -e ".[windows]"']}
    clone = tmp_path / "lightning-memguard"
    clone.mkdir()
    for name in ("pyproject.toml", "README.md", "lightning_memguard"):
        source = os.path.join(ROOT, name)
        if os.path.isdir(source):
            shutil.copytree(source, clone / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(source, clone / name)
    prefix = tmp_path / "environment"
    _pip, install, *arguments = shlex.split(lines["README.md"][0])
    # that line, offline (the environment's packages, torch and Lightning, are there already: nothing from an index),
    # into a prefix of its own; --ignore-installed, or pip would first uninstall this checkout's own editable install
    offline = ["--no-deps", "--no-build-isolation", "--no-index", "--ignore-installed", "--prefix", str(prefix), "-q"]
    proc = subprocess.run([sys.executable, "-m", "pip", install, *offline, *arguments], cwd=clone,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    still = subprocess.run([sys.executable, "-c", "import lightning_memguard"], cwd=tmp_path, capture_output=True)
    assert still.returncode == 0, "the install took this checkout's own out of the environment that runs the tests"
    (dist,) = prefix.rglob("lightning_memguard-*.dist-info")  # in the environment's site-packages
    metadata = (dist / "METADATA").read_text(encoding="utf-8")
    assert "Provides-Extra: windows" in metadata
    assert 'triton-windows>=3.2; sys_platform == "win32" and extra == "windows"' in metadata
    assert "memguard = lightning_memguard.commands.cli:main" in (dist / "entry_points.txt").read_text(encoding="utf-8")
    # that environment imports the package from the clone's files (-e), not from this checkout
    find = "import importlib.util; print(importlib.util.find_spec('lightning_memguard').origin)"
    where = subprocess.run([sys.executable, "-S", "-c", f"import site; site.addsitedir({str(dist.parent)!r}); {find}"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert where.stdout.strip() == str(clone / "lightning_memguard" / "__init__.py"), where.stderr


def test_the_floor_that_make_test_floor_installs_is_the_lower_bound_pyproject_declares():
    """``make test-floor`` (run by CI after ``make test``) pins tools/floor.txt; each pin is the lower bound that
    pyproject.toml declares for it, so the range users are promised is the range tested, and the README says it."""
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement

    root = Path(__file__).parents[2]
    project = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    declared = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["dev"]]
    lower = {r.name: s.version for r in declared for s in r.specifier if s.operator == ">="}
    lines = (root / "tools" / "floor.txt").read_text(encoding="utf-8").splitlines()
    pins = dict(line.split("==") for line in lines if line and not line.startswith("#"))
    assert pins.keys() == {"torch", "torchvision", "lightning", "timm", "transformers"}
    assert {name: lower[name] for name in pins} == pins
    readme = (root / "README.md").read_text(encoding="utf-8")
    assert f"torch {pins['torch']}" in readme and f"Lightning {pins['lightning']}" in readme
