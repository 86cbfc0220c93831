"""The import graph between pdserve modules has no cycle, counting lazy imports.

Every `import` in a module counts: at the top, inside functions, and under `TYPE_CHECKING`
(docs/architecture.md §Layers). Read from the source with `ast`, so nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pdserve

ROOT = Path(pdserve.__file__).parent

# Cycles allowed to remain, each to be named in docs/architecture.md §Known deviations: none.
KNOWN_CYCLES: set[frozenset[str]] = set()


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The pdserve modules `path` imports, anywhere in it."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}  # `from pkg import module`
    return {m for m in out if m in modules and m != name}


def graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in ROOT.rglob("*.py")}
    return {name: imports_of(path, set(files)) for name, path in files.items()}


def cycles(g: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    counter = 0
    for root in sorted(g):
        if root in index:
            continue
        work = [(root, iter(sorted(g[root])))]
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
                    work.append((child, iter(sorted(g[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = set()
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.add(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    found.append(frozenset(comp))
    return found


def test_the_cycle_finder_finds_a_cycle():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(g) == [frozenset({"a", "b", "c"})]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_lazy_and_type_checking_imports():
    g = graph()
    assert "pdserve.kvcache.lease" in g["pdserve.engine.role"]  # under TYPE_CHECKING
    assert "pdserve.model.builtin" in g["pdserve.launch"]  # imported inside a function


def test_no_import_cycle_but_the_known_ones():
    assert set(cycles(graph())) == KNOWN_CYCLES


# docs/architecture.md §Layers: a package imports only from packages of lower layers.
LAYERS = {
    "protocol": 0, "runtime": 0, "config": 0, "parallel": 0,
    "kvcache": 1, "attention": 1, "kernels": 1, "model": 1,
    "engine": 2,
    "transfer": 3, "server": 3,
    "frontend": 4,
    "worker": 5, "router": 5,
    "doctor": 6, "demo": 6, "bench": 6, "engine_flags": 6,
    "chaos": 7, "launch": 7,
    "cli": 8, "__main__": 9,
}  # fmt: skip
# Known exceptions, each in §Known deviations.
ALLOWED_UPWARD = {
    ("config", "protocol"),  # same layer: BACKENDS, the wire's names
    ("model", "attention"),  # same layer: the AttentionContext a model's layers call
    ("model", "kernels"),  # same layer: the fused ops
    ("model", "kvcache"),  # same layer: V3.2's indexer names its index-K buffers (layout.py)
    ("attention", "kvcache"),  # same layer: the pool's views
    ("attention", "kernels"),  # same layer: RoPE's math, which the fused RoPE + KV store shares
    ("transfer", "kvcache"),
}


def package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else module


def test_packages_import_only_from_lower_layers():
    wrong = set()
    for module, imports in graph().items():
        src = package(module)
        for imported in imports:
            dst = package(imported)
            if dst == src or (src, dst) in ALLOWED_UPWARD:
                continue
            if LAYERS[dst] >= LAYERS[src]:
                wrong.add((src, dst))
    assert wrong == set(), sorted(wrong)


# docs/architecture.md §Layers, worker/: each side stands alone. A part imports only itself
# and the parts named here; the prefill and decode roles never import each other.
WORKER_PARTS = {
    "pd_role": set(),  # what both roles share
    "prefill": {"pd_role"},
    "decode": {"pd_role"},
    "host": {"prefill", "decode", "pd_role"},  # builds the engine with its role
    "http": {"host"},  # the worker's endpoints, over the engine host's surface
    "server": {"host", "http"},  # the process
}


def worker_part(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "worker" else None


def test_the_worker_s_parts_import_only_what_they_build_on():
    g = graph()
    parts = {worker_part(m) for m in g} - {None}
    assert parts == set(WORKER_PARTS), parts  # a new part is placed in the table
    wrong = set()
    for module, imports in g.items():
        src = worker_part(module)
        for imported in imports:
            dst = worker_part(imported)
            if src and dst and dst != src and dst not in WORKER_PARTS[src]:
                wrong.add((src, dst))
    assert wrong == set(), sorted(wrong)
