"""`make`'s install: uv installs from the package sources pip is set to use (tools/pip_indexes.py)."""

from __future__ import annotations

import importlib.util
import os

TOOL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "pip_indexes.py")


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
