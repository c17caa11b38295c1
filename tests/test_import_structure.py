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
    assert "cgcompile.runtime.cuda_driver" in edges["cgcompile.runtime.release"]  # imported inside release()
    assert "cgcompile.runtime.release" in edges["cgcompile.runtime.model_runtime"]  # `from . import release`
    assert "cgcompile.plan" in edges["cgcompile.diagnostics"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circle_between_cgcompile_modules():
    assert cycles(graph()) == []


def test_compiled_modules_are_read_from_setup_py():
    assert COMPILED == {"cgcompile._address_check"}


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
