"""The package's shape: every module imports alone in a fresh interpreter, every import between packages follows the
layering rule written in docs/architecture.md, and no modules import each other in a cycle at import time."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from import_graph import (
    ARCHITECTURE,
    SRC,
    Import,
    all_imports,
    cycles,
    describe,
    layer_of,
    module_files,
    read_rule,
    violations,
)

# Known imports against the rule, each with who removes it. Nothing else may be added here.
KNOWN_VIOLATIONS: dict[tuple[str, str], str] = {}
# Importing it runs the program (`python -m nonstop`).
NOT_IMPORTABLE_ALONE = {"nonstop.__main__"}


def test_every_module_imports_alone():
    names = sorted(set(module_files()) - NOT_IMPORTABLE_ALONE)
    script = Path(__file__).with_name("import_each.py")
    result = subprocess.run(
        [sys.executable, str(script), *names], capture_output=True, text=True, timeout=600, cwd=SRC.parent.parent
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert len(names) > 150  # the walk found the package


def test_every_package_has_a_rule_and_the_rule_has_no_cycle():
    rule = read_rule()
    packages = {layer_of(name) for name in module_files()}
    assert packages == set(rule), f"{ARCHITECTURE.name}: packages without a rule or rules without a package"
    for allowed in rule.values():
        assert allowed <= set(rule), allowed - set(rule)
    assert cycles(rule) == []


def test_imports_between_packages_follow_the_rule():
    found = violations(all_imports(), read_rule())
    unexpected = [describe(imp) for imp in found if (imp.importer, imp.imported) not in KNOWN_VIOLATIONS]
    assert unexpected == [], "\n".join(unexpected)
    still_there = {(imp.importer, imp.imported) for imp in found}
    assert set(KNOWN_VIOLATIONS) <= still_there, "a known violation is gone: remove it from KNOWN_VIOLATIONS"


def test_no_modules_import_each_other_at_import_time():
    edges: dict[str, set[str]] = {}
    for imp in all_imports():
        if imp.at_import_time and imp.imported != imp.importer:
            edges.setdefault(imp.importer, set()).add(imp.imported)
    assert cycles(edges) == []


def test_the_checks_catch_a_planted_sideways_import_and_cycle(tmp_path):
    """The rule and cycle checks on a planted package: `b` may import `a`; `a` importing `b` back is both a violation
    and a cycle, a lazy import only the former."""
    src = tmp_path / "nonstop"
    for package in ("a", "b"):
        (src / package).mkdir(parents=True)
        (src / package / "__init__.py").write_text("")
    (src / "__init__.py").write_text("")
    (src / "a" / "x.py").write_text("from nonstop.b import y\n")
    (src / "b" / "y.py").write_text("from ..a import x\n\ndef f():\n    import nonstop.a.x\n")
    imports = all_imports(src)
    assert Import("nonstop.a.x", "nonstop.b.y", 1, True) in imports
    assert Import("nonstop.b.y", "nonstop.a.x", 1, True) in imports  # relative, resolved
    assert Import("nonstop.b.y", "nonstop.a.x", 4, False) in imports  # lazy
    found = violations(imports, {"a": set(), "b": {"a"}, "nonstop": set()})
    assert [describe(imp) for imp in found] == ["nonstop.a.x:1 -> nonstop.b.y (a may not import b)"]
    edges = {i.importer: {i.imported} for i in imports if i.at_import_time}
    assert cycles(edges) == [["nonstop.a.x", "nonstop.b.y"]]
