"""Which launches take programmatic dependent launch: never a CPU tensor (the interpreter has no grid dependency
control), and never when NONSTOP_PDL=0 (read once, at import, so checked in a fresh interpreter)."""

import os
import subprocess
import sys

import torch

from nonstop.kernels.pdl import use_pdl


def test_cpu_tensors_never_take_pdl():
    assert use_pdl(torch.zeros(4)) is False


def test_the_environment_switch_is_read_at_import():
    code = "import nonstop.kernels.pdl as p; print(p._ENABLED)"
    for value, expected in (("0", "False"), ("1", "True")):
        env = {**os.environ, "NONSTOP_PDL": value}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == expected, value


def test_every_pdl_launch_waits_before_its_first_access():
    """A kernel launched with PDL may start before the previous kernel's writes land, so (read from the source) every
    Triton kernel with a PDL flag must open with `if PDL: gdc_wait()`, and every launch passing `launch_pdl` must pass
    the same value as the kernel's PDL flag."""
    import ast
    from pathlib import Path

    import nonstop.kernels

    kernels_dir = Path(nonstop.kernels.__file__).parent
    launches = 0
    for path in sorted(kernels_dir.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and any(a.arg == "PDL" for a in node.args.args):
                first = node.body[0]
                opens_with_wait = (
                    isinstance(first, ast.If)
                    and ast.unparse(first.test) == "PDL"
                    and ast.unparse(first.body[0]).strip() == "gdc_wait()"
                )
                assert opens_with_wait, f"{path.name}:{node.lineno} {node.name} does not open with `if PDL: gdc_wait()`"
            if isinstance(node, ast.Call):
                keywords = {k.arg: ast.unparse(k.value) for k in node.keywords}
                if "launch_pdl" in keywords:
                    launches += 1
                    assert keywords.get("PDL") == keywords["launch_pdl"], f"{path.name}:{node.lineno}"
    assert launches >= 5  # RMSNorm, SiLU·up, rotary decode attention, the sampler's two kernels
