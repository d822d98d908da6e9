#!/usr/bin/env bash
# The TinyStories reproduction (issue 4): train both models, then every measurement,
# on TinyStories (in-distribution) and on the FineWeb-Edu sample (distribution shift).
#   bash launch/reproduce_tinystories.sh            # ~1.5 h on 2 CPU cores
#   SKIP_TRAIN=1 bash launch/reproduce_tinystories.sh
# Expected: see WORKSPACE.md, "Reproduction on TinyStories".
set -euo pipefail
cd "$(dirname "$0")/.."
FW='../shared/data/fineweb_edu/fineweb-edu.sample-350BT.part0.jsonl'
for m in 8 4; do
  wd="runs/ts${m}"
  flags="launch/tinystories_cpu.flags"; [ "$m" = 4 ] && flags="launch/tinystories_cpu_mean4.flags"
  [ -n "${SKIP_TRAIN:-}" ] || python -m experiments.pretrain --flagfile="$flags" --workdir="$wd" --quiet
  python -m experiments.eval_depth --workdir="$wd" --quiet
  python -m experiments.convergence --workdir="$wd" --quiet
  python -m experiments.train_router --workdir="$wd" --quiet
  python -m experiments.sweep_eps --workdir="$wd" --router --curves=kl,state_delta --quiet
  python -m experiments.eval_depth --workdir="$wd" --data_source=text --data_paths="$FW" \
      --data_val_paths="$FW" --tag=fineweb --quiet
  python -m experiments.convergence --workdir="$wd" --data_source=text --data_paths="$FW" \
      --data_val_paths="$FW" --tag=fineweb --quiet
  python -m experiments.sweep_eps --workdir="$wd" --data_source=text --data_paths="$FW" \
      --data_val_paths="$FW" --tag=fineweb --quiet
done
