"""The package's shape: no import circles between its modules (imports inside functions count too:
a circle deferred to call time is still a circle in the design)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "seco_lab"


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module and package of seco_lab."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imported(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The seco_lab modules ``module`` imports.  ``from P import name`` names the submodule P.name when
    there is one, else the module P (a package's __init__)."""
    deps = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            deps |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            subs = {f"{prefix}.{a.name}" for a in node.names if f"{prefix}.{a.name}" in modules}
            deps |= subs
            if len(subs) < len(node.names) and prefix in modules:
                deps.add(prefix)
    deps.discard(module)
    return deps


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {m: imported(m, p, modules) for m, p in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_the_circle_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_relative_and_deferred_imports():
    graph = import_graph()
    assert "seco_lab.models.hf" in graph["seco_lab.models.pretrained"]  # a deferred (function-level) import
    assert "seco_lab.store" in graph["seco_lab.studies.bias.driver"]  # a relative import two levels up


def test_no_import_circles_in_seco_lab():
    assert circles(import_graph()) == []
