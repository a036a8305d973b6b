"""pip's configured package sources, printed as uv's options: `make` installs with uv, which unpacks torch's
wheels several times faster than pip, and reads no pip configuration of its own. Sources set for pip (a
company's mirror, a folder of wheels, a constraints file) are uv's too; where none is set, nothing is printed
and both use PyPI.

Usage: python tools/pip_indexes.py    (prints shell words for `uv pip install`)
"""

from __future__ import annotations

import ast
import shlex
import subprocess
import sys

# pip's option -> uv's; each may hold several values, separated by spaces
OPTIONS = {
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
}
# pip's precedence: its environment variables over the config files' [install] section over their [global] one
SECTIONS = (":env:", "install", "global")


def uv_options(listing: str) -> list[str]:
    """uv's options for the settings in ``listing``, the output of ``pip config list`` (``section.option='value'``)."""
    found: dict[str, dict[str, str]] = {}
    for line in listing.splitlines():
        name, _, value = line.partition("=")
        section, _, option = name.rpartition(".")
        if option in OPTIONS and section in SECTIONS:
            found.setdefault(option, {})[section] = ast.literal_eval(value)
    words = []
    for option, flag in OPTIONS.items():
        if option in found:
            value = next(found[option][s] for s in SECTIONS if s in found[option])
            words += [f"{flag}={v}" for v in value.split()]
    return words


def main() -> None:
    listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    print(" ".join(shlex.quote(word) for word in uv_options(listing.stdout)))


if __name__ == "__main__":
    main()
