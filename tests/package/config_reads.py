"""Which config keys the code reads: a small static type inference over `src/nonstop`, with `ast`.

A key `a.b.c` is read when every field on its path is read on an expression of the class that holds it:
`NonstopConfig.a`, then `<class of a>.b`, then `<class of b>.c`. An expression's config class comes from
- an annotation naming a config class (`rollout: RolloutConfig`, unions too) on a parameter or a class attribute;
- an assignment, `x = config.actor_rollout_ref.rollout` (tuple assignments and `for x in (a, b)` element-wise),
  also to `self.x` in any method of the class;
- a field of a config class whose type is a section, `config.trainer`;
- a call: the return annotation of the function it resolves to, or `replace(x, …)` / `copy.deepcopy(x)`;
- the argument passed at every call site that resolves (by module-level name, class name, or `self.`/`cls.`) to a
  parameter without a config annotation, to a fixed point.
`getattr(x, "name")` reads `name`, also with a loop variable over string constants. An attribute on an expression of
unknown class reads nothing: `other.n` is not `rollout.n`.
"""

from __future__ import annotations

import ast
import dataclasses
import typing
from collections import defaultdict
from pathlib import Path

Types = frozenset[str]
EMPTY: Types = frozenset()


def config_fields(root: type) -> dict[str, dict[str, str | None]]:
    """{class name: {field: the section class's name, or None for a leaf}} of every class under `root`."""
    out: dict[str, dict[str, str | None]] = {}

    def walk(cls: type) -> None:
        if cls.__name__ in out:
            return
        hints = typing.get_type_hints(cls)
        out[cls.__name__] = {}
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            out[cls.__name__][f.name] = tp.__name__ if dataclasses.is_dataclass(tp) else None
            if dataclasses.is_dataclass(tp):
                walk(tp)

    walk(root)
    return out


def key_paths(root: type) -> dict[str, list[tuple[str, str]]]:
    """Every leaf key path -> the (class, field) edges from the root to it."""
    fields = config_fields(root)
    out: dict[str, list[tuple[str, str]]] = {}

    def walk(cls: str, prefix: str, edges: list[tuple[str, str]]) -> None:
        for name, section in fields[cls].items():
            here = [*edges, (cls, name)]
            if section is None:
                out[prefix + name] = here
            else:
                walk(section, f"{prefix}{name}.", here)

    walk(root.__name__, "", [])
    return out


class _Function:
    def __init__(self, module: str, qualname: str, node: ast.FunctionDef | ast.AsyncFunctionDef, owner: str | None):
        self.module, self.qualname, self.node, self.owner = module, qualname, node, owner
        args = node.args
        self.params = [a.arg for a in (*args.posonlyargs, *args.args)]
        self.annotated = {
            a.arg: a.annotation for a in (*args.posonlyargs, *args.args, *args.kwonlyargs) if a.annotation
        }
        self.bound: dict[str, Types] = defaultdict(lambda: EMPTY)  # parameter types from call sites
        self.nodes = list(ast.walk(node))


class ConfigReads:
    def __init__(self, files: list[Path], src_root: Path, fields: dict[str, dict[str, str | None]]):
        """`files`: the modules to read (their dotted names relative to `src_root`); `fields`: `config_fields`."""
        self.fields = fields
        self.trees = {self._module_name(f, src_root): ast.parse(f.read_text(), filename=str(f)) for f in files}
        self.functions: dict[tuple[str, str], _Function] = {}
        self.classes: dict[tuple[str, str], ast.ClassDef] = {}
        self.class_attrs: dict[tuple[str, str], dict[str, Types]] = defaultdict(lambda: defaultdict(lambda: EMPTY))
        self.imports: dict[str, dict[str, tuple[str, str]]] = {}
        for module, tree in self.trees.items():
            self._index(module, tree)
        for (module, name), node in self.classes.items():  # once every class is known: annotations resolve
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    self.class_attrs[(module, name)][item.target.id] |= self._annotation(item.annotation, module)
        self.reads: set[tuple[str, str]] = set()
        self._solve()

    @staticmethod
    def _module_name(path: Path, src_root: Path) -> str:
        parts = list(path.relative_to(src_root).with_suffix("").parts)
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    # -- index -------------------------------------------------------------------------------------------------------

    def _index(self, module: str, tree: ast.Module) -> None:
        names: dict[str, tuple[str, str]] = {}
        package = module if module in self.trees and self._is_package(module) else module.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                for alias in node.names:
                    names[alias.asname or alias.name] = (base, alias.name)
        self.imports[module] = names
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                self.functions[(module, node.name)] = _Function(module, node.name, node, None)
            elif isinstance(node, ast.ClassDef):
                self.classes[(module, node.name)] = node
                for item in node.body:
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                        qual = f"{node.name}.{item.name}"
                        self.functions[(module, qual)] = _Function(module, qual, item, node.name)

    def _is_package(self, module: str) -> bool:
        return any(other.startswith(module + ".") for other in self.trees)

    def _resolve(self, module: str, name: str, depth: int = 0) -> tuple[str, str] | None:
        """The (module, name) a name used in `module` is defined as, following `from x import name` chains."""
        if (module, name) in self.functions or (module, name) in self.classes:
            return module, name
        if depth < 4 and name in self.imports.get(module, {}):
            return self._resolve(*self.imports[module][name], depth + 1)
        return None

    def _annotation(self, node: ast.expr | None, module: str) -> Types:
        """The config classes (by name) and the package's own classes (`module:Class`) an annotation names."""
        if node is None:
            return EMPTY
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return self._annotation(ast.parse(node.value, mode="eval").body, module)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            return self._annotation(node.left, module) | self._annotation(node.right, module)
        if isinstance(node, ast.Subscript):  # Optional[X], list[X] (elements are not tracked: only Optional)
            return self._annotation(node.slice, module) if _name(node.value) == "Optional" else EMPTY
        name = _name(node)
        if name in self.fields:
            return frozenset({name})
        target = self._resolve(module, name) if isinstance(node, ast.Name) else None
        return frozenset({f"{target[0]}:{target[1]}"}) if target in self.classes else EMPTY

    # -- inference ---------------------------------------------------------------------------------------------------

    def _solve(self) -> None:
        for _ in range(12):
            before = self._state()
            for fn in self.functions.values():
                self._infer(fn)
            if self._state() == before:
                return
        raise AssertionError("config-read inference did not settle")

    def _state(self) -> tuple:
        bound = tuple(sorted((k, tuple(sorted(v.items()))) for k, fn in self.functions.items() for v in [fn.bound]))
        attrs = tuple(sorted((k, tuple(sorted(v.items()))) for k, v in self.class_attrs.items()))
        return bound, attrs, frozenset(self.reads)

    def _infer(self, fn: _Function) -> None:
        env: dict[str, Types] = defaultdict(lambda: EMPTY)
        for param in fn.params + list(fn.annotated):
            env[param] = self._annotation(fn.annotated.get(param), fn.module) | fn.bound[param]
        constants: dict[str, set[str]] = defaultdict(set)  # loop variables over string constants
        if fn.owner is not None and fn.params and _is_method(fn):
            env[fn.params[0]] |= frozenset({f"{fn.module}:{fn.owner}"})
        for _ in range(2):  # flow-insensitive: a second pass sees names assigned later in the body
            for node in fn.nodes:
                self._bind(fn, node, env, constants)
        for node in fn.nodes:
            self._read(fn, node, env, constants)

    def _bind(self, fn: _Function, node: ast.AST, env: dict[str, Types], constants: dict[str, set[str]]) -> None:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                self._assign(fn, target, node.value, env)
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            self._assign(fn, node.target, node.value, env)
        elif isinstance(node, ast.For | ast.comprehension) and isinstance(node.iter, ast.Tuple | ast.List):
            for element in node.iter.elts:
                self._assign(fn, node.target, element, env)
                if isinstance(node.target, ast.Name) and isinstance(element, ast.Constant):
                    if isinstance(element.value, str):
                        constants[node.target.id].add(element.value)
        elif isinstance(node, ast.Call):
            callee = self._callee(fn, node.func, env)
            if callee is not None:
                params = callee.params[1:] if callee.owner is not None and _is_method(callee) else callee.params
                for param, arg in zip(params, node.args, strict=False):
                    callee.bound[param] |= self._type(fn, arg, env)
                for keyword in node.keywords:
                    if keyword.arg is not None:
                        callee.bound[keyword.arg] |= self._type(fn, keyword.value, env)

    def _assign(self, fn: _Function, target: ast.expr, value: ast.expr, env: dict[str, Types]) -> None:
        if isinstance(target, ast.Tuple | ast.List) and isinstance(value, ast.Tuple | ast.List):
            for t, v in zip(target.elts, value.elts, strict=False):
                self._assign(fn, t, v, env)
            return
        types = self._type(fn, value, env)
        if isinstance(target, ast.Name):
            env[target.id] |= types
        elif isinstance(target, ast.Attribute):
            for owner in self._type(fn, target.value, env):
                if ":" in owner:
                    self.class_attrs[tuple(owner.split(":"))][target.attr] |= types

    def _type(self, fn: _Function, node: ast.expr, env: dict[str, Types]) -> Types:
        if isinstance(node, ast.Name):
            return env.get(node.id, EMPTY)
        if isinstance(node, ast.Attribute):
            out: set[str] = set()
            for owner in self._type(fn, node.value, env):
                if ":" in owner:
                    out |= self.class_attrs[tuple(owner.split(":"))].get(node.attr, EMPTY)
                elif (section := self.fields[owner].get(node.attr)) is not None:
                    out.add(section)
            return frozenset(out)
        if isinstance(node, ast.IfExp):
            return self._type(fn, node.body, env) | self._type(fn, node.orelse, env)
        if isinstance(node, ast.BoolOp):
            return frozenset().union(*(self._type(fn, v, env) for v in node.values))
        if isinstance(node, ast.Call):
            if _name(node.func) in ("replace", "deepcopy") and node.args:
                return self._type(fn, node.args[0], env)
            callee = self._callee(fn, node.func, env)
            if callee is not None:
                return self._annotation(callee.node.returns, callee.module)
        return EMPTY

    def _callee(self, fn: _Function, func: ast.expr, env: dict[str, Types]) -> _Function | None:
        if isinstance(func, ast.Name):
            target = self._resolve(fn.module, func.id)
            if target is None:
                return None
            if target in self.classes:
                return self.functions.get((target[0], f"{target[1]}.__init__"))
            return self.functions.get(target)
        if isinstance(func, ast.Attribute):
            if _name(func.value) == "cls" and fn.owner is not None:
                return self.functions.get((fn.module, f"{fn.owner}.{func.attr}"))
            if isinstance(func.value, ast.Name):
                target = self._resolve(fn.module, func.value.id)
                if target is not None and target in self.classes:
                    return self.functions.get((target[0], f"{target[1]}.{func.attr}"))
            for owner in self._type(fn, func.value, env):
                if ":" in owner and (
                    method := self.functions.get((owner.split(":")[0], f"{owner.split(':')[1]}.{func.attr}"))
                ):
                    return method
        return None

    def _read(self, fn: _Function, node: ast.AST, env: dict[str, Types], constants: dict[str, set[str]]) -> None:
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            self._mark(self._type(fn, node.value, env), {node.attr})
        elif isinstance(node, ast.Call) and _name(node.func) == "getattr" and len(node.args) >= 2:
            name = node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                names = {name.value}
            elif isinstance(name, ast.Name):
                names = constants.get(name.id, set())
            else:
                names = set()
            self._mark(self._type(fn, node.args[0], env), names)

    def _mark(self, classes: Types, names: set[str]) -> None:
        for cls in classes:
            for name in names:
                if ":" not in cls and name in self.fields[cls]:
                    self.reads.add((cls, name))

    # -- answer ------------------------------------------------------------------------------------------------------

    def unread(self, paths: dict[str, list[tuple[str, str]]]) -> list[str]:
        """The key paths with a field on the way that nothing reads."""
        return sorted(key for key, edges in paths.items() if not all(edge in self.reads for edge in edges))


def _name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _is_method(fn: _Function) -> bool:
    decorators = {_name(d) for d in fn.node.decorator_list}
    return "staticmethod" not in decorators and bool(fn.params) and fn.params[0] in ("self", "cls")
