"""Config keys and flags that changed their spelling: old config files, old run
directories' config.json and old command lines still load, each with a warning that
names the new spelling. A rename adds a row here, and nowhere else.

- A *move*: a field that now lives with its concern (`eval_every` is `eval.every`).
- A key that *became a section*: its old value is one field of the section now
  (`faults.inject`, the list of kills, is `faults.inject.kills`).
- A *switch* that became a section that is off when absent (`X | None`): `use_repack:
  true` beside `repack: {...}` is now `repack: {...}` (on) or `repack: null` (off); on
  the command line `--coord.use-repack` is `coord.repack:on` and `--coord.no-use-repack`
  is `coord.repack:off` (tyro's subcommands for an optional section).
"""

from __future__ import annotations

import sys

ROOT = "RunConfig"
# old dotted key -> new dotted key, both from the RunConfig root
MOVED: dict[str, str] = {
    "eval_every": "eval.every",
    "trainer_timeout_s": "trainer.call_timeout_s",
    "coord.pool_fsync": "fsync_logs",
    "faults.seed": "faults.inject.seed",
    "faults.inject_corrupt_publish": "faults.inject.corrupt_publish",
    "faults.inject_noise": "faults.inject.noise",
    "faults.inject_bad_logprobs": "faults.inject.bad_logprobs",
    "faults.inject_logprob_shift": "faults.inject.logprob_shift",
    "rollout.groups_per_batch": "rollout.queued_groups",
    "rollout.dtype": "rollout.serve_dtype",
}
# old dotted key whose value is not a mapping -> the field of the section it became
BECAME_SECTION: dict[str, str] = {"faults.inject": "faults.inject.kills"}
# (the class that held it, its old on/off key) -> the section that says it by presence
SWITCHES: dict[tuple[str, str], str] = {
    ("CoordinatorConfig", "use_repack"): "repack",
    ("CoordinatorConfig", "use_balance"): "balance",
}
FLAG_PREFIX = {"CoordinatorConfig": "coord"}   # where a class sits on the command line


def warn(old: str, new: str, where: str) -> None:
    print(f"fnrl: {where}: {old} is deprecated; write {new}", file=sys.stderr, flush=True)


def _parent(data: dict, path: str, *, make: bool) -> dict | None:
    """The mapping that holds `path`'s last key (made on the way when `make`)."""
    *sections, _ = path.split(".")
    for name in sections:
        if not isinstance(data.get(name), dict):
            if not make or name in data:
                return None
            data[name] = {}
        data[name] = dict(data[name])   # copied: the caller's mapping is left as it was
        data = data[name]
    return data


def upgrade(owner: str, data: dict, *, where: str, prefix: str = "") -> dict:
    """`data`, the fields of an `owner` config as a file or config.json holds them, with
    every old spelling written as the new one (a copy)."""
    out = dict(data)
    if owner == ROOT and not prefix:
        for old, new in BECAME_SECTION.items():
            held = _parent(out, old, make=False)
            key = old.rpartition(".")[2]
            if held is not None and key in held and not isinstance(held[key], dict):
                warn(old, new, where)
                held[key] = {new.rpartition(".")[2]: held[key]}
        for old, new in MOVED.items():
            held = _parent(out, old, make=False)
            key = old.rpartition(".")[2]
            if held is None or key not in held:
                continue
            warn(old, new, where)
            value = held.pop(key)
            target = _parent(out, new, make=True)
            if target is None:
                raise ValueError(f"{where}: {old} moved to {new}, but the file gives "
                                 f"{new.rpartition('.')[0]} a value that is not a mapping")
            target.setdefault(new.rpartition(".")[2], value)
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


def _flag(path: str, *, negated: bool = False) -> str:
    *sections, key = path.split(".")
    key = ("no-" if negated else "") + key
    return "--" + ".".join([*sections, key]).replace("_", "-")


def old_flags() -> dict[str, str]:
    """Every old flag -> its new spelling (a flag, or an optional section's subcommand)."""
    flags = {}
    for old, new in {**MOVED, **BECAME_SECTION}.items():
        flags[_flag(old)] = _flag(new)
        flags[_flag(old, negated=True)] = _flag(new, negated=True)   # a boolean's off
    for (cls, old), new in SWITCHES.items():
        prefix = FLAG_PREFIX[cls]
        flags[_flag(f"{prefix}.{old}")] = f"{prefix}.{new}:on"
        flags[_flag(f"{prefix}.{old}", negated=True)] = f"{prefix}.{new}:off"
    return flags


def upgrade_argv(argv: list[str]) -> list[str]:
    """A command line with every old flag written as its new spelling."""
    flags, out = old_flags(), []
    for arg in argv:
        flag, eq, value = arg.partition("=")
        if flag in flags:
            warn(flag, flags[flag], "command line")
            arg = flags[flag] + eq + value
        out.append(arg)
    return out
