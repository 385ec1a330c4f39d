"""Would partitioning the GPU's SMs between decode and training make them overlap better on one GPU? A probe for the
overlap-modes issue: decode (the engine, CUDA graphs, random Qwen2.5-0.5B weights) beside a compute-bound stand-in
for the update (bf16 matrix products of a training step's size), each alone and then together, first on two plain
streams (what `trainer.mode=one_step_off` / `async` do today), then with CUDA green contexts giving one side a fixed
number of SMs. A development tool for the GPU machine:

    python3 scripts/gpu/green_probe.py [--batch 128] [--sms 16 32 48 64] [--out FILE.json]

Reported per setting: decode tok/s and matmul TFLOP/s while both run, each as a fraction of its rate alone on the
whole GPU, and their sum: 1.0 means overlapping gains nothing over running them one after the other, 2.0 that
neither slowed the other.
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import torch

from nonstop.bench.env import environment
from nonstop.bench.rollout import random_model
from nonstop.rollout import LLM, SamplingParams


class MatmulLoad:
    """Back-to-back bf16 products on `stream` until stopped, in a thread; counts the FLOPs completed."""

    def __init__(self, stream: torch.cuda.Stream, size: int = 8192):
        self.stream, self.size = stream, size
        with torch.cuda.stream(stream):
            self.a = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
            self.b = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
            self.c = torch.empty_like(self.a)
        self.stop = threading.Event()
        self.flops = 0.0

    def _run(self) -> None:
        with torch.cuda.stream(self.stream):
            while not self.stop.is_set():
                for _ in range(4):
                    torch.mm(self.a, self.b, out=self.c)
                self.stream.synchronize()
                self.flops += 4 * 2 * self.size**3

    def run_for(self, seconds: float) -> float:
        """TFLOP/s alone over `seconds`."""
        self.start()
        time.sleep(seconds)
        return self.finish()

    def start(self) -> None:
        self.flops, self.t0 = 0.0, time.perf_counter()
        self.stop.clear()
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def finish(self) -> float:
        self.stop.set()
        self.thread.join()
        return self.flops / (time.perf_counter() - self.t0) / 1e12


def decode_tok_s(llm: LLM, prompts, params, stream: torch.cuda.Stream) -> float:
    with torch.cuda.stream(stream):
        stream.synchronize()
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        stream.synchronize()
    return sum(len(c.token_ids) for o in outs for c in o.outputs) / (time.perf_counter() - start)


def green_stream(num_sms: int) -> torch.cuda.Stream:
    from torch.cuda.green_contexts import GreenContext

    try:
        ctx = GreenContext.create(num_sms=num_sms, device_id=0)
    except TypeError:  # older signature: positional
        ctx = GreenContext.create(num_sms, 0)
    green_stream.keep.append(ctx)  # the context must outlive its stream
    return ctx.Stream()


green_stream.keep = []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--sms", type=int, nargs="+", default=[16, 32, 48, 64])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    total_sms = torch.cuda.get_device_properties(0).multi_processor_count
    model = random_model("qwen2.5-0.5b", torch.device("cuda"))
    llm = LLM(model, gpu_memory_utilization=0.3, max_num_seqs=args.batch)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 151936, (128,), generator=gen).tolist() for _ in range(args.batch)]
    params = [
        SamplingParams(temperature=1.0, max_tokens=args.new_tokens, ignore_eos=True, seed=i) for i in range(args.batch)
    ]
    plain_gen, plain_mm = torch.cuda.Stream(), torch.cuda.Stream()
    decode_tok_s(llm, prompts[:8], params[:8], plain_gen)  # graphs and kernels
    decode_tok_s(llm, prompts, params, plain_gen)
    load = MatmulLoad(plain_mm)
    load.run_for(1.0)
    gen_alone = decode_tok_s(llm, prompts, params, plain_gen)
    mm_alone = load.run_for(3.0)
    print(f"{total_sms} SMs; alone: decode {gen_alone:.0f} tok/s (batch {args.batch}), matmul {mm_alone:.0f} TFLOP/s")
    rows = []

    def together(label: str, gen_stream: torch.cuda.Stream, mm_stream: torch.cuda.Stream) -> None:
        mm = MatmulLoad(mm_stream)
        decode_alone_here = decode_tok_s(llm, prompts, params, gen_stream)
        mm_alone_here = mm.run_for(2.0)
        mm.start()
        time.sleep(0.2)
        tok_s = decode_tok_s(llm, prompts, params, gen_stream)
        tflops = mm.finish()
        row = dict(
            setting=label,
            decode_alone_tok_s=decode_alone_here,
            matmul_alone_tflops=mm_alone_here,
            decode_tok_s=tok_s,
            matmul_tflops=tflops,
            decode_frac=tok_s / gen_alone,
            matmul_frac=tflops / mm_alone,
        )
        row["sum"] = row["decode_frac"] + row["matmul_frac"]
        rows.append(row)
        print(
            f"{label:28} alone here {decode_alone_here:8.0f} tok/s {mm_alone_here:5.0f} TF | together "
            f"{tok_s:8.0f} tok/s ({row['decode_frac']:.2f}) {tflops:5.0f} TF ({row['matmul_frac']:.2f}) "
            f"sum {row['sum']:.2f}",
            flush=True,
        )

    together("plain streams", plain_gen, plain_mm)
    high = torch.cuda.Stream(priority=-1)
    together("plain, decode high priority", high, plain_mm)
    for n in args.sms:
        try:
            together(f"decode on {n} SMs", green_stream(n), plain_mm)
            together(f"matmul on {total_sms - n} SMs", plain_gen, green_stream(total_sms - n))
            together(f"decode {n} / matmul {total_sms - n}", green_stream(n), green_stream(total_sms - n))
        except Exception as e:  # noqa: BLE001 - a probe: report what the driver or torch refused, keep the rest
            print(f"green context with {n} SMs failed: {type(e).__name__}: {e}", flush=True)
            rows.append(dict(setting=f"{n} SMs", error=f"{type(e).__name__}: {e}"))
    if args.out:
        payload = dict(environment=environment(), batch=args.batch, gen_alone=gen_alone, mm_alone=mm_alone, rows=rows)
        with open(args.out, "w") as f:
            json.dump(payload, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
