"""The package's import rules, read from its source with ast (every import, function-level ones included):
imports between cgcompile modules run one way (no circle), and no module uses another module's private
names (`from x import _name`, `x._name`). `from .. import _compat` is fine: it is a module, whose public
functions are the one door to private torch APIs."""

import ast
import pathlib
from typing import Dict, List, Optional, Set, Tuple

ROOT = pathlib.Path(__file__).resolve().parent.parent / "cgcompile"


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES: Dict[str, pathlib.Path] = {module_name(p): p for p in ROOT.rglob("*.py")}


def compiled_modules() -> Set[str]:
    """The package's compiled extension modules, as setup.py declares them (`Extension("cgcompile._name", ...)`):
    modules too, though not Python source (`from . import _address_check` imports a module, no private name)."""
    tree = ast.parse((ROOT.parent / "setup.py").read_text())
    return {node.args[0].value for node in ast.walk(tree) if isinstance(node, ast.Call)
            and getattr(node.func, "id", None) == "Extension" and isinstance(node.args[0], ast.Constant)}


COMPILED = compiled_modules()


def is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def resolve(importer: str, node: ast.ImportFrom) -> Optional[str]:
    """The absolute module a `from ... import` names, or None when it is not ours."""
    if node.level == 0:
        return node.module if node.module and node.module.split(".")[0] == "cgcompile" else None
    package = importer if is_package(importer) else importer.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def imports(name: str) -> Tuple[Set[str], List[str], Dict[str, str]]:
    """(modules `name` imports, its uses of other modules' private names, local aliases bound to our modules)."""
    tree = ast.parse(MODULES[name].read_text(), filename=str(MODULES[name]))
    edges: Set[str] = set()
    private: List[str] = []
    aliases: Dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in MODULES:
                    edges.add(alias.name)
                    aliases[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.ImportFrom):
            target = resolve(name, node)
            if target is None:
                continue
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                if submodule in COMPILED:  # a compiled module: no source to walk, no edge to follow
                    continue
                if submodule in MODULES:  # `from . import release`: the module itself
                    edges.add(submodule)
                    aliases[alias.asname or alias.name] = submodule
                    continue
                edges.add(target)
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    private.append(f"{name}: from {target} import {alias.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            if node.attr.startswith("_") and not node.attr.startswith("__") and aliases[node.value.id] != name:
                private.append(f"{name}: {aliases[node.value.id]}.{node.attr}")
    # a module importing its own package (`from .passes import x` inside passes/) is the package's own business
    edges = {e for e in edges if e != name and not (is_package(e) and name.startswith(e + "."))}
    return edges, private, aliases


def graph() -> Dict[str, Set[str]]:
    return {name: imports(name)[0] for name in MODULES}


def cycles(edges: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
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
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_walker_sees_function_level_and_relative_imports():
    edges = graph()
    assert "cgcompile.runtime.drivers.cuda" in edges["cgcompile.runtime.release"]  # imported inside release()
    assert "cgcompile.runtime.release" in edges["cgcompile.runtime.local.model_runtime"]  # `from . import release`
    assert "cgcompile.plan" in edges["cgcompile.diagnostics"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circle_between_cgcompile_modules():
    assert cycles(graph()) == []


def test_compiled_modules_are_read_from_setup_py():
    assert COMPILED == {"cgcompile._address_check", "cgcompile._scope_gate", "cgcompile._serialized_call",
                        "cgcompile._steady_replay"}


def test_no_module_uses_another_modules_private_names():
    private = [use for name in MODULES for use in imports(name)[1]]
    assert private == []


def test_renderers_import_the_plan_never_the_reverse():
    edges = graph()
    assert not edges["cgcompile.plan"] & {"cgcompile.diagnostics", "cgcompile.visual", "cgcompile.explain"}


def test_architecture_page_lists_every_module():
    page = (ROOT.parent / "docs" / "architecture.md").read_text()
    module_map = page[page.index("## Module map"):]
    for path in MODULES.values():
        relative = path.relative_to(ROOT).as_posix()
        assert f"| `{relative}` |" in module_map or f"| `cgcompile/{relative}` |" in module_map, relative


# runtime/ by concern, each sub-package importing only those before it (tensors and release are shared modules)
RUNTIME_LAYERS = ["tensors", "drivers", "memory", "bank", "release", "local", "frame"]


def runtime_layer(module: str) -> Optional[int]:
    """The index in RUNTIME_LAYERS of a cgcompile.runtime module's sub-package (None outside them)."""
    parts = module.split(".")
    if parts[:2] != ["cgcompile", "runtime"] or len(parts) < 3:
        return None
    return RUNTIME_LAYERS.index(parts[2])


def test_runtime_sub_packages_import_only_those_before_them():
    back = [f"{name} -> {target}" for name, targets in graph().items() for target in targets
            if runtime_layer(name) is not None and runtime_layer(target) is not None
            and runtime_layer(target) > runtime_layer(name)]
    assert back == []


def test_every_runtime_module_sits_in_a_named_sub_package():
    loose = [name for name in MODULES if name.startswith("cgcompile.runtime.") and runtime_layer(name) is None]
    assert loose == []
    assert {name.split(".")[2] for name in MODULES if name.startswith("cgcompile.runtime.")} == set(RUNTIME_LAYERS)


def test_drivers_know_nothing_of_partitions_and_the_bank_touches_no_device():
    edges = graph()
    for name, targets in edges.items():
        if name.startswith("cgcompile.runtime.drivers"):
            assert not {t for t in targets if t.startswith(("cgcompile.runtime.local", "cgcompile.runtime.bank"))}, name
        if name.startswith("cgcompile.runtime.bank"):
            assert "torch.cuda" not in MODULES[name].read_text(), name


def test_nothing_below_the_runtime_imports_it():
    """Planning (passes, rewrites, planner, plan, config, frame_plan) is pure: it never imports the runtime, and
    counters (which the runtime writes) import nothing of it either."""
    edges = graph()
    pure = [n for n in MODULES if n.startswith(("cgcompile.passes", "cgcompile.rewrites"))] + [
        "cgcompile.planner", "cgcompile.plan", "cgcompile.config", "cgcompile.counters", "cgcompile.frame_plan",
        "cgcompile.devices"]
    assert {n: sorted(t for t in edges[n] if t.startswith("cgcompile.runtime")) for n in pure} == {n: [] for n in pure}


MUTATING_CALLS = {"erase_node", "replace_all_uses_with", "replace_input_with", "recompile", "insert_before",
                  "insert_after", "create_node", "call_function", "inserting_before", "inserting_after", "prepend",
                  "append", "lint", "eliminate_dead_code"}


def test_passes_read_the_graph_and_never_change_it():
    """passes/ analyse, rewrites/ change: a graph method that edits nodes called in passes/ would be a rewrite
    hiding among the analyses (list.append on the passes' own lists is fine: only calls on graphs and nodes count)."""
    found = []
    for name, path in MODULES.items():
        if not name.startswith("cgcompile.passes"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATING_CALLS:
                receiver = ast.unparse(node.func.value)
                if "graph" in receiver or "node" in receiver or receiver in ("gm", "n", "user"):
                    found.append(f"{name}: {receiver}.{node.func.attr}")
    assert found == []


def reachable(edges: Dict[str, Set[str]], start: str) -> Set[str]:
    seen, todo = set(), [start]
    while todo:
        for target in edges.get(todo.pop(), ()):
            if target not in seen and target in MODULES:
                seen.add(target)
                todo.append(target)
    return seen


def test_explain_plans_without_the_backend_or_the_partition_runtime():
    """explain() runs the planning the backend runs (frame_plan.make_plan), not the backend: of the runtime it
    reaches only the thread-state helpers it restores the model's RNG with."""
    found = reachable(graph(), "cgcompile.explain")
    assert "cgcompile.backend" not in found
    assert sorted(n for n in found if n.startswith("cgcompile.runtime")) == ["cgcompile.runtime.drivers.thread_state"]


def test_no_file_over_500_lines_and_no_runtime_class_over_260():
    """Files are split before they grow past ~500 lines; a runtime class past ~250 lines does too many jobs."""
    long_files = {name: text.count("\n") for name, text in ((n, p.read_text()) for n, p in MODULES.items())
                  if text.count("\n") > 500}
    assert long_files == {}
    big = {}
    for name, path in MODULES.items():
        if name.startswith("cgcompile.runtime"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno >= 260:
                    big[f"{name}.{node.name}"] = node.end_lineno - node.lineno + 1
    assert big == {}
