"""User scoring functions loaded from `custom_reward_function.path` / `.name`, verl's signature:
`fn(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float | dict`.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any

_PROBE = dict(data_source="", solution_str="", ground_truth="", extra_info=None)


def _load(path: str, name: str, reward_kwargs: dict[str, Any] | None = None) -> Any:
    """The function, or a ValueError naming the key and what is wrong (the CLI prints it as one line)."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"custom_reward_function.path={path!r}: no such file")
    # One module name per file, stable across processes, so objects defined there pickle the same everywhere.
    module_name = "nonstop_custom_reward_" + hashlib.sha1(str(file).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise ValueError(f"custom_reward_function.path={path!r}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    if not hasattr(module, name):
        defined = sorted(k for k, v in vars(module).items() if inspect.isfunction(v) and v.__module__ == module_name)
        raise ValueError(
            f"custom_reward_function.name={name!r}: {path} defines no {name!r}; functions there: {defined or 'none'}"
        )
    fn = getattr(module, name)
    if not callable(fn):
        raise ValueError(f"custom_reward_function.name={name!r}: {path}:{name} is a {type(fn).__name__}, not callable")
    try:
        inspect.signature(fn).bind(**{**_PROBE, **(reward_kwargs or {})})
    except TypeError as e:
        raise ValueError(
            f"custom_reward_function {path}:{name} must accept (data_source, solution_str, ground_truth, "
            f"extra_info=None, **kwargs) and any custom_reward_function.reward_kwargs by keyword: {e}"
        ) from None
    except ValueError:  # builtins without a signature: nothing to check
        pass
    return fn


class CustomRewardFunction:
    """`path.py:name`, loaded now (so mistakes fail before the run) and re-loaded from the file in each reward
    worker process: it pickles as (path, name), never as the function object."""

    def __init__(self, path: str, name: str = "compute_score", reward_kwargs: dict[str, Any] | None = None):
        """`reward_kwargs` (verl's `custom_reward_function.reward_kwargs`) are passed on every call."""
        self.path, self.name = str(Path(path).resolve()), name
        self.reward_kwargs = dict(reward_kwargs or {})
        self._fn = _load(self.path, name, self.reward_kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        result = self._fn(*args, **{**self.reward_kwargs, **kwargs})
        # verl accepts `async def` scoring functions; a worker has no running loop, so run it to completion here.
        return asyncio.run(result) if inspect.iscoroutine(result) else result

    def __reduce__(self):
        return CustomRewardFunction, (self.path, self.name, self.reward_kwargs)

    def __repr__(self) -> str:
        return f"CustomRewardFunction({self.path!r}, {self.name!r}, {self.reward_kwargs!r})"


def load_custom_reward_fn(
    path: str, name: str = "compute_score", reward_kwargs: dict[str, Any] | None = None
) -> CustomRewardFunction:
    return CustomRewardFunction(path, name, reward_kwargs)
