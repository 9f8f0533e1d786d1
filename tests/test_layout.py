"""The package's layout, read from its source (only the family registry is imported): no import circle, modules of
at most 400 lines each opening with a docstring, one module importing Triton's Python-backend
utilities, and no family named by the shared code outside `triton_vlm/families/`."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "triton_vlm"
MODULES = {".".join(p.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__"): p
           for p in sorted(ROOT.rglob("*.py"))}


def imports(module: str, path: Path) -> set[str]:
    """The package's modules `module` imports, wherever the import stands (module level, inside a
    function, under TYPE_CHECKING): `from a.b import c` is a.b.c where that is a module, else a.b."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package `level - 1` up
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {name for name in found if name in MODULES and name != module}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circle():
    graph = {module: imports(module, path) for module, path in MODULES.items()}
    assert circles(graph) == []


def test_the_circle_finder_finds_one():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_each_module_says_what_it_owns_in_at_most_400_lines(module):
    text = MODULES[module].read_text(encoding="utf-8")
    assert ast.get_docstring(ast.parse(text)), f"{module}: no opening docstring"
    assert text.count("\n") <= 400, f"{module}: {text.count(chr(10))} lines"


def test_one_module_imports_the_python_backend_utils():
    users = [m for m, path in MODULES.items() if "triton_python_backend_utils" in
             {a.name for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
              if isinstance(node, ast.Import) for a in node.names}]
    assert users == ["triton_vlm.serving.backend.pb"]


def test_shared_code_names_no_family():
    """A family is its folder (and one registry line): no module outside `triton_vlm/families/`
    names one (a registry name or a family folder's, as a word of its code, strings, comments or
    docstrings)."""
    from triton_vlm.families import FAMILIES

    names = {name.lower() for name in FAMILIES} | {folder.name for folder in (ROOT / "families").iterdir()
                                                   if folder.is_dir() and folder.name != "__pycache__"}
    named = {m: sorted(names & {w.lower() for w in re.findall(r"\w+", p.read_text(encoding="utf-8"))})
             for m, p in MODULES.items() if not m.startswith("triton_vlm.families")}
    assert {m: n for m, n in named.items() if n} == {}
