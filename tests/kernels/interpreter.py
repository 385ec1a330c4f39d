"""Triton kernels on CPU: run a test module's function in a child process under triton's interpreter.

TRITON_INTERPRET=1 has to be set before triton is first imported, and the pytest process has usually imported it
already, so each interpreter test starts a fresh Python with it set. The child patches the interpreter first: a fix
for numpy >= 2.4, then three cuts of repeated or unread work that leave every value a kernel computes as it was
(on kernels with small tiles the interpreter's time goes to Python per operation, not to numpy; dev log).
"""

import dataclasses
import json
import os
import subprocess
import sys

import pytest


def patch_interpreter_for_numpy() -> None:
    """triton 3.6's interpreter calls int() on 1-element arrays, which numpy >= 2.4 refuses (triton#9171, fixed
    upstream by squeezing first); loop bounds read from memory or computed from program ids hit it."""
    import triton.runtime.interpreter as interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patch_tensor_squeezing_index(tensor, scope) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patch_tensor_squeezing_index


def patch_interpreter_language_once_per_launch() -> None:
    """triton 3.6's interpreter patches triton.language again on every call of a @triton.jit helper (a kernel's own
    helpers and tl.sum, tl.max, ...), walking the language modules with inspect.getmembers: a millisecond or two a
    call, half the time of a kernel with small tiles. Nothing undoes a patch before its launch ends, and patching
    again sets the same attributes to the same functions, so a module's view of the language is patched once a launch.
    """
    import triton.runtime.interpreter as interpreter

    patch_lang, run_grid = interpreter._patch_lang, interpreter.GridExecutor.__call__
    patched = set()  # id(fn.__globals__) of the modules patched in the running launch

    def patch_lang_once(fn):
        if id(fn.__globals__) in patched:
            return interpreter._LangPatchScope()  # nothing to undo: the launch's own scope restores the language
        patched.add(id(fn.__globals__))
        return patch_lang(fn)

    def run_grid_patching_afresh(self, *args, **kwargs):
        patched.clear()  # the launch patches the language itself, and restores it when it ends
        try:
            return run_grid(self, *args, **kwargs)
        finally:
            patched.clear()

    interpreter._patch_lang = patch_lang_once
    interpreter.GridExecutor.__call__ = run_grid_patching_afresh


def skip_interpreter_overflow_checks() -> None:
    """With `sanitize_overflow` the interpreter redoes every int32 add, sub and mul in int64 and compares the result
    with int32's range (half of a small kernel's time once the language is patched once a launch), for a
    `device_assert` that returns at once, the interpreter's `debug` being off; triton 3.6 reads the option nowhere
    else."""
    import triton.runtime.interpreter as interpreter

    options = interpreter.interpreter_builder.options
    if not options.debug:
        interpreter.interpreter_builder.options = dataclasses.replace(options, sanitize_overflow=False)


def cache_interpreter_numpy_dtypes() -> None:
    """triton 3.6's `_get_np_dtype` builds its table of numpy types anew on every call, a few calls an operation:
    a fifth of a small kernel's time once the two cuts above are in. The numpy type depends on the element type
    alone, so it is looked up once for each."""
    import triton.runtime.interpreter as interpreter

    get_np_dtype, by_element_type = interpreter._get_np_dtype, {}

    def get_np_dtype_once(tt_dtype):
        name = tt_dtype.scalar.name  # a block's element type; pointers ("pointer<fp32>") are uint64 addresses
        if name not in by_element_type:
            by_element_type[name] = get_np_dtype(tt_dtype)
        return by_element_type[name]

    interpreter._get_np_dtype = get_np_dtype_once


def patch_interpreter() -> None:
    """What the child runs before importing the test module."""
    patch_interpreter_for_numpy()
    patch_interpreter_language_once_per_launch()
    skip_interpreter_overflow_checks()
    cache_interpreter_numpy_dtypes()


def run_under_interpreter(module: str, function: str, *args):
    """Import `module` (a file in tests/kernels) in a child process with TRITON_INTERPRET=1 and call `function(*args)`;
    the arguments and the return value travel as JSON (the return value as the child's last line of output)."""
    pytest.importorskip("triton")
    here = os.path.dirname(__file__)
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]),
    }
    code = (
        f"import json, sys, interpreter; interpreter.patch_interpreter(); import {module}; "
        f"print(json.dumps({module}.{function}(*json.loads(sys.argv[1]))))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, json.dumps(args)], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.splitlines()[-1])
