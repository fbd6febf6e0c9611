"""python -m lab.repro SETUP|all [--seeds 0 1 2] [--quick] [--out runs/repro]"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from pathlib import Path
from typing import Callable

import lab.repro as repro


def load_all() -> None:
    for mod in pkgutil.iter_modules(repro.__path__):
        if not mod.name.startswith("_"):
            importlib.import_module(f"lab.repro.{mod.name}")


def setup_parser(doc: str, setup_help: str) -> argparse.ArgumentParser:
    """SETUP|all, --seeds, --quick and --out: what every command over the setups takes."""
    ap = argparse.ArgumentParser(description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("setup", help=setup_help)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--quick", action="store_true", help="the smaller run of each setup")
    ap.add_argument("--out", default="runs/repro")
    return ap


def exit_with(main: Callable[[], int], prog: str) -> None:
    """Runs a command's main; an invalid setup or config exits 2 with its message."""
    try:
        sys.exit(main())
    except ValueError as err:
        print(f"{prog}: {err}", file=sys.stderr)
        sys.exit(2)


def main(argv=None) -> int:
    load_all()
    ap = setup_parser(repro.__doc__, f"one of {sorted(repro.SETUPS)} or 'all'")
    ap.add_argument("--only", nargs="*", default=[], help="run only these systems")
    args = ap.parse_args(argv)
    names = sorted(repro.SETUPS) if args.setup == "all" else [args.setup]
    for name in names:
        res = repro.reproduce(name, seeds=tuple(args.seeds), quick=args.quick,
                              out=Path(args.out), only=tuple(args.only))
        if not args.only:
            print(f"\n## {res.setup.paper}\n\n{res.table()}\n")
    return 0


if __name__ == "__main__":
    exit_with(main, "lab.repro")
