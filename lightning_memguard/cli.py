"""The ``memguard`` command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit code 2, no usage dump
        self.exit(2, f"memguard: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="memguard", description="Keep GPU training fast and honest about memory.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    demo = sub.add_parser("demo", help="train a ResNet on synthetic images with MemGuard and print its table")
    demo.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    demo.add_argument("--epochs", type=int, default=None)
    demo.add_argument("--out", default="demo_logs", help="folder for the CSV logs")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        if args.epochs is not None and args.epochs < 1:
            print(f"memguard: error: --epochs must be >= 1, got {args.epochs}", file=sys.stderr)
            return 2
        from lightning_memguard.demo import run_demo

        run_demo(args.device, args.epochs, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
