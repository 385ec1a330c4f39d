#!/usr/bin/env bash
# The open issues' H200 measurements as named steps, run in the order given, each under its own limit; logs and JSON
# into $OUT, and every log also packed into $OUT/logs.tgz (a device call returns at most 8 files).
#   STEPS="tests rollout lora" [BASE_SRC=.base/src] bash scripts/gpu/measure_all.sh
# Steps:
#   tests    every GPU test file, in groups run at once (tiny models: the GPU has room; 16 host cores), -v so a timeout
#            still shows how far each got
#   rollout  engine vs transformers.generate (issue 3); with BASE_SRC also the same bench on another commit's src/
#            (`git archive <rev> src | tar -x -C .base`), for an A/B in one session
#   engine_ab  a branch's engine (the tree) against BASE_SRC: its decode-kernel, engine and cascade GPU tests, then
#            `bench rollout` k = 1 and 8 on both (transformers only on the tree's side); a test failure is reported
#            and the A/B still runs on both trees
#   rollout_tests  `pytest -m gpu tests/rollout` alone (engine, cascade, whole-launch graphs, KV sizing and cap)
#   retest   GPU tests not yet run alone (engine, async, cascade engine, critic prefix grouping, critic, resume)
#   carry_0.5b, carry_1.5b  plain sync against sync + carry-over (`rollout.tail.enable`) on long-tailed responses
#   carry_busy_0.5b, carry_busy_1.5b  the same through `bench modes`: sync, sync + carry-over, one_step_off +
#            carry-over, each with one profiled step after the timed ones (kernel-busy fraction); CARRY_MODES
#            (`bench modes --modes`, $tail the carry-over's keys) picks others
#   carry_parity  GSM8K learning curves of sync and sync + carry-over with SmolLM2 (MODEL, default /root/smollm2.gguf;
#            GSM8K's release files carried as .data/gsm8k), by samples trained, with the mean response length
#   trainer_ab  the trainer bench's nonstop side on BASE_SRC and on the tree, base / tree / base / tree
#   trainer  GRPO step vs TRL 1.16 (issue 4), plus nonstop with k = 1 and with the KV cache resident in the same run
#   trainer_profile  nonstop's side alone (resident KV, k = 8), step 5 under the torch profiler: the profile summary
#            (per-phase kernel-busy, gaps, top kernels) and the doctor's report, to see what a decode step at 64
#            sequences spends
#   gaps     the trainer bench's step 5 under torch.profiler with Python stacks: the host functions across its
#            longest device-idle gaps (scripts/gpu/step_gaps.py)
#   prefix_step  issue 8's whole GRPO step at 4K prompts x 8: ungrouped / grouped / grouped + cascade decode
#   logprob  fused log-prob/entropy kernels
#   modes    sync / one_step_off / async on one GPU (issue 7); modes_a / modes_b: sync beside one of them, with and
#            without the rollouter's stream at high CUDA priority, a call each
#   lora     LoRA vs full fine-tuning (issue 9)
#   prefix   prefix-grouping sweep, both shapes, 2K/4K/8K prompts, n 4/8/16 (issue 8)
#   prefix_resp  the same at 4K prompts, n = 8, with 256- and 1024-token responses (Qwen2.5-1.5B)
#   block_mask  the prefix-grouped block mask built from the host layout: its GPU tests (tensor for tensor = the
#            compiled create_block_mask, built without a sync, FlexAttention forward + backward, grouped = ungrouped
#            actor and critic), then `bench block-mask` (host ms per micro-batch at 16k and 32k tokens)
source "$(dirname "$0")/common.sh"
for step in ${STEPS:-tests rollout}; do case $step in
  tests)
    gpu_test t_profiling 60 tests/profiling/test_gpu.py &
    gpu_test t_rollout 300 tests/rollout &
    gpu_test t_verify 300 tests/kernels/test_paged_verify.py &
    gpu_test t_decode 300 tests/kernels/test_paged_decode.py tests/kernels/test_cascade_decode.py \
      tests/kernels/test_advance_decode.py tests/kernels/test_fused_forward.py tests/kernels/test_logprob_entropy.py &
    gpu_test t_elementwise 300 tests/kernels/test_rms_norm.py tests/kernels/test_rotary.py \
      tests/kernels/test_rotary_cache.py tests/kernels/test_rotary_decode.py tests/kernels/test_silu_mul.py \
      tests/kernels/test_reshape_and_cache.py &
    gpu_test t_models 300 tests/kernels/test_sampling_triton.py tests/models &
    gpu_test t_trainer 300 tests/trainer/test_trainer_gpu.py tests/trainer/test_actor.py \
      tests/trainer/test_critic_prefix_grouping.py tests/trainer/test_actor_oom.py tests/trainer/test_carry_gpu.py \
      tests/batching &
    gpu_test t_lora 240 tests/trainer/test_lora_trainer_gpu.py &
    gpu_test t_async 240 tests/trainer/test_async_trainer_gpu.py &
    gpu_test t_reward 120 tests/rewards/test_reward_model.py &
    wait ;;
  retest)  # the GPU tests still to run alone: two chains at once, the KV-sizing ones (fractions of GPU memory) apart
    ( gpu_test t_engine 60 tests/rollout/test_engine_gpu.py
      gpu_test t_async 110 tests/trainer/test_async_trainer_gpu.py -k overrides1 ) &
    ( gpu_test t_cascade 60 tests/rollout/test_cascade_engine.py
      gpu_test t_criticpg 40 tests/trainer/test_critic_prefix_grouping.py
      gpu_test t_critic 100 tests/trainer/test_trainer_gpu.py -k "critic or resume" ) &
    wait ;;
  rollout)
    if [ -n "${BASE_SRC:-}" ]; then
      t b_rollout_base 120 env PYTHONPATH=/tmp/site:$PWD/$BASE_SRC python3 -m nonstop bench rollout \
        --shapes qwen2.5-0.5b --workloads fixed --out "$OUT/rollout-base.json"
    fi
    t b_rollout 120 python3 -m nonstop bench rollout --shapes qwen2.5-0.5b --workloads fixed --num-scheduler-steps 1,8 \
      --out "$OUT/rollout.json" ;;
  rollout_tests) gpu_test t_rollout 150 tests/rollout ;;
  trainer_profile)
    t b_trainer_profile 150 python3 -m nonstop bench trainer --sides nonstop --work-dir /tmp/btp --override \
      actor_rollout_ref.rollout.free_cache_engine=False "global_profiler.steps=[5]" global_profiler.tool=torch --out "$OUT/trainer-profile.json"
    cp /tmp/btp/nonstop_run/profile/summary.json "$OUT/trainer-profile-summary.json"
    t b_doctor 60 python3 -m nonstop doctor /tmp/btp/nonstop_run ;;
  engine_ab)
    if ! gpu_test t_engine 200 tests/kernels/test_sampling_triton.py tests/kernels/test_advance_decode.py \
        tests/kernels/test_rotary_cache.py tests/rollout/test_engine_gpu.py tests/rollout/test_cascade_engine.py; then
      echo "WARNING: engine tests failed; the A/B below still measures the tree (see t_engine.log)"
    fi
    t b_rollout_base 120 env PYTHONPATH=/tmp/site:$PWD/$BASE_SRC python3 -m nonstop bench rollout \
      --shapes qwen2.5-0.5b --workloads fixed --num-scheduler-steps 1,8 --transformers '' --out "$OUT/rollout-base.json"
    t b_rollout 150 python3 -m nonstop bench rollout --shapes qwen2.5-0.5b --workloads fixed --num-scheduler-steps 1,8 \
      --out "$OUT/rollout.json" ;;
  trainer_ab)  # nonstop's side of the trainer bench on BASE_SRC and on the tree, alternated twice in one call
    for round in 1 2; do
      t b_trainer_base$round 150 env PYTHONPATH=/tmp/site:$PWD/$BASE_SRC python3 -m nonstop bench trainer \
        --sides nonstop --steps 10 --out "$OUT/trainer-base$round.json"
      t b_trainer_tree$round 150 python3 -m nonstop bench trainer --sides nonstop --steps 10 \
        --out "$OUT/trainer-tree$round.json"
    done ;;
  carry_0.5b|carry_1.5b)  # issue 24: plain sync against sync + carry-over on long-tailed responses, trained tokens/s
    shape=qwen2.5-${step#carry_}; steps=6; [ "$shape" = qwen2.5-1.5b ] && steps=4
    t "b_$step" 240 python3 -m nonstop bench trainer --shape "$shape" --sides nonstop --prompts 32 --n 8 \
      --prompt-len 128 --response-lengths longtail --response-len 1024 --warmup 2 --steps "$steps" \
      --override actor_rollout_ref.actor.use_dynamic_bsz=True actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384 \
      actor_rollout_ref.actor.use_prefix_grouper=False \
      --variant carry actor_rollout_ref.rollout.tail.enable=True algorithm.rollout_correction.rollout_is=token \
      --out "$OUT/$step.json" ;;
  carry_busy_0.5b|carry_busy_1.5b)  # issue 24: throughput and kernel-busy of sync, sync + carry, one_step_off + carry
    shape=qwen2.5-${step#carry_busy_}; steps=6; [ "$shape" = qwen2.5-1.5b ] && steps=4
    tail=actor_rollout_ref.rollout.tail.enable=True+algorithm.rollout_correction.rollout_is=token
    t "b_$step" 400 python3 -m nonstop bench modes --model "$shape" --prompts 32 --n 8 --prompt-len 128 \
      --response-len 1024 --warmup 2 --steps "$steps" --modes "${CARRY_MODES:-sync,sync+$tail,one_step_off+$tail}" \
      --out "$OUT/$step.json" actor_rollout_ref.actor.use_prefix_grouper=False ;;
  carry_parity)  # issue 24: learning parity of the carry-over on GSM8K (SmolLM2-135M-Instruct), 32 prompts x 8 a step
    python3 -m nonstop data gsm8k --source .data/gsm8k --out /tmp/gsm8k > "$OUT/data.log" 2>&1
    t b_carry_parity 420 python3 -m nonstop bench parity actor_rollout_ref.model.path="${MODEL:-/root/smollm2.gguf}" \
      data.train_files=/tmp/gsm8k/train.parquet data.val_files=/tmp/gsm8k/test.parquet data.train_batch_size=32 \
      actor_rollout_ref.actor.ppo_mini_batch_size=32 actor_rollout_ref.actor.optim.lr=1e-5 trainer.val_before_train=False \
      trainer.test_freq=-1 trainer.save_freq=-1 --config examples/gsm8k_smollm2.yaml --steps "${PARITY_STEPS:-40}" \
      --last 10 --out "$OUT/carry_parity" --modes sync,carry=sync --mode-override carry \
      actor_rollout_ref.rollout.tail.enable=True algorithm.rollout_correction.rollout_is=token ;;
  trainer) runs=$((${runs:-0} + 1))  # STEPS="trainer trainer": each run its own log and JSON
    t b_trainer$runs 240 python3 -m nonstop bench trainer \
    --variant k1 actor_rollout_ref.rollout.num_scheduler_steps=1 \
    --variant resident actor_rollout_ref.rollout.free_cache_engine=False \
    --out "$OUT/trainer$runs.json" ;;
  prefix_step)  # issue 8's whole step: ungrouped, grouped, grouped + cascade decode, in one run
    t b_prefix_step 240 python3 -m nonstop bench trainer --sides nonstop --shape qwen2.5-1.5b --prompts 4 --n 8 \
      --prompt-len 4096 --response-len 512 --warmup 1 --steps 3 --override actor_rollout_ref.actor.use_dynamic_bsz=True \
      actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384 actor_rollout_ref.actor.use_prefix_grouper=False \
      --variant grouped actor_rollout_ref.actor.use_prefix_grouper=True \
      --variant grouped_cascade actor_rollout_ref.actor.use_prefix_grouper=True actor_rollout_ref.rollout.cascade_attention=True \
      --out "$OUT/prefix-step.json" ;;
  gaps) t b_gaps 200 python3 scripts/gpu/step_gaps.py --out /tmp/gaps --override actor_rollout_ref.rollout.free_cache_engine=False
    # the trace too when it fits what a call brings back (16 MiB a file), for reading it here without device time
    [ "$(stat -c %s /tmp/gaps/trace.json.gz 2>/dev/null || echo 999999999)" -lt 16000000 ] && cp /tmp/gaps/trace.json.gz "$OUT/gaps-trace.json.gz" ;;
  logprob) t b_logprob 40 python3 -m nonstop bench logprob --out "$OUT/logprob.json" ;;
  modes|modes_a|modes_b)  # modes_a / modes_b: sync beside one of the overlap modes, each in its own call's limits (a
    # cold inductor cache spends minutes on FlexAttention compiles in the first mode's second step)
    hi=async_training.rollout_stream_priority=high  # the decode stream ahead of the update's: an A/B in the same run
    case $step in modes) m=sync,one_step_off,async ;; modes_a) m=sync,one_step_off,one_step_off+$hi ;;
      modes_b) m=sync,async,async+$hi ;; esac
    t b_$step 400 python3 -m nonstop bench modes --model qwen2.5-0.5b --prompts 32 --n 8 --steps 8 --warmup 2 \
      --modes $m --out "$OUT/$step.json" ;;
  lora) t b_lora 150 python3 -m nonstop bench lora --out "$OUT/lora.json" ;;
  prefix) t b_prefix 420 python3 -m nonstop bench prefix --models qwen2.5-1.5b,qwen3-1.7b --prompt-lens 2048,4096,8192 \
    --response-lens 512 --n 4,8,16 --out "$OUT/prefix.json" ;;
  prefix_resp) t b_prefix_resp 150 python3 -m nonstop bench prefix --models qwen2.5-1.5b --prompt-lens 4096 \
    --response-lens 256,1024 --n 8 --out "$OUT/prefix-resp.json" ;;
  block_mask)
    gpu_test t_block_mask 240 tests/models/test_prefix_attention.py tests/batching/test_prefix_grouping.py \
      tests/trainer/test_critic_prefix_grouping.py
    t b_block_mask 120 python3 -m nonstop bench block-mask --out "$OUT/block-mask.json" ;;
  *) echo "unknown step $step" ;;
esac; done
pack_logs
