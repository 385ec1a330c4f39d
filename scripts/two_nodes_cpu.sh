#!/usr/bin/env bash
# Two "nodes" on one machine: two `torchrun --nnodes=2` invocations rendezvous on 127.0.0.1 (one CPU rank each, gloo)
# and train the embedded run (SmolLM2-135M on nonstop/arith) for 2 steps. The multi-node code path without a cluster.
#   PYTHON=.venv/bin/python scripts/two_nodes_cpu.sh [key=value ...]
set -euo pipefail
PYTHON=${PYTHON:-python}
RUN_DIR=${RUN_DIR:-/tmp/nonstop-two-nodes}
PORT=${PORT:-29517}
ARGS=(trainer.device=cpu trainer.nnodes=2 trainer.n_gpus_per_node=1 trainer.total_training_steps=2
  data.train_batch_size=4 actor_rollout_ref.actor.ppo_mini_batch_size=4 trainer.val_before_train=False
  trainer.test_freq=-1 trainer.save_freq=2 trainer.resume_mode=disable "trainer.default_local_dir=$RUN_DIR" "$@")
pids=()
for NODE in 0 1; do
  "$PYTHON" -m torch.distributed.run --nnodes=2 --nproc-per-node=1 --node-rank=$NODE \
    --master-addr=127.0.0.1 --master-port="$PORT" -m nonstop train "${ARGS[@]}" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
