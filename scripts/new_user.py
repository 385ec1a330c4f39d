"""The first hour of a new user, checked: a verl user's command line against nonstop, then every command README.md
and docs/quickstart.md show, run in order and timed against the time the docs state for a 2-core CPU.

    .venv/bin/python scripts/new_user.py --quick   # CI (tests/scripts/test_new_user.py): seconds, nothing trained
    .venv/bin/python scripts/new_user.py           # a person on a 2-core CPU: every documented command (about 1 h)

Both modes check the verl command line (verl's GSM8K GRPO example for one GPU plus the keys verl users carried
over: `actor.strategy=fsdp2`, `rollout.name=vllm`, `rollout.mode=async`, `*.profiler.*`,
`global_profiler.global_tool_config.*`): every verl key nonstop drops is named on its own `note:` line and no other
key is; `--key=value` means `key=value`; the misspellings a verl user makes get the hint they need. Then the
documented commands: `--quick` checks that the list below is the docs' list and that each command's config loads;
the full mode runs them in a scratch directory (the repository's `.venv` and `examples/` linked in) and fails a
command that exits non-zero or takes longer than its stated time times `--slack`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/quickstart.md")

# verl's examples/grpo_trainer/run_qwen2-7b.sh on one GPU (verl's quickstart: tensor parallel 1, one GPU), with
# Qwen2.5-0.5B-Instruct as in docs/migrating-from-verl.md, and the keys verl users add.
VERL_COMMAND = shlex.split(
    """algorithm.adv_estimator=grpo data.train_files=$HOME/data/gsm8k/train.parquet
    data.val_files=$HOME/data/gsm8k/test.parquet data.train_batch_size=1024 data.max_prompt_length=512
    data.max_response_length=1024 data.filter_overlong_prompts=True data.truncation='error'
    actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.model.use_remove_padding=True actor_rollout_ref.actor.ppo_mini_batch_size=256
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40 actor_rollout_ref.actor.use_kl_loss=True
    actor_rollout_ref.actor.kl_loss_coef=0.001 actor_rollout_ref.actor.kl_loss_type=low_var_kl
    actor_rollout_ref.actor.entropy_coeff=0 actor_rollout_ref.model.enable_gradient_checkpointing=True
    actor_rollout_ref.actor.fsdp_config.param_offload=False actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 actor_rollout_ref.rollout.n=5
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40 actor_rollout_ref.ref.fsdp_config.param_offload=True
    algorithm.use_kl_in_reward=False trainer.critic_warmup=0 trainer.logger='["console"]'
    trainer.project_name=verl_grpo_example_gsm8k trainer.experiment_name=qwen2_5_0_5b_function_rm
    trainer.n_gpus_per_node=1 trainer.nnodes=1 trainer.save_freq=20 trainer.test_freq=5 trainer.total_epochs=15
    actor_rollout_ref.actor.strategy=fsdp2 actor_rollout_ref.rollout.mode=async
    actor_rollout_ref.actor.profiler.enable=False actor_rollout_ref.actor.profiler.all_ranks=False
    actor_rollout_ref.ref.profiler.enable=False critic.profiler.enable=False
    global_profiler.global_tool_config.nsys.discrete=False
    global_profiler.global_tool_config.torch_memory.trace_alloc_max_entries=100000"""
)
# The verl keys of that command nonstop has no use for: each must be named on a note line, and only these.
VERL_DROPPED = {
    "actor_rollout_ref.model.use_remove_padding",
    "actor_rollout_ref.rollout.tensor_model_parallel_size",
    "actor_rollout_ref.rollout.name",
    "actor_rollout_ref.actor.strategy",
    "actor_rollout_ref.rollout.mode",
    "actor_rollout_ref.actor.profiler.enable",
    "actor_rollout_ref.actor.profiler.all_ranks",
    "actor_rollout_ref.ref.profiler.enable",
    "critic.profiler.enable",
    "global_profiler.global_tool_config.nsys.discrete",
    "global_profiler.global_tool_config.torch_memory.trace_alloc_max_entries",
}
# Mistakes verl users make, and what the one error line must say.
HINTS = {
    "use_dynamic_bsz=True": "did you mean 'actor_rollout_ref.actor.use_dynamic_bsz'",
    "trainer.overlap_generation_training=True": "trainer.mode=one_step_off or trainer.mode=async",
    "foo.profiler.enable=True": "unknown key 'foo.profiler.enable'",
}


@dataclass(frozen=True)
class Documented:
    """A command as the docs show it, and the time they state for it on a 2-core CPU (seconds; None: none stated).
    `skip` says why it is not run here (a GPU-sized run, a placeholder path)."""

    command: str
    stated_s: float | None = None
    skip: str = ""
    cwd: str = "scratch"  # "repo" for make targets, which act on the repository itself


GPU = "sized for a GPU"
PLACEHOLDER = "placeholder paths"
# Every command README.md and docs/quickstart.md show, in the order a reader runs them; `--quick` fails when the docs
# show a command this list lacks (add it, with the time the docs state) or drop one it has.
COMMANDS = (
    Documented("make demo", 240, cwd="repo"),  # with .venv present, the demo is `nonstop train`: "about four minutes"
    Documented("make test", 1020, cwd="repo"),  # README: "about 7 minutes on idle cores, up to 17 on busy ones"
    Documented(".venv/bin/nonstop train", 240),  # quickstart: "about four minutes on two CPU cores"
    Documented(
        ".venv/bin/nonstop train trainer.total_training_steps=1 data.train_batch_size=2 "
        "actor_rollout_ref.actor.ppo_mini_batch_size=2 actor_rollout_ref.rollout.n=2 data.max_response_length=16 "
        "trainer.default_local_dir=/tmp/nonstop_smoke",
        60,  # "about a minute on two CPU cores, model loading included"
    ),
    Documented(
        ".venv/bin/nonstop train examples/arith_smollm2.yaml trainer.total_training_steps=10 trainer.test_freq=5"
    ),
    Documented(".venv/bin/nonstop data gsm8k --source ../shared/data/gsm8k --out data/gsm8k"),
    Documented(".venv/bin/nonstop train examples/gsm8k_smollm2_cpu.yaml", 600),  # quickstart: "under ten minutes"
    Documented(".venv/bin/nonstop train trainer.save_freq=10"),
    Documented(".venv/bin/nonstop train trainer.save_freq=10 trainer.total_training_steps=60"),
    Documented(".venv/bin/nonstop export runs/nonstop/smollm2_builtin --out smollm2-arith"),
    Documented(
        ".venv/bin/nonstop train actor_rollout_ref.model.lora_rank=32 actor_rollout_ref.model.lora_alpha=64 "
        "actor_rollout_ref.actor.optim.lr=1e-4 trainer.save_freq=10 trainer.experiment_name=smollm2_lora"
    ),
    Documented(".venv/bin/nonstop export runs/nonstop/smollm2_lora --out adapter"),
    Documented(".venv/bin/nonstop export runs/nonstop/smollm2_lora --out merged --merge"),
    Documented(
        '.venv/bin/nonstop generate --prompt "Calculate 7 + 5. Reply with only the final number." --max-tokens 8'
    ),
    Documented(
        '.venv/bin/nonstop generate --model smollm2-arith --prompt "Calculate 7 + 5. Reply with only the final '
        'number." --max-tokens 8'
    ),
    Documented(".venv/bin/nonstop generate --input requests.jsonl --n 4 --temperature 1.0 --seed 0 --json"),
    Documented(".venv/bin/nonstop --help"),
    Documented('.venv/bin/nonstop generate --prompt "Name three prime numbers." --max-tokens 64'),
    Documented(
        ".venv/bin/nonstop generate --model path/to/hf_dir_or.gguf --input requests.jsonl --n 4 --temperature 1.0 "
        "--json",
        skip=PLACEHOLDER,
    ),
    Documented(".venv/bin/nonstop config show actor_rollout_ref.rollout.n=8 data.train_batch_size=512"),
    Documented(".venv/bin/nonstop train examples/gsm8k_smollm2.yaml trainer.total_training_steps=50", skip=GPU),
    Documented(".venv/bin/nonstop doctor runs/nonstop/gsm8k_smollm2", skip=GPU),
    Documented(".venv/bin/nonstop export runs/nonstop/gsm8k_smollm2 --out hf_model", skip=GPU),
)


def documented_commands() -> list[str]:
    """The `make` and `.venv/bin/nonstop` lines of the bash blocks of DOCS, continuation lines joined and trailing
    comments dropped, in order."""
    found = []
    for doc in DOCS:
        for block in re.findall(r"```bash\n(.*?)```", (REPO / doc).read_text(), flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                words = shlex.split(line, comments=True)
                if words and (words[0] == ".venv/bin/nonstop" or words[0] == "make"):
                    found.append(shlex.join(words))
    return list(dict.fromkeys(found))


def normalized(command: str) -> str:
    return shlex.join(shlex.split(command))


def nonstop(args: list[str]) -> tuple[int, str, str]:
    """`nonstop ARGS` in this process: exit code, stdout, stderr."""
    from nonstop.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(args)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    return code, out.getvalue(), err.getvalue()


class Report:
    def __init__(self) -> None:
        self.failures: list[str] = []

    def check(self, ok: bool, what: str) -> None:
        print(f"{'ok  ' if ok else 'FAIL'} {what}", flush=True)
        if not ok:
            self.failures.append(what)


def check_verl_command(report: Report) -> None:
    command = [os.path.expandvars(item) for item in VERL_COMMAND]
    code, out, err = nonstop(["config", "show", *command])
    report.check(code == 0, f"verl's GRPO command line loads (exit {code}{': ' + err.strip() if code else ''})")
    noted = [line.split("=", 1)[0].removeprefix("note: ") for line in err.splitlines() if line.startswith("note: ")]
    for key in sorted(VERL_DROPPED):
        report.check(noted.count(key) == 1, f"dropped verl key named once: {key}")
    report.check(set(noted) <= VERL_DROPPED, f"no note for a key nonstop uses (extra: {set(noted) - VERL_DROPPED})")
    lines = [line for line in err.splitlines() if line.startswith("note: ")]
    report.check(all("is not used by nonstop: " in line for line in lines), "each note says what nonstop does instead")
    mode = next((line for line in lines if "rollout.mode" in line), "")
    report.check("trainer.mode=async" in mode, f"rollout.mode=async points at trainer.mode: {mode!r}")
    dashed = nonstop(["config", "show", *(f"--{item}" for item in command)])
    report.check(dashed == (code, out, err), "--key=value means key=value")
    migrating = (REPO / "docs/migrating-from-verl.md").read_text()
    line = next(m for m in re.findall(r"^nonstop train .*(?:\n    .*)*", migrating, flags=re.M))
    items = [os.path.expandvars(w) for w in shlex.split(line.replace("\\\n", " ")) if w != "..."][2:]
    code, _, err = nonstop(["config", "show", *items])
    report.check(code == 0, f"docs/migrating-from-verl.md's command loads{': ' + err.strip() if code else ''}")
    for item, expected in HINTS.items():
        code, _, err = nonstop(["config", "show", item])
        report.check(code == 2 and expected in err and len(err.strip().splitlines()) == 1, f"{item}: {err.strip()}")
    code, out, _ = nonstop(["--version"])
    report.check(code == 0 and out.startswith("nonstop "), f"nonstop --version: {out.strip()}")


def check_documented_list(report: Report) -> None:
    listed = [normalized(c.command) for c in COMMANDS]
    shown = documented_commands()
    for command in shown:
        report.check(command in listed, f"documented command is in this script's list: {command}")
    for command in listed:
        report.check(command in shown, f"listed command is still in the docs: {command}")


def check_documented_configs(report: Report) -> None:
    """Each documented `nonstop train` / `config show` command's config loads (keys exist, values are valid)."""
    from nonstop.cli.train_cmd import config_from_args

    for documented in COMMANDS:
        words = shlex.split(documented.command)
        if words[:2] == [".venv/bin/nonstop", "train"] or words[:3] == [".venv/bin/nonstop", "config", "show"]:
            items = words[2:] if words[1] == "train" else words[3:]
            items = [str(REPO / i) if i.endswith(".yaml") else i for i in items]
            try:
                config_from_args(items)
                report.check(True, f"config loads: {documented.command}")
            except ValueError as e:
                report.check(False, f"config loads: {documented.command}: {e}")


def scratch_dir() -> Path:
    """`<tmp>/work` with the repository's .venv and examples linked in and `<tmp>/shared` the data, so the documented
    relative paths (`examples/...`, `../shared/data/gsm8k`) resolve and nothing lands in the repository."""
    root = Path(tempfile.mkdtemp(prefix="nonstop_new_user_"))
    work = root / "work"
    work.mkdir()
    for name in (".venv", "examples"):
        (work / name).symlink_to(REPO / name)
    (root / "shared").symlink_to((REPO.parent / "shared").resolve())
    (work / "requests.jsonl").write_text('{"prompt": "Calculate 2 + 2. Reply with only the final number."}\n')
    return work


def run_documented(report: Report, slack: float) -> None:
    work = scratch_dir()
    print(f"scratch directory: {work}", flush=True)
    for documented in COMMANDS:
        if documented.skip:
            print(f"skip {documented.command} ({documented.skip})", flush=True)
            continue
        cwd = REPO if documented.cwd == "repo" else work
        limit = None if documented.stated_s is None else documented.stated_s * slack
        start = time.monotonic()
        try:
            done = subprocess.run(
                documented.command, shell=True, cwd=cwd, capture_output=True, text=True, timeout=limit
            )
            code, tail = done.returncode, (done.stderr or done.stdout).strip().splitlines()[-1:]
        except subprocess.TimeoutExpired:
            code, tail = None, ["killed at the time limit"]
        took = time.monotonic() - start
        stated = "no time stated" if documented.stated_s is None else f"stated {documented.stated_s:.0f} s"
        ok = code == 0 and (limit is None or took <= limit)
        why = "" if ok else ": " + "".join(tail)
        report.check(ok, f"{documented.command}: exit {code}, {took:.0f} s ({stated}){why}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="check command lines and configs only (CI)")
    parser.add_argument("--slack", type=float, default=1.25, help="allowed factor over a stated time (full mode)")
    args = parser.parse_args(argv)
    report = Report()
    check_verl_command(report)
    check_documented_list(report)
    check_documented_configs(report)
    if not args.quick:
        run_documented(report, args.slack)
    print(f"\n{len(report.failures)} failed" if report.failures else "\nall checks passed", flush=True)
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
