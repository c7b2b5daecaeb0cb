"""Imports between the project's modules, read with ast (nothing is imported): no import circles in vlprep and
vltrain, and vlprep's library never pulls in vltrain.

Every `import` / `from ... import` statement counts, wherever it is (top level, inside a function, under an `if`):
an import inside a function only postpones the circle to the first call. Each statement maps to the project modules
it names: `import vltrain.model` and `from vltrain.model import X` to vltrain.model, `from vltrain import checkpoint`
to vltrain.checkpoint when vltrain/checkpoint.py (or a package vltrain/checkpoint/) exists and otherwise to vltrain
(the package's __init__), relative imports resolved against the importing module's package. Importing a submodule
runs its package's __init__ too, but that is no edge to the __init__ unless the __init__ is what the statement names.
"""

import ast
import os
import subprocess
import sys
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("vlprep", "vltrain")
# The one vlprep module that may import vltrain: the CLI hands `vlprep embed` / `vlprep pseudolabel` a
# vltrain.checkpoint_encoder.CheckpointEncoder (lazily, inside the command). The stages themselves take any encoder object.
VLPREP_MAY_IMPORT_VLTRAIN = {"vlprep.cli"}

Graph = dict[str, dict[str, int]]  # module -> {project module it imports: line of the first such import}


def module_files(root: Path, packages) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under root/<package> (a package's __init__ is the package)."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported_names(tree: ast.Module, module: str, is_package: bool) -> list[tuple[str, list[str], int]]:
    """(base module, names imported from it or [] for `import base`, line) for every import statement in tree."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the importing module's package, up level - 1 packages
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[:len(package) - (node.level - 1)]
                base = ".".join(package + ([node.module] if node.module else []))
            else:
                base = node.module
            found.append((base, [alias.name for alias in node.names], node.lineno))
    return found


def resolve(name: str, modules) -> str | None:
    """The project module `name` names, or the closest package of it that is one (None outside the project)."""
    parts = name.split(".")
    while parts and ".".join(parts) not in modules:
        parts.pop()
    return ".".join(parts) or None


def import_graph(root: Path, packages) -> Graph:
    files = module_files(root, packages)
    graph: Graph = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        edges = graph.setdefault(module, {})
        for base, names, line in imported_names(tree, module, path.name == "__init__.py"):
            # `from pkg import sub` names the submodule pkg.sub when there is one, else something in pkg itself
            targets = [f"{base}.{n}" if f"{base}.{n}" in files else base for n in names] or [base]
            for target in filter(None, (resolve(t, files) for t in targets)):
                if target != module:
                    edges.setdefault(target, line)
    return graph


def strongly_connected(graph: Graph) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module, each sorted, in sorted order."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, {})):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(components)


def shortest_cycle(graph: Graph, component: list[str]) -> list[str]:
    """A shortest cycle through the component's first module, as [a, b, ..., a] (breadth first inside it)."""
    start, inside = component[0], set(component)
    came_from = {start: None}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(graph[v]):
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return path[::-1] + [start]
            if w in inside and w not in came_from:
                came_from[w] = v
                queue.append(w)
    raise AssertionError(f"no cycle through {start} in {component}")


def find_cycles(graph: Graph) -> list[list[str]]:
    """One cycle per import circle (strongly connected component), each as [a, b, ..., a]."""
    return [shortest_cycle(graph, component) for component in strongly_connected(graph)]


def describe(graph: Graph, component: list[str], files: dict[str, Path], root: Path) -> str:
    """One cycle of the circle as `a -> b -> a`, where each import is, and every module of the circle."""
    cycle = shortest_cycle(graph, component)
    lines = [" -> ".join(cycle)]
    for a, b in zip(cycle, cycle[1:]):
        lines.append(f"    {files[a].relative_to(root)}:{graph[a][b]} imports {b}")
    if len(component) > len(cycle) - 1:
        lines.append(f"    (the circle has more cycles, through all of {', '.join(component)})")
    return "\n".join(lines)


def test_vlprep_and_vltrain_have_no_import_circles():
    graph, files = import_graph(ROOT, PACKAGES), module_files(ROOT, PACKAGES)
    circles = strongly_connected(graph)
    assert not circles, f"{len(circles)} import circle(s), one cycle of each:\n" + "\n".join(
        describe(graph, c, files, ROOT) for c in circles)


def test_vlprep_library_never_imports_vltrain():
    """No vlprep module but the CLI reaches vltrain, directly or through other vlprep modules (the CLI included)."""
    graph = import_graph(ROOT, PACKAGES)
    problems = []
    for start in sorted(m for m in graph if m.split(".")[0] == "vlprep" and m not in VLPREP_MAY_IMPORT_VLTRAIN):
        came_from, queue = {start: None}, deque([start])
        while queue:
            v = queue.popleft()
            if v.split(".")[0] == "vltrain":
                path = [v]
                while came_from[path[-1]] is not None:
                    path.append(came_from[path[-1]])
                problems.append(" -> ".join(path[::-1]))
                break
            for w in sorted(graph[v]):
                if w not in came_from:
                    came_from[w] = v
                    queue.append(w)
    assert not problems, "vlprep's library imports vltrain:\n" + "\n".join(problems)


def write_package(root: Path, modules: dict[str, str]) -> None:
    for name, text in modules.items():
        path = root / (name.replace(".", "/") + ".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_detector_finds_a_circle_closed_inside_a_function(tmp_path):
    write_package(tmp_path, {
        "pkg.__init__": "",
        "pkg.a": "from pkg import b\n",
        "pkg.b": "import os\nimport pkg.c as c\n",
        "pkg.c": "def f():\n    from . import a\n    return a\n",
    })
    graph = import_graph(tmp_path, ["pkg"])
    assert graph == {"pkg": {}, "pkg.a": {"pkg.b": 1}, "pkg.b": {"pkg.c": 2}, "pkg.c": {"pkg.a": 2}}
    assert find_cycles(graph) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]]
    assert " -> ".join(find_cycles(graph)[0]) == "pkg.a -> pkg.b -> pkg.c -> pkg.a"

    # the same modules without the import in the function: no circle
    write_package(tmp_path, {"pkg.c": "def f():\n    import json\n    return json\n"})
    graph = import_graph(tmp_path, ["pkg"])
    assert graph["pkg.c"] == {} and find_cycles(graph) == []


def test_submodule_imports_are_no_edge_to_the_package_init_unless_it_is_named(tmp_path):
    write_package(tmp_path, {
        "pkg.__init__": "from pkg.sub import tool\nVERSION = 1\n",
        "pkg.sub.__init__": "",
        "pkg.sub.tool": "from pkg import helpers\nfrom .. import helpers as h2\nimport pkg.helpers\n",
        "pkg.helpers": "from pkg.sub import tool as _unused\n",
    })
    graph = import_graph(tmp_path, ["pkg"])
    assert graph["pkg"] == {"pkg.sub.tool": 1} and graph["pkg.sub.tool"] == {"pkg.helpers": 1}
    assert find_cycles(graph) == [["pkg.helpers", "pkg.sub.tool", "pkg.helpers"]]

    # `from pkg import VERSION` names pkg's __init__ itself, which imports pkg.sub.tool: a circle of two
    write_package(tmp_path, {"pkg.helpers": "def f():\n    from pkg import VERSION\n    return VERSION\n"})
    graph = import_graph(tmp_path, ["pkg"])
    assert graph["pkg.helpers"] == {"pkg": 2}
    assert find_cycles(graph) == [["pkg", "pkg.sub.tool", "pkg.helpers", "pkg"]]

    # and with neither: a tree
    write_package(tmp_path, {"pkg.helpers": "import pkg.sub\n"})
    graph = import_graph(tmp_path, ["pkg"])
    assert graph["pkg.helpers"] == {"pkg.sub": 1} and find_cycles(graph) == []


def test_importing_the_config_does_not_import_torch():
    """vltrain.config (the CLI's options, `vltrain config`) stays light: torch loads only where a model is built."""
    code = "import sys, vltrain.config; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True)
    assert done.stdout.strip() == "False"
