"""`nonstop bench logprob` on CPU with tiny sizes: the torch path timed and recorded, the fused path reported as
needing CUDA, the JSON written with its environment; and through the CLI."""

from __future__ import annotations

import json

import torch

from nonstop.bench import logprob
from nonstop.cli import main as cli_main
from nonstop.models.logprob import chunked_logprobs_and_entropy

TINY_ARGS = ["--tokens", "40", "--hidden", "16", "--vocab", "100", "--chunk-size", "16", "--warmup", "1"]
TINY_ARGS += ["--iters", "3"]


def test_cpu_run_times_the_torch_path_and_writes_json(tmp_path):
    out = tmp_path / "logprob.json"
    assert logprob.main([*TINY_ARGS, "--device", "cpu", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    fused, plain = result["rows"]
    assert fused == {"path": "fused", "error": "the fused kernels need CUDA; device is cpu"}
    assert plain["path"] == "torch" and len(plain["forward_backward_ms_all"]) == 3
    assert 0 < plain["forward_ms"] <= plain["forward_backward_ms"]
    assert "speedup" not in result and result["meta"]["config"]["tokens"] == 40 and "torch" in result["meta"]


def test_step_computes_what_it_times():
    """The timed step is the bf16-autocast forward + backward of the chunked log-prob, on the benchmark's inputs."""
    args = logprob.parser().parse_args(TINY_ARGS)
    inputs = logprob.make_inputs(args, torch.device("cpu"))
    logprob.step(inputs, args, torch.device("cpu"))
    got = logprob.outputs(inputs)
    hidden_TD = inputs["hidden_TD"].detach().clone().requires_grad_()
    weight_VD = inputs["weight_VD"].detach().clone().requires_grad_()
    logp, entropy = chunked_logprobs_and_entropy(
        hidden_TD, weight_VD, inputs["target_T"], chunk_size=16, matmul_dtype=torch.bfloat16
    )
    ((inputs["a_T"] * logp).sum() + (inputs["b_T"] * entropy).sum()).backward()
    torch.testing.assert_close(got["logprob"], logp.detach())
    torch.testing.assert_close(got["entropy"], entropy.detach())
    torch.testing.assert_close(got["grad_hidden"], hidden_TD.grad)
    torch.testing.assert_close(got["grad_weight"], weight_VD.grad)


def test_table_reports_speedup_and_differences():
    rows = [
        {"path": "fused", "forward_ms": 10.0, "forward_backward_ms": 40.0, "peak_extra_mib": 900.0},
        {"path": "torch", "forward_ms": 30.0, "forward_backward_ms": 100.0, "peak_extra_mib": 3000.0},
    ]
    text = logprob.table({"rows": rows, "speedup": 2.5, "max_abs_diff": {"logprob": 1e-5}})
    assert "2.50x" in text and "logprob 1.0e-05" in text and "900" in text


def test_cli_runs_the_benchmark(tmp_path):
    out = tmp_path / "cli.json"
    assert cli_main(["bench", "logprob", *TINY_ARGS, "--device", "cpu", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["rows"][1]["path"] == "torch"
