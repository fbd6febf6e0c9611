"""python -m fnrl.sim.repro SETUP|all [--seeds 0 1 2] [--quick] [--out runs/repro]"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from pathlib import Path

import fnrl.sim.repro as repro


def load_all() -> None:
    for mod in pkgutil.iter_modules(repro.__path__):
        if not mod.name.startswith("_"):
            importlib.import_module(f"fnrl.sim.repro.{mod.name}")


def main(argv=None) -> int:
    load_all()
    ap = argparse.ArgumentParser(description=repro.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("setup", help=f"one of {sorted(repro.SETUPS)} or 'all'")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--quick", action="store_true", help="the smaller run of each setup")
    ap.add_argument("--only", nargs="*", default=[], help="run only these systems")
    ap.add_argument("--out", default="runs/repro")
    args = ap.parse_args(argv)
    names = sorted(repro.SETUPS) if args.setup == "all" else [args.setup]
    for name in names:
        res = repro.reproduce(name, seeds=tuple(args.seeds), quick=args.quick,
                              out=Path(args.out), only=tuple(args.only))
        if not args.only:
            print(f"\n## {res.setup.paper}\n\n{res.table()}\n")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ValueError as err:
        print(f"fnrl.sim.repro: {err}", file=sys.stderr)
        sys.exit(2)
