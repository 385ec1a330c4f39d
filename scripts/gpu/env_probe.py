"""Print what the GPU machine offers that nonstop's fast paths depend on (torch varlen_attn signature, triton)."""

import inspect
import json
import os

import torch

info = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": torch.cuda.get_device_name(0)}
from torch.nn.attention import varlen  # noqa: E402

info["varlen_attn"] = str(inspect.signature(varlen.varlen_attn))
try:
    import triton

    info["triton"] = triton.__version__
except ImportError:
    info["triton"] = None
import transformers  # noqa: E402

info["transformers"] = transformers.__version__
free, total = torch.cuda.mem_get_info()
info["mem_free_gib"], info["mem_total_gib"] = free / 2**30, total / 2**30
print(json.dumps(info, indent=1))
out = os.environ.get("OUT")
if out:
    with open(os.path.join(out, "env.json"), "w") as f:
        json.dump(info, f, indent=1)
