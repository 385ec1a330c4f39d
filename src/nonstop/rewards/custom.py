"""User scoring functions loaded from `custom_reward_function.path` / `.name`, verl's signature:
`fn(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float | dict`.

The trainer process never runs the file: it parses it (`check_reward_file`: syntax, the function's presence and
signature, one-line errors naming file and line), and the file's code runs in the process that scores, a reward
worker, when it unpickles the `CustomRewardFunction` (or on the first call, when scoring inline).
"""

from __future__ import annotations

import ast
import asyncio
import hashlib
import importlib.util
import inspect
import sys
import traceback
from pathlib import Path
from typing import Any

from .errors import RewardSetupError

# The keywords every call passes (verl's reward managers call by keyword).
CALL_KEYWORDS = ("data_source", "solution_str", "ground_truth", "extra_info")
_PROBE = dict.fromkeys(CALL_KEYWORDS, "")
_LITERALS = (ast.Constant, ast.List, ast.Tuple, ast.Dict, ast.Set)


def _must_accept(path: str, name: str, detail: str) -> ValueError:
    return ValueError(
        f"custom_reward_function {path}:{name} must accept (data_source, solution_str, ground_truth, "
        f"extra_info=None, **kwargs) and any custom_reward_function.reward_kwargs by keyword: {detail}"
    )


def _module_level(body: list[ast.stmt]):
    """The statements that run when the module is imported: the body and the blocks of its ifs, trys and withs."""
    for node in body:
        yield node
        if isinstance(node, ast.If | ast.For | ast.While | ast.With | ast.Try):
            blocks = [node.body, getattr(node, "orelse", [])]
            if isinstance(node, ast.Try):
                blocks += [node.finalbody, *(h.body for h in node.handlers)]
            for block in blocks:
                yield from _module_level(block)


def _bindings(tree: ast.Module, name: str) -> tuple[list[ast.AST], bool]:
    """Module-level statements that bind `name`, and whether a star import may bind it too."""
    found, star = [], False
    for node in _module_level(tree.body):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.name == name:
            found.append(node)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                found.append(node)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            star |= any(a.name == "*" for a in node.names)
            if any((a.asname or a.name.split(".")[0]) == name for a in node.names):
                found.append(node)
    return found, star


def _check_keywords(args: ast.arguments, keywords: list[str]) -> str | None:
    """Why a call by these keywords alone would fail on this signature (Python's binding rules), or None."""
    positional = [*args.posonlyargs, *args.args]
    with_default = {a.arg for a in positional[len(positional) - len(args.defaults) :]}
    with_default |= {a.arg for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is not None}
    by_keyword = {a.arg for a in [*args.args, *args.kwonlyargs]}
    unexpected = [k for k in keywords if k not in by_keyword and args.kwarg is None]
    if unexpected:
        return f"got an unexpected keyword argument {unexpected[0]!r}"
    missing = [a.arg for a in [*positional, *args.kwonlyargs] if a.arg not in with_default and a.arg not in keywords]
    posonly = [a.arg for a in args.posonlyargs if a.arg not in with_default]
    if missing or posonly:
        return f"missing a required argument: {(missing or posonly)[0]!r}"
    return None


def check_reward_file(path: str, name: str, reward_kwargs: dict[str, Any] | None = None) -> None:
    """Syntax, presence of `name` and (for a plain `def`) its signature, from the source alone; a ValueError or
    FileNotFoundError naming the key, the file and the line."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"custom_reward_function.path={path!r}: no such file")
    try:
        tree = ast.parse(file.read_bytes(), filename=str(file))
    except SyntaxError as e:
        raise ValueError(f"custom_reward_function.path={path!r}: syntax error at {file}:{e.lineno}: {e.msg}") from None
    except ValueError as e:  # null bytes, undecodable source
        raise ValueError(f"custom_reward_function.path={path!r}: not Python source ({e})") from None
    found, star = _bindings(tree, name)
    if not found:
        if star:
            return  # a star import may define it: the worker's load will tell
        defined = sorted(
            n.name for n in _module_level(tree.body) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
        )
        raise ValueError(
            f"custom_reward_function.name={name!r}: {path} defines no {name!r}; functions there: {defined or 'none'}"
        )
    last = found[-1]
    value = last.value if isinstance(last, ast.Assign | ast.AnnAssign) else None
    if isinstance(value, _LITERALS):
        try:
            kind = type(ast.literal_eval(value)).__name__
        except ValueError:  # a container of names: the worker's load will tell
            kind = None
        if kind is not None:
            raise ValueError(
                f"custom_reward_function.name={name!r}: {path}:{name} is a {kind}, not callable (line {last.lineno})"
            )
    if isinstance(last, ast.FunctionDef | ast.AsyncFunctionDef) and not last.decorator_list:
        why = _check_keywords(last.args, [*CALL_KEYWORDS, *(reward_kwargs or {})])
        if why is not None:
            raise _must_accept(path, name, f"{why} (line {last.lineno})")


def _load(path: str, name: str, reward_kwargs: dict[str, Any]) -> Any:
    """Run the file and return the function: in the scoring process only. A RewardSetupError naming the file when
    its code raises or the object is not a function that takes the call's keywords."""
    file = Path(path)
    # One module name per file, stable across processes, so objects defined there pickle the same everywhere.
    module_name = "nonstop_custom_reward_" + hashlib.sha1(str(file).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise RewardSetupError(f"custom_reward_function.path={path!r}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[module_name]
        frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == str(file)]
        line = f" (line {frames[-1].lineno})" if frames else ""
        raise RewardSetupError(
            f"custom_reward_function.path={path!r}: running the file failed{line}: {type(e).__name__}: {e}"
        ) from None
    fn = getattr(module, name, None)
    if not callable(fn):
        what = "defines no such name" if fn is None else f"is a {type(fn).__name__}, not callable"
        raise RewardSetupError(f"custom_reward_function.name={name!r}: {path}:{name} {what}")
    try:
        inspect.signature(fn).bind(**{**_PROBE, **reward_kwargs})
    except TypeError as e:
        raise RewardSetupError(str(_must_accept(path, name, str(e)))) from None
    except ValueError:  # builtins without a signature: nothing to check
        pass
    return fn


class CustomRewardFunction:
    """`path.py:name`, checked now from its source (so mistakes fail before the run, and no user code runs in the
    trainer) and run where it scores: it pickles as (path, name, kwargs) and loads the file when unpickled."""

    def __init__(self, path: str, name: str = "compute_score", reward_kwargs: dict[str, Any] | None = None):
        """`reward_kwargs` (verl's `custom_reward_function.reward_kwargs`) are passed on every call."""
        self.path, self.name = str(Path(path).resolve()), name
        self.reward_kwargs = dict(reward_kwargs or {})
        check_reward_file(self.path, name, self.reward_kwargs)
        self._fn: Any = None

    def load(self) -> Any:
        """The function, running the file the first time (a RewardSetupError when that fails)."""
        if self._fn is None:
            self._fn = _load(self.path, self.name, self.reward_kwargs)
        return self._fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        result = self.load()(*args, **{**self.reward_kwargs, **kwargs})
        # verl accepts `async def` scoring functions; a worker has no running loop, so run it to completion here.
        return asyncio.run(result) if inspect.iscoroutine(result) else result

    def __reduce__(self):
        return _loaded, (self.path, self.name, self.reward_kwargs)

    def __repr__(self) -> str:
        return f"CustomRewardFunction({self.path!r}, {self.name!r}, {self.reward_kwargs!r})"


def _loaded(path: str, name: str, reward_kwargs: dict[str, Any]) -> CustomRewardFunction:
    """Unpickling in a worker: the file runs now, so a failure is the worker's start-up error, not each sample's."""
    fn = CustomRewardFunction(path, name, reward_kwargs)
    fn.load()
    return fn


def load_custom_reward_fn(
    path: str, name: str = "compute_score", reward_kwargs: dict[str, Any] | None = None
) -> CustomRewardFunction:
    return CustomRewardFunction(path, name, reward_kwargs)
