#!/usr/bin/env bash
# One device run (GPU + 16 cores) of the checks lr='auto' changes (issue 20): precondfx's
# default under SGD now has its first step done at each rate of the grid (the ceiling;
# train_suite.SETTLED), so its SGD cells are re-measured with many seeds beside the baselines:
#   - equal output scale, paired (must-show 4): the MLP family, precondfx against the plain
#     rules started from its own draws and brought to output std 1, 24 seeds, half-octave grid
#     (the sixth round's eq_pair24 protocol);
#   - the held-out small tasks under SGD (must-show 2): framework default and precondfx,
#     12 seeds (the fifth round's gpu12 protocol).
# Each process writes its JSON when it ends; everything is packed into OUT/gpu_ceiling.tgz.
# Usage:  bash bench/gpu_ceiling.sh OUT [SECONDS]      (SEEDS_EQ, SEEDS_H, DEV override)
set -u
OUT=${1:?output folder}
T=${2:-420}
DEV=${DEV:-cuda}
SEEDS_EQ=${SEEDS_EQ:-24}
SEEDS_H=${SEEDS_H:-12}
W=/tmp/gpu_ceiling
rm -rf "$W" && mkdir -p "$W"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
(nvidia-smi -L; python -c "import torch, sys; print(sys.version, torch.__version__)") > "$W/env.txt" 2>&1
EQ=pfx,geometric_pair,fan_in_pair,fan_out_pair,xavier_pair
for net in ${EQ_NETS-mlp_w32_d2 mlp_w128_d2 mlp_w512_d2 mlp_w128_d1 mlp_w128_d4 mlp_w128_d8 mlp_w128_d16}; do
  timeout "$T" python bench/train_suite.py --cpu-lr --tasks "$net" --optimizers sgd --methods "$EQ" \
    --seeds "$SEEDS_EQ" --lr-step 0.5 --n-lr 12 --device "$DEV" --out "$W" --tag "eq_$net" \
    > "$W/eq_$net.log" 2>&1 &
done
heldout() {  # task epochs
  timeout "$T" python bench/train_suite.py --cpu --tasks "$1" --epochs "$2" --optimizers sgd \
    --methods default,pfx --seeds "$SEEDS_H" --device "$DEV" --out "$W" --tag "h_$1" \
    > "$W/h_$1.log" 2>&1 &
}
for th in ${H_TASKS-mlp_w128_d2:3 conv_bn:3 pool_cnn:10 pool_cnn_bn:10}; do heldout "${th%:*}" "${th#*:}"; done
wait
tar czf "$OUT/gpu_ceiling.tgz" -C "$W" .
for f in "$W"/*.log; do echo "== $f"; tail -n 2 "$f"; done
