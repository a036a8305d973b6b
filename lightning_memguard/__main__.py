"""``python -m lightning_memguard ...``: the ``memguard`` command, where no console script is on the PATH."""

from __future__ import annotations

import sys

from lightning_memguard.commands.cli import main

if __name__ == "__main__":
    sys.exit(main())
