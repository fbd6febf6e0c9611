"""The import rules of docs/architecture.md hold: the import-linter contracts in
pyproject.toml (layers, pure policy and losses, config as a leaf, no cycles), no cycle
between any two modules of fnrl and the lab, and no file over 600 lines."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 600


def test_import_contracts_are_kept():
    lint = Path(sys.executable).parent / "lint-imports"
    done = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's algorithm, iterative (the graph is a few hundred modules deep at most)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                components.append(component)
    return components


def test_strongly_connected_by_hand():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert sorted(map(sorted, strongly_connected(graph))) == [["a", "b", "c"], ["d"], ["e"]]


def test_no_module_import_cycles():
    # TYPE_CHECKING imports count: a cycle that only a type checker sees is still a knot.
    graph = grimp.build_graph("fnrl", "lab", exclude_type_checking_imports=False, cache_dir=None)
    edges = {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}
    cycles = [sorted(c) for c in strongly_connected(edges) if len(c) > 1]
    assert not cycles, f"import cycles: {cycles}"


def test_no_file_over_600_lines():
    long = {str(p.relative_to(ROOT)): n for package in ("fnrl", "lab")
            for p in sorted((ROOT / package).rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines: {long}"
