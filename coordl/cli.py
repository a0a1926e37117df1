"""``coordl`` command line: ``coordl demo``, ``coordl version``."""
from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _cmd_demo(args) -> int:
    from .demo import run_demo

    run_demo(root=args.root, images=args.images, epochs=args.epochs,
             workers=args.workers, batch_size=args.batch_size)
    return 0


def _cmd_version(args) -> int:
    from . import __version__

    print(__version__)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="coordl", description="coordl data loader tools")
    sub = parser.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="generate a small photo-like ImageFolder and compare coordl with torch's DataLoader")
    d.add_argument("--root", default=None, help="where to generate the dataset (default: a temporary directory, removed afterwards)")
    d.add_argument("--images", type=int, default=600, help="number of images (default 600)")
    d.add_argument("--epochs", type=int, default=2, help="epochs per loader (default 2)")
    d.add_argument("--workers", type=int, default=2, help="worker processes per loader (default 2)")
    d.add_argument("--batch-size", type=int, default=32, help="batch size (default 32)")
    d.set_defaults(func=_cmd_demo)

    v = sub.add_parser("version", help="print coordl's version")
    v.set_defaults(func=_cmd_version)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
