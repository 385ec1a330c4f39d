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
