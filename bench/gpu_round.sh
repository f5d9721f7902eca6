#!/usr/bin/env bash
# One device run (GPU + 16 cores) of the held-out checks that need many seeds, beside a breadth
# sweep over torchvision / timm.  Everything runs at once under one deadline, then is packed into
# OUT/gpu_round.tgz (the device returns few files).  Usage:  bash bench/gpu_round.sh OUT [SECONDS]
#   - equal output scale (issue 20): the MLP family under SGD, precondfx against plain inits
#     brought to output std 1, 12 seeds;
#   - the best AdamW rate over MLP widths and depths: PyTorch default, precondfx, muP, u-muP,
#     12 seeds (muP / u-muP from PYTHONPATH, e.g. a carried folder);
#   - bench/zoo_sweep.py over torchvision and timm.
set -u
OUT=${1:?output folder}
T=${2:-400}
DEV=${DEV:-cuda}
SEEDS=${SEEDS:-12}
W=/tmp/gpu_round
rm -rf "$W" && mkdir -p "$W"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
(nvidia-smi -L; python -c "import torch, sys; print(sys.version, torch.__version__)") > "$W/env.txt" 2>&1
WIDTHS=mlp_w32_d2,mlp_w128_d2,mlp_w512_d2,mlp_w2048_d2
DEPTHS=mlp_w128_d1,mlp_w128_d4,mlp_w128_d8,mlp_w128_d16
run() {  # tag tasks optimizer methods
  timeout "$T" python bench/train_suite.py --cpu-lr --tasks "$2" --optimizers "$3" \
    --methods "$4" --seeds "$SEEDS" --device "$DEV" --out "$W" --tag "$1" > "$W/$1.log" 2>&1
}
EQ=pfx,default_eq,fan_in_eq,fan_out_eq,xavier_eq
TR=default,pfx,mup,umup
run eq_w "$WIDTHS" sgd "$EQ" &
run eq_d "$DEPTHS" sgd "$EQ" &
run tr_w "$WIDTHS" adamw "$TR" &
run tr_d "$DEPTHS" adamw "$TR" &
timeout "$T" python bench/zoo_sweep.py --out "$W" --workers "${ZOO_WORKERS:-10}" \
  --deadline $((T - 20)) --per-model 90 ${ZOO_ARGS:-} > "$W/zoo.log" 2>&1 &
wait
tar czf "$OUT/gpu_round.tgz" -C "$W" .
ls -la "$W"
for f in "$W"/*.log; do echo "== $f"; tail -n 3 "$f"; done
