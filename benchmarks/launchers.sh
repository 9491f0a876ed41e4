#!/bin/bash
# Wall time of one study through the local launcher (--parallel 2) and the Ray launcher (a Ray
# instance started by the sweep, 1 CPU per member, so 2 at once on 2 cores), and the launcher's
# overhead per member from members of one step. Usage: benchmarks/launchers.sh OUTDIR [REPEATS]
set -euo pipefail
out=${1:?usage: benchmarks/launchers.sh OUTDIR [REPEATS]}
repeats=${2:-1}
study=(configs/ablations/norm_placement.yaml "sweep.grid.model.n_layers=[2]" "sweep.grid.optim.warmup_steps=[0]")
timed() {  # label, then the train.py arguments; prints "label seconds"
  local label=$1; shift
  local start; start=$(date +%s.%N)
  python train.py "$@" > "$out/$label.log" 2>&1
  echo "$label $(echo "$(date +%s.%N) - $start" | bc)"
}
mkdir -p "$out"
python train.py "${study[@]}" "sweep.grid.model.norm_position=[pre]" "sweep.grid.optim.lr=[0.001]" train.steps=1 \
  --workdir "$out/warmup" > "$out/warmup.log" 2>&1  # the data cache, built once
for r in $(seq "$repeats"); do
  timed "local-60steps-$r" "${study[@]}" train.steps=60 --workdir "$out/local-$r" --parallel 2
  timed "ray-60steps-$r" "${study[@]}" train.steps=60 --workdir "$out/ray-$r" --launcher ray
  timed "local-1step-$r" "${study[@]}" train.steps=1 --workdir "$out/local1-$r" --parallel 2
  timed "ray-1step-$r" "${study[@]}" train.steps=1 --workdir "$out/ray1-$r" --launcher ray
done
