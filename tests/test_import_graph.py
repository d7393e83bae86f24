"""labkit's packages import each other in one direction only: no import cycles, lazy imports included.

A unit is a top-level module (``labkit.train``) or a subpackage (``labkit.parallel``, everything under
it). An import inside a function counts as much as one at the top: it is the same dependency, only
deferred, and a cycle through it is the same knot for a reader.
"""
import ast
from collections import defaultdict
from pathlib import Path

import labkit

PACKAGE = Path(labkit.__file__).parent


def unit(module: str) -> str:
    return ".".join(module.split(".")[:2])


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> list[tuple[str, int]]:
    """(module, line) for every import in a file, relative ones resolved."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                found.append((".".join(base + ([node.module] if node.module else [])), node.lineno))
            else:
                found.append((node.module or "", node.lineno))
        elif isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
    return found


def import_graph() -> tuple[dict[str, set[str]], dict[tuple[str, str], list[str]]]:
    edges, where = defaultdict(set), defaultdict(list)
    for path in sorted(PACKAGE.rglob("*.py")):
        source = unit(module_name(path))
        for target, line in imported_modules(path):
            if target.startswith("labkit.") and unit(target) != source:
                edges[source].add(unit(target))
                where[(source, unit(target))].append(f"{path.relative_to(PACKAGE.parent)}:{line}")
    return edges, where


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm: the groups of units that reach each other (a cycle when larger than one)."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            groups.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return groups


def test_the_graph_sees_known_dependencies():
    edges, where = import_graph()
    assert "labkit.parallel" in edges["labkit.train"]  # a top-level import
    assert "labkit.consistency" in edges["labkit.train"]  # a lazy one, inside train()
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"], ["d"]]


def test_no_import_cycles():
    edges, where = import_graph()
    cycles = [group for group in strongly_connected(edges) if len(group) > 1]
    described = [f"{a} -> {b} ({', '.join(where[(a, b)][:3])})"
                 for group in cycles for a in group for b in sorted(edges[a]) if b in group]
    assert not cycles, "import cycles:\n" + "\n".join(described)
