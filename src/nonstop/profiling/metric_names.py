"""The per-step metrics `nonstop doctor` reads from `metrics.jsonl` besides `timing_s/*`, with their definitions.

Each is summed (counts, seconds) or time-weighted (fractions) over every `generate` / update call of one training
step. The weight-sync probe is left out when it runs as a generate call of its own; when its two short requests ride
along in the rollout's call (`max_num_seqs` has room) they are that call's engine work and counted with it. The
doctor treats a missing metric as missing evidence ("no data"), never as 0.
"""

from __future__ import annotations

# Rollout engine (from the scheduler over the step's generation; SchedulerStats deltas where one exists).
ROLLOUT_NUM_PREEMPTIONS = "rollout/num_preemptions"  # sequences preempted by recomputation (KV blocks ran out)
# Fraction of engine model-step wall time (prefill + decode) in steps where the scheduler preempted a sequence or
# left a waiting request unadmitted because free KV blocks were short (not max_num_seqs, not the token budget).
ROLLOUT_KV_BLOCKED_FRAC = "rollout/kv_blocked_frac"
# Fraction of engine model-step wall time in steps whose running sequences (a group's n samples counted n times)
# were fewer than 1/4 of the peak number running at any point of the same generate call: the long tail.
ROLLOUT_TAIL_FRAC = "rollout/tail_frac"
# Over those tail steps, time-weighted mean of running / peak (in [0, 0.25)); optional, the doctor assumes 0.125.
ROLLOUT_TAIL_BATCH_FILL = "rollout/tail_batch_fill"
ROLLOUT_PROMPT_TOKENS = "rollout/prompt_tokens"  # prompt tokens of the requests (each prompt once, whatever n)
ROLLOUT_PREFILL_TOKENS = "rollout/prefill_tokens"  # prompt-position tokens computed, recomputation included
ROLLOUT_GENERATED_TOKENS = "rollout/generated_tokens"  # tokens sampled
# Most sequences any engine step of the call computed (a group's n samples counted n times): against max_num_seqs,
# whether the cap bounded the decode batch.
ROLLOUT_PEAK_RUNNING_SEQS = "rollout/peak_running_seqs"

# Fraction of engine model-step wall time in decode steps of at most `speculative.disable_by_batch_size` (its default)
# sequences: weight-read bound steps, what speculative decoding shortens.
ROLLOUT_SMALL_BATCH_FRAC = "rollout/small_batch_frac"
# Speculative decoding, when it is on: accepted / drafted tokens; tokens per sequence per verify round; verify and plain
# decode steps in the drafting range, and their wall seconds; the fraction of verify launches chained behind the one
# before (their host work hidden behind it).
SPEC_ACCEPTANCE_RATE = "rollout/spec/acceptance_rate"
SPEC_TOKENS_PER_VERIFY = "rollout/spec/tokens_per_verify"
SPEC_NUM_VERIFY_STEPS = "rollout/spec/num_verify_steps"
SPEC_NUM_PLAIN_STEPS = "rollout/spec/num_plain_steps"
SPEC_VERIFY_TIME_S = "rollout/spec/verify_time_s"
SPEC_PLAIN_TIME_S = "rollout/spec/plain_time_s"
SPEC_CHAINED_FRAC = "rollout/spec/chained_frac"

# Training update (the actor; old-log-prob and reference passes reuse its micro-batching).
ACTOR_NUM_MICRO_BATCHES = "actor/num_micro_batches"  # forward+backward micro-batches, all mini-batches and epochs
ACTOR_MICRO_BATCH_TOKENS = "actor/micro_batch_tokens_mean"  # real (non-pad) tokens per micro-batch, mean
ACTOR_TOKEN_BUDGET = "actor/micro_batch_token_budget"  # the update's token budget (sized from memory when unset)
ACTOR_PAD_FRAC = "actor/pad_frac"  # padded positions / computed positions in the update forwards (0 when packed)
ACTOR_PREFIX_GROUPED = "actor/prefix_grouped"  # fraction of update mini-batches run prefix-grouped (prompt once)

# Reward scoring (rewards/pool.py, per step): worker seconds spent scoring, samples scored, first submit to last
# result, and the part of that after the last submit (what generation did not hide).
REWARD_BUSY_S = "reward/busy_s"
REWARD_NUM_SCORED = "reward/num_scored"
REWARD_WALL_S = "reward/wall_s"
REWARD_CRITICAL_PATH_S = "reward/critical_path_s"
REWARD_TIMEOUTS = "reward/timeouts"
# Worker processes of the pool at the end of the step (a pool sized by itself grows for a scorer that waits); absent
# when scoring runs inline or the run predates it: the doctor then reads reward_model.num_workers.
REWARD_NUM_WORKERS = "reward/num_workers"
# Of the samples scored in worker processes: their CPU seconds over their wall seconds; and the share of the wall
# seconds they needed a core, CPU seconds plus seconds ready to run but waiting for a core (Linux schedstat; on a
# busy host a computing scorer waits for cores, which CPU time alone would take for waiting on I/O). Low demand: the
# scorer mostly waits (a sandbox, a remote verifier) and more workers than cores score more samples at once.
REWARD_CPU_FRAC = "reward/cpu_frac"
REWARD_CPU_DEMAND_FRAC = "reward/cpu_demand_frac"

# Already emitted elsewhere and read too: prompt_length/mean, response_length/mean|max (trainer/metrics.py),
# perf/gpu_util/<phase> (profiling/attribution.py), perf/num_gpus (the trainer).
