"""Triton kernels on CPU: run a test module's check function in a child process under triton's interpreter.

TRITON_INTERPRET=1 has to be set before triton is first imported, and the pytest process has usually imported it
already, so each interpreter test starts a fresh Python with it set.
"""

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


def run_under_interpreter(module: str, function: str) -> None:
    """Import `module` (a file in tests/kernels) in a child process with TRITON_INTERPRET=1 and call `function`."""
    pytest.importorskip("triton")
    here = os.path.dirname(__file__)
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]),
    }
    code = f"import interpreter; interpreter.patch_interpreter_for_numpy(); import {module}; {module}.{function}()"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
