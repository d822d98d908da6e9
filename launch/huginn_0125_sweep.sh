#!/usr/bin/env bash
# Exit study on Huginn-0125 (3.56B parameters, prelude/core/coda 2/4/2, trained at mean depth
# 32; issue 14): import, then every measurement on 1,000 FineWeb-Edu documents with Huginn's
# own tokenizer, A0 at depths 1..32, A1 (KL) at eps 1e-6..1e-1 and A2 (router, fitted on
# other FineWeb-Edu documents, $FIT, so that every scored batch is held out).
#   SRC=/data/huginn-0125 bash launch/huginn_0125_sweep.sh   # a local HF snapshot folder
#   SRC=tomg-group-umd/huginn-0125 bash launch/huginn_0125_sweep.sh   # needs the network
# Other settings by environment: WD, FW (scored text), FIT, BATCHES (128), DEPTH (32),
# BATCH (8), SEQ (1024); tests/huginn_test.py runs it on the tiny fixture with small ones.
# Cannot run on the development machines (no network, no GPU); its code path is tested on
# the tiny fixture end to end (tests/huginn_test.py). Estimates (2026-12-03):
# Memory: import host peak ~15 GB (measured 0.90-1.00x the fp32 parameter bytes above the
#   process's base on a 138M bf16 source, python -m experiments.bench_import, Zen 4,
#   2026-12-07; 1.31x on 2026-12-03; Huginn-0125: 14.3 GB fp32), so a 32 GB machine is
#   enough; checkpoint <= 14.3 GB on disk. Device, from the compiled memory
#   analysis (python -m experiments.import_huginn --src=SNAPSHOT --dry_run; XLA:CPU here,
#   batch 8 x 1024, depth 32; rerun 2026-12-07): traced pass 14.26 GB parameters + 11.11 GB
#   temporaries = 25.4 GB, KL-exit pass 14.26 + 11.26 = 25.5 GB (2026-12-03: 9.49 and 10.70
#   GB of temporaries). H200 (141 GB): fits. TPU v5e (16 GB per chip):
#   does NOT fit on one chip and the experiments do not shard parameters, so v5e-8 needs
#   tensor-parallel sharding first (not implemented).
# FLOPs: one traced pass to depth 32 (coda + head read out at every loop) is 1.81e11 per
#   token; 128 batches x 8 x 1024 = 1.05M tokens (~all 1,000 documents) -> 1.9e17 per
#   pass. eval_depth, convergence and train_router: 1 pass each; sweep_eps: 1 + 6 eps + 10
#   router thresholds, early exit ~60% of a pass each -> ~11 passes in all, ~2.1e18 FLOPs.
# Expected time: the analysis runs fp32 matmuls at precision 'highest' (no TF32/bf16):
#   one H200 (67 TFLOP/s fp32 peak, ~50% of it) ~18 h; TPU v5e-8 once sharded (fp32 as
#   bf16x6 passes, ~260 TFLOP/s peak for 8 chips, ~40%) ~6 h. Halve --batches to halve it.
# Expected result: unknown (that is the study); reports in $WD/reports/*.md.
set -euo pipefail
cd "$(dirname "$0")/.."
SRC="${SRC:-tomg-group-umd/huginn-0125}"
WD="${WD:-runs/huginn_0125}"
FW="${FW:-../shared/data/fineweb_edu/fineweb-edu.sample-350BT.part0.jsonl,../shared/data/fineweb_edu/fineweb-edu.sample-350BT.part1.jsonl}"
FIT="${FIT:-../shared/data/fineweb_edu/fineweb-edu.sample-350BT.part2.jsonl}"
DATA=(--data_source=text --data_paths="$FW" --data_val_paths="$FW" --data_set=max_docs=1000)
FIT_DATA=(--data_source=text --data_paths="$FIT" --data_val_paths="$FW" --data_set=max_docs=1000)
EVAL=(--max_depth="${DEPTH:-32}" --batches="${BATCHES:-128}" --batch_size="${BATCH:-8}"
      --seq_len="${SEQ:-1024}" --quiet)
[ -e "$WD/config.json" ] || python -m experiments.import_huginn --src="$SRC" --workdir="$WD"
python -m experiments.eval_depth --workdir="$WD" "${DATA[@]}" "${EVAL[@]}"
python -m experiments.convergence --workdir="$WD" "${DATA[@]}" "${EVAL[@]}"
python -m experiments.train_router --workdir="$WD" "${FIT_DATA[@]}" --fit_split=train \
    "${EVAL[@]}"
python -m experiments.sweep_eps --workdir="$WD" "${DATA[@]}" "${EVAL[@]}" --router \
    --eps_grid=1e-6,1e-5,1e-4,1e-3,1e-2,1e-1
