"""The house's rules, read from the source: imports run one way, each room keeps to itself."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("shared", "producer", "worker", "localpool")
MAX_LINES = 450


def modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def imports() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports, ``TYPE_CHECKING`` imports included."""
    mods = modules()

    def ours(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {m: set() for m in mods}
    for module, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                target = ours(name)
                if target is not None and target != module:
                    edges[module].add(target)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_no_import_circle() -> None:
    assert cycles(imports()) == []


def test_each_side_keeps_to_itself() -> None:
    edges = imports()
    wrong = sorted(
        (m, t)
        for m, targets in edges.items()
        for t in targets
        if (m.startswith("producer") and t.startswith("worker"))
        or (m.startswith("shared") and not t.startswith("shared"))
        or (not m.startswith("localpool") and t.startswith("localpool"))
        or (
            m.startswith("worker.backends")
            and t.startswith("worker")
            and not t.startswith("worker.backends")
        )
    )
    assert wrong == []


def test_the_cycle_finder_finds_one() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_over_the_size_limit() -> None:
    sizes = {m: len(p.read_text().splitlines()) for m, p in modules().items()}
    assert {m: n for m, n in sizes.items() if n > MAX_LINES} == {}


def test_key_names_are_spelled_in_shared_keys_only() -> None:
    """No key literal (the default prefix and a colon) outside ``shared/keys.py``, benchmarks
    included: a key is built by ``shared.keys.Keys``, or a second prefix misses it."""
    spelled = []
    for path in [*modules().values(), *(ROOT / "bench").rglob("*.py")]:
        if path == ROOT / "shared" / "keys.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"""["']lmpool:""", line):
                spelled.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert spelled == []
