"""`nonstop bench trl-parity`: whole GRPO runs of nonstop and of TRL 1.16's `GRPOTrainer` on the same model, prompts
(same order), reward and settings, several seeds per side, compared by learning curve and by clock.

    nonstop bench trl-parity --task arith --seeds 0,1,2 --steps 20 --jobs 1 --out bench/results/DIR

Every (side, seed) is a process of its own, `--jobs` at a time (TRL's generation is host-bound: on a GPU machine
several runs at once use it far better), writing `WORK/runs/<side>-<seed>/metrics.jsonl`; seconds measured so are
labelled concurrent. `--alone-steps K` adds one timing run per side afterwards, alone, K steps without validation.
`--budget-s` stops whatever still runs at that point; the report is made from the steps logged by then.
Written to `--out`: `trl_parity.json` (settings matched and how, the model and prompt identity checks, per run and
step: samples so far, reward, training seconds, held-out greedy scores; bands, checks and times), `trl_parity.png`,
each run's metrics and log. The printed table ends with the checks (`report.py`).

Defaults are nonstop's embedded demo (`nonstop train`): SmolLM2-135M-Instruct on `nonstop/arith`, 8 prompts x 4
samples, 32-token responses, lr 1e-5 constant; the settings `settings.py` matches, with weight decay 0.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from nonstop.bench.env import environment, work_dir
from nonstop.bench.trl_parity.inputs import (
    GSM8K_REWARDS,
    TASKS,
    Task,
    identity,
    load_task,
    prepare_model,
    train_order,
    write_rows,
)
from nonstop.bench.trl_parity.plan import SIDES, Plan, run_name
from nonstop.bench.trl_parity.report import compare, load_curves, plot, table, write
from nonstop.bench.trl_parity.settings import LOSS_TYPES, pairs_table

STOP_GRACE_S = 15.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="nonstop bench trl-parity", description=__doc__.split("\n\n")[0])
    p.add_argument("--task", choices=TASKS, default="arith")
    p.add_argument("--gsm8k-dir", default=None, help="GSM8K's release files (train.jsonl, test.jsonl), for gsm8k")
    p.add_argument("--reward", choices=sorted(GSM8K_REWARDS), default="format", help="the GSM8K reward")
    p.add_argument("--model", default=None, help="a GGUF file or HF directory (default: the embedded SmolLM2)")
    p.add_argument("--seeds", default="0,1,2", help="comma list; each seed is a prompt order and a sampling seed")
    p.add_argument("--sides", default=",".join(SIDES), help="comma list of nonstop, trl")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per run")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--response-len", type=int, default=32, help="most tokens per response")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--warmup-steps", type=int, default=0, help="linear warm-up from lr 0")
    p.add_argument("--scheduler", choices=("constant", "cosine"), default="constant", help="after the warm-up")
    p.add_argument("--loss-agg-mode", choices=sorted(LOSS_TYPES), default="token-mean")
    p.add_argument("--test-freq", type=int, default=10, help="held-out greedy validation every this many steps")
    p.add_argument("--val-size", type=int, default=None, help="held-out prompts (default: arith all, gsm8k 128)")
    p.add_argument("--last", type=int, default=10, help="steps averaged for the closing check")
    p.add_argument("--jobs", type=int, default=1, help="runs at once")
    p.add_argument("--alone-steps", type=int, default=0, help="steps of one timing run per side, alone (0 = none)")
    p.add_argument("--budget-s", type=float, default=None, help="stop runs still going after this many seconds")
    p.add_argument("--trl-micro-batch", type=int, default=None, help="TRL samples per forward (default: all)")
    p.add_argument("--work-dir", default=None, help="model, data and runs (default: a temporary directory)")
    p.add_argument("--out", default=None, help="result directory (default bench/results/trl-parity-<time>/)")
    p.add_argument("--report-only", action="store_true", help="report on the runs already in --work-dir")
    p.add_argument("--worker", nargs=2, metavar=("SIDE", "SEED"), help=argparse.SUPPRESS)
    p.add_argument("--alone", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--override", nargs="*", default=[], metavar="KEY=VALUE", help="more nonstop keys for every run")
    args = p.parse_args(argv)
    args.seeds = [int(s) for s in args.seeds.split(",") if s]
    args.sides = [s for s in args.sides.split(",") if s]
    for name in ("steps", "prompts", "n", "response_len", "jobs", "last"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if (args.worker or args.report_only) and not args.work_dir:
        p.error("--worker and --report-only read the plan in --work-dir")
    return args


SHARED_GPU_TOKENS = 16384  # tokens per nonstop micro-batch when several runs share a GPU


def nonstop_overrides(args: argparse.Namespace, model_dir: Path, val_file: Path, task: Task) -> list[str]:
    """The nonstop keys of every run (seed, prompt file and run directory are added per run)."""
    reward = (
        [f"custom_reward_function.path={task.reward_path}", f"custom_reward_function.name={task.reward_name}"]
        if task.reward_path
        else []
    )
    # Runs sharing a GPU (`--jobs` > 1) get a fixed token budget per micro-batch: the one nonstop sizes from free
    # memory when none is set would take what the other runs need.
    shared = (
        []
        if args.jobs == 1
        else [
            "actor_rollout_ref.actor.use_dynamic_bsz=True",
            f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={SHARED_GPU_TOKENS}",
        ]
    )
    return [
        "algorithm.adv_estimator=grpo",
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        f"data.val_files={val_file}",
        f"data.train_batch_size={args.prompts}",
        f"data.max_prompt_length={task.max_prompt_length}",
        f"data.max_response_length={args.response_len}",
        "data.shuffle=False",
        f"actor_rollout_ref.rollout.n={args.n}",
        "actor_rollout_ref.rollout.temperature=1.0",
        # Other runs' memory counts as used when the engine sizes its KV cache, which stays within what
        # max_num_seqs sequences need: a high share lets several runs share one GPU.
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.9",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
        f"actor_rollout_ref.actor.loss_agg_mode={args.loss_agg_mode}",
        "actor_rollout_ref.actor.use_kl_loss=False",
        f"actor_rollout_ref.actor.optim.lr={args.lr}",
        "actor_rollout_ref.actor.optim.weight_decay=0.0",
        f"actor_rollout_ref.actor.optim.lr_warmup_steps={args.warmup_steps}",
        f"actor_rollout_ref.actor.optim.lr_scheduler_type={args.scheduler}",
        f"trainer.total_training_steps={args.steps}",
        f"trainer.test_freq={args.test_freq}",
        "trainer.val_before_train=True",
        "trainer.save_freq=-1",
        "trainer.resume_mode=disable",
        *reward,
        *shared,
        *args.override,
    ]


def prepare(args: argparse.Namespace, work: Path, task: Task) -> Plan:
    """Model directory, each seed's prompt file, the held-out file and the plan, checked for identity."""
    model_dir = prepare_model(args.model, work / "model")
    num_rows = args.steps * args.prompts
    train_files = {
        str(seed): str(write_rows(work / "data" / f"train-seed{seed}.jsonl", train_order(task.train, num_rows, seed)))
        for seed in args.seeds
    }
    val_file = write_rows(work / "data" / "val.jsonl", task.val)
    plan = Plan(
        task=task.name,
        model_dir=str(model_dir),
        seeds=args.seeds,
        sides=args.sides,
        overrides=nonstop_overrides(args, model_dir, val_file, task),
        train_files=train_files,
        samples_per_step=args.prompts * args.n,
        jobs=args.jobs,
        trl_micro_batch=args.trl_micro_batch,
        alone_steps=args.alone_steps,
        identity=identity(model_dir, [*task.train, *task.val]),
    )
    plan.write(work)
    return plan


def settings_pairs(plan: Plan, work: Path) -> list[dict[str, Any]]:
    """nonstop's resolved config and the `trl.GRPOConfig` built from it, read back side by side."""
    import trl

    from nonstop.bench.trl_parity.settings import grpo_kwargs, matched_pairs
    from nonstop.trainer import resolve_device

    config = plan.config(plan.seeds[0], work / "runs" / "settings")
    cuda = resolve_device(config.trainer.device).type == "cuda"
    kwargs = grpo_kwargs(config, str(work / "runs" / "settings"), cuda, plan.trl_micro_batch)
    return matched_pairs(config, trl.GRPOConfig(**kwargs))


def worker_command(work: Path, side: str, seed: int, alone: bool) -> list[str]:
    command = [sys.executable, "-m", "nonstop", "bench", "trl-parity", "--work-dir", str(work)]
    return [*command, "--worker", side, str(seed), *(["--alone"] if alone else [])]


def stop(proc: subprocess.Popen, sig: int) -> None:
    """`sig` to a run's process group (the run and what it started, e.g. reward workers), unless it has ended."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)


def launch(
    runs: list[tuple[str, int, bool]],
    work: Path,
    jobs: int,
    deadline: float | None,
    command: Callable[[Path, str, int, bool], list[str]] = worker_command,
) -> dict[str, Any]:
    """Each run as its own process group (`worker_command`), `jobs` at a time, its output in `work/logs/<run>.log`;
    at `deadline` the groups still running are stopped (SIGTERM, SIGKILL after `STOP_GRACE_S`) and the runs not
    started stay so. Returns each run's exit status and seconds."""
    (work / "logs").mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # each log shows how far its run got
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // jobs)))  # the host's cores, shared
    pending, running, status = list(runs), {}, {}
    stopping_since = None
    while pending or running:
        while pending and len(running) < jobs and stopping_since is None:
            side, seed, alone = pending.pop(0)
            name = run_name(side, seed, alone)
            log = (work / "logs" / f"{name}.log").open("w")
            proc = subprocess.Popen(
                command(work, side, seed, alone), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
            running[name] = (proc, log, time.time())
            print(f"started {name}", flush=True)
        if deadline is not None and time.time() >= deadline and stopping_since is None:
            stopping_since = time.time()
            status |= {run_name(*r): {"rc": None, "note": "not started: out of budget"} for r in pending}
            pending = []
            for proc, _, _ in running.values():
                stop(proc, signal.SIGTERM)
        if stopping_since is not None and time.time() - stopping_since > STOP_GRACE_S:
            for proc, _, _ in running.values():
                stop(proc, signal.SIGKILL)
        for name, (proc, log, started) in list(running.items()):
            if proc.poll() is not None:
                log.close()
                status[name] = {"rc": proc.returncode, "wall_s": time.time() - started}
                if stopping_since is not None:
                    status[name]["note"] = "stopped at the deadline"
                print(f"finished {name}: rc {proc.returncode}, {status[name]['wall_s']:.0f} s", flush=True)
                del running[name]
        time.sleep(0.5)
    return status


def report(plan: Plan, args: argparse.Namespace, work: Path, out: Path, extra: dict[str, Any]) -> int:
    """Bands, checks, plot and table from the runs' metrics; copies each run's metrics and log into `out`. Exit
    status 1 when a check fails."""
    curves = load_curves(work, plan, plan.samples_per_step)
    timing = load_curves(work, plan, plan.samples_per_step, alone=True) if plan.alone_steps else {}
    result = compare(curves, timing, args.last)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    for run_dir in sorted((work / "runs").glob("*-*")):
        for name in ("metrics.jsonl", "run.json"):
            if (run_dir / name).is_file():
                shutil.copyfile(run_dir / name, out / "runs" / f"{run_dir.name}.{name}")
    if (work / "logs").is_dir():
        shutil.copytree(work / "logs", out / "logs", dirs_exist_ok=True)
    config = plan.config(plan.seeds[0], work / "runs" / "settings")
    title = (
        f"{plan.task}: {config.data.train_batch_size} prompts x {config.actor_rollout_ref.rollout.n} samples, "
        f"{len(plan.seeds)} seeds"
    )
    clock = f"{plan.jobs} runs at once" if plan.jobs > 1 else "one run at a time"
    plot(result, out / "trl_parity.png", title, clock)
    write(result, {"settings": vars(args), "plan": asdict(plan), "clock": clock, **extra}, out)
    print(
        f"\n{title}, {config.trainer.total_training_steps} steps, responses <= {config.data.max_response_length} "
        f"tokens, lr {config.actor_rollout_ref.actor.optim.lr}; training seconds: {clock}"
    )
    print(table(result, args.last, every=max(1, len(result["bands"].get("nonstop", [])) // 25)))
    print(f"wrote {out}")
    checks = [result[k]["passed"] for k in ("check_last_steps", "check_overlap") if k in result]
    return 0 if all(checks) else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        from nonstop.bench.trl_parity.sides import run_one

        run_one(Path(args.work_dir), args.worker[0], int(args.worker[1]), args.alone)
        return 0
    started = time.time()
    deadline = started + args.budget_s if args.budget_s else None
    stamp = datetime.datetime.now(datetime.UTC)
    out = Path(args.out or Path("bench", "results", f"trl-parity-{stamp:%Y%m%dT%H%M%SZ}"))
    out.mkdir(parents=True, exist_ok=True)
    extra: dict[str, Any] = {
        "environment": environment(),
        "command": "nonstop bench trl-parity " + " ".join(argv or []),
    }
    if "trl" in args.sides:
        import datasets
        import trl

        extra["environment"] |= {"trl": trl.__version__, "datasets": datasets.__version__}
    with work_dir(args.work_dir, "trl-parity") as work:
        if args.report_only:
            return report(Plan.read(work), args, work, out, extra)
        plan = prepare(args, work, load_task(args.task, args.gsm8k_dir, args.val_size, args.reward))
        print("identity:", plan.identity, flush=True)
        if "trl" in plan.sides:
            extra["matched_settings"] = pairs = settings_pairs(plan, work)
            print(pairs_table(pairs), flush=True)
            if not all(p["equal"] for p in pairs):
                raise RuntimeError("a matched setting differs between the two sides (table above)")
        runs = [(side, seed, False) for seed in plan.seeds for side in plan.sides]
        extra["runs"] = launch(runs, work, args.jobs, deadline)
        if plan.alone_steps:
            extra["runs"] |= launch([(side, plan.seeds[0], True) for side in plan.sides], work, 1, deadline)
        extra["wall_s"] = time.time() - started
        return report(plan, args, work, out, extra)
