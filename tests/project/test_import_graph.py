"""The package's modules import each other without a cycle: the import graph, read from the source, has none.

Every ``import`` counts wherever it stands: at the top, inside a function (a deferred import hides a cycle from the
interpreter, not from a reader), or under ``TYPE_CHECKING``. The one exception is the root package's face, which loads
the public names lazily, on first use, and so stands above every module.
"""

from __future__ import annotations

import ast
import pathlib

import lightning_memguard

PACKAGE = pathlib.Path(lightning_memguard.__file__).parent
ROOT = "lightning_memguard"


def _modules() -> dict[str, pathlib.Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = [ROOT, *path.relative_to(PACKAGE).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _imported(module: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The package's modules that ``module`` imports: ``from a.b import c`` is ``a.b.c`` where that is a module, else
    ``a.b``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: len(module.split(".")) - node.level + (path.name == "__init__.py")]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            for alias in node.names:
                if f"{source}.{alias.name}" in modules:
                    found.add(f"{source}.{alias.name}")
                elif source in modules:
                    found.add(source)
    found.discard(module)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: set() if m == ROOT else _imported(m, p, modules) for m, p in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            step = next(edges, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph[step]))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
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
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_reads_deferred_and_type_checking_imports():
    graph = import_graph()
    assert "lightning_memguard.callbacks.tuners" in graph["lightning_memguard.callbacks"]
    assert len(graph) > 50


def test_no_module_of_the_package_imports_itself_back():
    assert cycles(import_graph()) == []


# The floors, top down: the public shells, then the tuners' wing, then the Lightning-facing layer, then the rest.
# A module imports only its own floor or a lower one.
SHELLS = ("lightning_memguard.callbacks", "lightning_memguard.strategies", "lightning_memguard.commands")
LAYER = "lightning_memguard._lightning"


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(f"{package}.")


def upward_edges(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Edges from a wing up to the callbacks, and from the Lightning-facing layer up to a wing that uses it (the
    tuners' wing) or to a shell. The commands stand above the callbacks (they run them); the root package's face
    loads them lazily."""
    found = []
    for module, imported in graph.items():
        for target in imported:
            up_to_callbacks = _under(target, SHELLS[0]) and not any(_under(module, s) for s in (SHELLS[0], SHELLS[2]))
            layer_up = _under(module, LAYER) and (
                any(_under(target, s) for s in SHELLS) or _under(target, "lightning_memguard.tuning")
            )
            if (up_to_callbacks or layer_up) and module != ROOT:
                found.append((module, target))
    return sorted(found)


def test_the_floor_checker_finds_an_edge_up():
    graph = {
        "lightning_memguard.tuning.cache_key": {"lightning_memguard.callbacks.activation_checkpointing"},
        "lightning_memguard._lightning.loaders": {"lightning_memguard.tuning.trials"},
        "lightning_memguard.commands.demo": {"lightning_memguard.callbacks.memguard"},
        "lightning_memguard.callbacks.tuners": {"lightning_memguard.tuning.workflow", LAYER},
    }
    assert upward_edges(graph) == [
        ("lightning_memguard._lightning.loaders", "lightning_memguard.tuning.trials"),
        ("lightning_memguard.tuning.cache_key", "lightning_memguard.callbacks.activation_checkpointing"),
    ]


def test_no_wing_imports_the_callbacks_and_the_lightning_layer_stands_below_the_wings_that_use_it():
    assert upward_edges(import_graph()) == []


# ------------------------------------------------------------------ the import table by wing in docs/architecture.md
DOC = PACKAGE.parent / "docs" / "architecture.md"
ORDER = ["commands", "callbacks", "strategies", "tuning", "_lightning", "checkpointing", "levers", "forensics",
         "emulation", "testing", "probes", "core", "_ledger", "_compiler", "_autograd"]  # fmt: skip


def wing(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "(root)"


def wing_table(graph: dict[str, set[str]]) -> str:
    """The markdown table of which wing imports which (edges: pairs of modules), top floor first."""
    edges: dict[str, dict[str, int]] = {}
    for module, imported in graph.items():
        for target in imported:
            a, b = wing(module), wing(target)
            if a != b and a != "(root)":
                edges.setdefault(a, {}).setdefault(b, 0)
                edges[a][b] += 1
    wings = sorted({wing(m) for m in graph} - {"(root)"}, key=lambda w: (ORDER.index(w) if w in ORDER else 99, w))
    rows = ["| wing | imports (modules' edges) |", "| --- | --- |"]
    for w in wings:
        targets = sorted(edges.get(w, {}).items(), key=lambda kv: ORDER.index(kv[0]) if kv[0] in ORDER else 99)
        rows.append(f"| `{w}` | " + (", ".join(f"`{t}` {n}" for t, n in targets) or "nothing of the package") + " |")
    return "\n".join(rows)


def test_the_import_table_in_the_architecture_doc_is_the_codes():
    """docs/architecture.md's table between its two markers is this graph's (on a mismatch the right table is in the
    message, to paste)."""
    text = DOC.read_text(encoding="utf-8")
    begin, end = "<!-- import table: begin -->", "<!-- import table: end -->"
    assert begin in text and end in text
    written = text.split(begin, 1)[1].split(end, 1)[0].strip()
    expected = wing_table(import_graph())
    assert written == expected, f"docs/architecture.md's import table should read:\n{expected}"
