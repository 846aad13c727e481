"""The import graph of ``qcore.*``, built from the source (issue 32): no cycles, counting imports inside functions;
a deferred (function-level) import of a qcore module only where that module needs an optional heavy dependency
the importer does not; and the direction of the layers (``qcore`` <- ``algorithms`` <- ``adapters``, ``qcore`` <-
``formats`` <- ``adapters``; within adapters jobs > passes > io/eval > modules > config).

``python tests/test_import_graph.py`` prints the graph's figures (modules, edges, deferred imports, cycles).
"""

from __future__ import annotations

import ast
import collections
import pathlib
import sys

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"
# optional heavy dependencies: a module may import them (or a qcore module that needs them) inside a function
HEAVY = {"torch", "triton", "transformers", "onnx", "onnxruntime", "lm_eval", "matplotlib", "gguf", "accelerate",
         "safetensors", "ml_dtypes", "tqdm", "llama_cpp", "compressed_tensors", "sentencepiece", "scipy"}


def _module_name(path: pathlib.Path, src: pathlib.Path = SRC) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _in_type_checking(node, parents) -> bool:
    p = parents.get(node)
    while p is not None:
        if isinstance(p, ast.If) and "TYPE_CHECKING" in ast.unparse(p.test):
            return True
        p = parents.get(p)
    return False


def deferred_statements(src: pathlib.Path = SRC) -> list:
    """``[(importer, imported qcore module, line)]`` for every import statement of a qcore module inside a function
    (each one, also where the importer imports the same module at module level elsewhere)."""
    files = {_module_name(p, src): p for p in (src / "qcore").rglob("*.py")}
    out = []
    for mod, path in files.items():
        tree = ast.parse(path.read_text())
        parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            p = parents.get(node)
            while p is not None and not isinstance(p, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                p = parents.get(p)
            if p is None:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                b = ".".join(base[:len(base) - (node.level - 1)] + ([node.module] if node.module else [])) \
                    if node.level else node.module
                targets = [f"{b}.{a.name}" if f"{b}.{a.name}" in files else b for a in node.names]
            for t in targets:
                while t and t not in files:
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    out.append((mod, t, node.lineno))
    return out


def build_graph(src: pathlib.Path = SRC):
    """``(modules, edges)``: ``edges[a]`` = ``{b: deferred}`` over qcore modules (``deferred``: every import of
    ``b`` in ``a`` is inside a function), and ``externals[a]`` = ``{top-level package: deferred}``."""
    files = {_module_name(p, src): p for p in (src / "qcore").rglob("*.py")}
    edges: dict = collections.defaultdict(dict)
    externals: dict = collections.defaultdict(dict)
    for mod, path in files.items():
        tree = ast.parse(path.read_text())
        parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
        is_pkg = path.name == "__init__.py"

        def deferred(node) -> bool:
            p = parents.get(node)
            while p is not None:
                if isinstance(p, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                    return True
                p = parents.get(p)
            return False

        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or _in_type_checking(node, parents):
                continue
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[:len(base) - (node.level - 1)]
                    b = ".".join(base + ([node.module] if node.module else []))
                else:
                    b = node.module
                targets = [f"{b}.{a.name}" if f"{b}.{a.name}" in files else b for a in node.names]
            d = deferred(node)
            for t in targets:
                if t.split(".")[0] != "qcore":
                    top = t.split(".")[0]
                    externals[mod][top] = externals[mod].get(top, True) and d
                    continue
                while t and t not in files:
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    edges[mod][t] = edges[mod].get(t, True) and d
    return set(files), edges, externals


def cycles(modules, edges) -> list:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(modules):
        if v not in index:
            visit(v)
    return out


def heavy_at_import(modules, edges, externals) -> dict:
    """``{module: the heavy dependencies importing it loads}`` (module-level imports, transitively)."""
    memo: dict = {}

    def need(m, seen=()):
        if m in memo:
            return memo[m]
        own = {t for t, d in externals.get(m, {}).items() if not d and t in HEAVY}
        for t, d in edges.get(m, {}).items():
            if not d and t not in seen:
                own |= need(t, seen + (m,))
        memo[m] = own
        return own

    return {m: need(m) for m in modules}


def hidden_loops(modules, edges, externals) -> list:
    """Deferred imports of qcore modules that defer no heavy dependency: ``(importer, imported)``."""
    heavy = heavy_at_import(modules, edges, externals)
    return sorted((a, b) for a, es in edges.items() for b, d in es.items() if d and not heavy[b] - heavy[a])


# the layers, lowest first: a module may import its own layer and those below, never one above
ADAPTER_LAYERS = [
    ("config", ["qcore.adapters.config", "qcore.adapters.presets", "qcore.adapters.recipes", "qcore.adapters.families",
                "qcore.adapters.batches", "qcore.adapters._device", "qcore.adapters.gguf_names"]),
    ("modules", ["qcore.adapters.modules", "qcore.adapters.plan", "qcore.adapters.moe", "qcore.adapters._calib_tail",
                 "qcore.adapters.distributed", "qcore.adapters.triton", "qcore.adapters.gguf_mix",
                 "qcore.adapters.imatrix", "qcore.adapters.calibration"]),
    ("io/eval", ["qcore.adapters.io", "qcore.adapters.eval"]),
    ("passes", ["qcore.adapters.passes", "qcore.adapters.quantizer"]),
    ("jobs", ["qcore.adapters.jobs", "qcore.adapters.cli", "qcore.adapters"]),
]


def layer_of(mod: str):
    """``(rank, name)`` of ``mod``'s layer: the core, formats, algorithms, the numpy command line, then the adapter
    layers."""
    if mod in ("qcore.cli", "qcore.__main__"):
        return 2.5, "cli"  # the numpy command line runs the core, formats (inspect) and conformance commands
    if mod.startswith("qcore.adapters"):
        best = None
        for rank, (name, prefixes) in enumerate(ADAPTER_LAYERS):
            for p in prefixes:  # the package itself is named exactly: a new module of it must be given a layer
                inside = mod == p or (p != "qcore.adapters" and mod.startswith(p + "."))
                if inside and (best is None or len(p) > best[2]):
                    best = (rank + 3, name, len(p))
        return None if best is None else best[:2]
    for rank, name in ((1, "formats"), (2, "algorithms")):
        if mod.startswith(f"qcore.{name}"):
            return rank, name
    return 0, "core"


def upward_imports(modules, edges) -> list:
    """Imports from a lower layer to a higher one (formats and algorithms are side by side: neither may import
    the other); ``qcore`` and ``qcore.adapters`` (the packages' own ``__init__``) import what they re-export."""
    bad = []
    for a in sorted(modules):
        la = layer_of(a)
        for b in sorted(edges.get(a, {})):
            lb = layer_of(b)
            if la is None or lb is None:
                bad.append((a, b, "a module in no layer"))
            elif a == "qcore" and b.count(".") == 1 or a in ("qcore.adapters",):
                continue
            elif lb[0] > la[0] or (la[1], lb[1]) in (("formats", "algorithms"), ("algorithms", "formats")):
                if a == "qcore.cli" and b == "qcore.adapters.cli" and edges[a][b]:
                    continue  # the numpy-only command line hands a model command to the torch one (deferred: torch)
                bad.append((a, b, f"{la[1]} imports {lb[1]}"))
    return bad


def test_every_module_has_a_layer():
    modules, _, _ = build_graph()
    assert [m for m in sorted(modules) if layer_of(m) is None] == []


def test_no_import_cycles():
    modules, edges, _ = build_graph()
    assert cycles(modules, edges) == []


def test_deferred_imports_only_for_heavy_dependencies():
    modules, edges, externals = build_graph()
    assert hidden_loops(modules, edges, externals) == []


def test_every_function_level_import_defers_a_heavy_dependency():
    """Each import statement of a qcore module inside a function, not only the edges whose every import is deferred
    (a function-level import of a module the importer already imports at its top is a leftover, and one of a module
    with no heavy dependency of its own hides nothing but a loop)."""
    modules, edges, externals = build_graph()
    heavy = heavy_at_import(modules, edges, externals)
    bad = [f"{a}:{line} -> {b}" for a, b, line in deferred_statements() if not heavy[b] - heavy[a]]
    assert bad == []


def test_imports_point_down_the_layers():
    modules, edges, _ = build_graph()
    assert upward_imports(modules, edges) == []


def test_import_qcore_never_imports_torch():
    modules, edges, externals = build_graph()
    heavy = heavy_at_import(modules, edges, externals)
    assert heavy["qcore"] == set()
    for m in ("qcore.formats", "qcore.algorithms", "qcore.cli", "qcore.conformance", "qcore.testing"):
        assert "torch" not in heavy[m], m


def summary(src: pathlib.Path = SRC) -> dict:
    modules, edges, externals = build_graph(src)
    n_def = sum(d for es in edges.values() for d in es.values())
    return {"modules": len(modules), "edges": sum(map(len, edges.values())), "deferred qcore imports": n_def,
            "cycles": cycles(modules, edges), "hidden loops": len(hidden_loops(modules, edges, externals)),
            "upward": upward_imports(modules, edges)}


if __name__ == "__main__":
    for k, v in summary(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else SRC).items():
        print(f"{k}: {v}")
