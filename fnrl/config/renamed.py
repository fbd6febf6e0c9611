"""Config keys and flags that changed their spelling: old config files, old run
directories' config.json and old command lines still load, each with a warning that
names the new spelling. A rename adds a row here, and nowhere else.

A *switch* became a section that is off when absent (`X | None`): `use_repack: true`
beside `repack: {...}` is now `repack: {...}` (on) or `repack: null` (off); on the
command line `--coord.use-repack` is `coord.repack:on` and `--coord.no-use-repack` is
`coord.repack:off` (tyro's subcommands for an optional section)."""

from __future__ import annotations

import sys

# (the class that held it, its old on/off key) -> the section that says it by presence
SWITCHES: dict[tuple[str, str], str] = {
    ("CoordinatorConfig", "use_repack"): "repack",
    ("CoordinatorConfig", "use_balance"): "balance",
}
# Where a class sits on the command line (a RunConfig field), for the old flags.
FLAG_PREFIX = {"CoordinatorConfig": "coord"}


def warn(old: str, new: str, where: str) -> None:
    print(f"fnrl: {where}: {old} is deprecated; write {new}", file=sys.stderr, flush=True)


def upgrade(owner: str, data: dict, *, where: str, prefix: str = "") -> dict:
    """`data`, the fields of a `owner` config as a file or config.json holds them, with
    every old switch written as its section (a copy)."""
    out = dict(data)
    for (cls, old), new in SWITCHES.items():
        if cls != owner or old not in out:
            continue
        on = out.pop(old)
        warn(prefix + old, f"{prefix}{new} (a mapping of its fields; null for off)", where)
        if not on:
            out[new] = None
        elif out.get(new) is None:
            out[new] = {}
    return out


def upgrade_argv(argv: list[str]) -> list[str]:
    """A command line with every old switch flag written as its subcommand."""
    flags = {}
    for (cls, old), new in SWITCHES.items():
        prefix, dashed = FLAG_PREFIX[cls], old.replace("_", "-")
        flags[f"--{prefix}.{dashed}"] = f"{prefix}.{new}:on"
        flags[f"--{prefix}.no-{dashed}"] = f"{prefix}.{new}:off"
    out = []
    for arg in argv:
        if arg in flags:
            warn(arg, flags[arg], "command line")
        out.append(flags.get(arg, arg))
    return out
