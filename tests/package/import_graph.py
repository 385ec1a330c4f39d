"""The import graph of `src/nonstop`, read with `ast`, and the layering rule of docs/architecture.md.

A module's imports are every `import` / `from ... import` in it: at module level, inside functions (lazy) and under
`if TYPE_CHECKING:` alike, relative ones resolved, `from package import submodule` counted as the submodule.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "nonstop"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
RULE_HEADING = "## Packages and what they may import"
TOP = "nonstop"  # the package's own top-level modules (`__init__`, `__main__`) form a layer of their own


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    line: int
    at_import_time: bool  # module level and not under TYPE_CHECKING: runs when the importer is imported


def module_files(src: Path = SRC) -> dict[str, Path]:
    """Every module of the package, by dotted name (a package by its `__init__`)."""
    out = {}
    for path in sorted(src.rglob("*.py")):
        parts = list(path.relative_to(src.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def layer_of(module: str) -> str:
    parts = module.split(".")
    is_package_root = len(parts) == 1 or (len(parts) == 2 and parts[1] in ("__init__", "__main__"))
    return TOP if is_package_root else parts[1]


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST, at_import_time: bool) -> None:
        for child in ast.iter_child_nodes(node):
            now = at_import_time
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                now = False
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                visit_type_checking(child, now)
                continue
            if isinstance(child, ast.Import):
                found.extend(Import(name, a.name, child.lineno, now) for a in child.names if _ours(a.name))
            elif isinstance(child, ast.ImportFrom):
                base = _absolute(child, package)
                if _ours(base):
                    for alias in child.names:
                        sub = f"{base}.{alias.name}"
                        found.append(Import(name, sub if sub in modules else base, child.lineno, now))
            visit(child, now)

    def visit_type_checking(node: ast.If, at_import_time: bool) -> None:
        for child in node.body:
            visit(ast.Module(body=[child], type_ignores=[]), False)
        for child in node.orelse:
            visit(ast.Module(body=[child], type_ignores=[]), at_import_time)

    visit(tree, True)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _absolute(node: ast.ImportFrom, package: str) -> str:
    if node.level == 0:
        return node.module or ""
    base = package.split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _ours(module: str) -> bool:
    return module == TOP or module.startswith(TOP + ".")


def all_imports(src: Path = SRC) -> list[Import]:
    modules = module_files(src)
    return [imp for name, path in modules.items() for imp in imports_of(name, path, modules)]


def read_rule(doc: Path = ARCHITECTURE) -> dict[str, set[str]]:
    """The table under RULE_HEADING: `| `package` | its job | `a`, `b` |` rows (— for nothing) -> {package: {a, b}}."""
    text = doc.read_text()
    if RULE_HEADING not in text:
        raise AssertionError(f"{doc} has no {RULE_HEADING!r} section")
    section = text.split(RULE_HEADING, 1)[1].split("\n## ", 1)[0]
    rule: dict[str, set[str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        package = re.findall(r"`([^`]+)`", cells[0])[0].strip("/")
        rule[package] = set(re.findall(r"`([a-z_]+)`", cells[2]))
    return rule


def violations(imports: list[Import], rule: dict[str, set[str]]) -> list[Import]:
    """Each import from one layer into another that the rule does not allow."""
    return [
        imp
        for imp in imports
        if layer_of(imp.importer) != layer_of(imp.imported)
        and layer_of(imp.imported) not in rule.get(layer_of(imp.importer), set())
    ]


def describe(imp: Import) -> str:
    source, target = layer_of(imp.importer), layer_of(imp.imported)
    return f"{imp.importer}:{imp.line} -> {imp.imported} ({source} may not import {target})"


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                connect(w)
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
            connect(v)
    return found
