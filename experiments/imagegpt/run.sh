#!/usr/bin/env bash
# ImageGPT on the embedded 8 x 8 digits and on the shifted digits (12 x 12), CPU-sized:
#   bash experiments/imagegpt/run.sh [RUNS_DIR]
# The commands measured for docs/families.md (about 35 + 45 minutes on a shared 2-core CPU). The digits run
# goes to 2,000 steps to show where it overfits (the igpt-tiny preset now stops at 1,000); its probe and
# completions read the checkpoint at 1,000, the lowest eval loss.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD
RUNS=${1:-runs}
HERE=experiments/imagegpt

python -m transformer.train --config configs/gpt.py:igpt-tiny,train.steps=2000,train.eval_every=500 \
    --workdir "$RUNS/igpt-tiny"
python -m transformer.generate --workdir "$RUNS/igpt-tiny" --step 1000 --images eval --num_images 10 \
    --num_samples 4 --seed 0 --temperature 1.0 --out "$HERE/completions.png"
python -m transformer.probe linear --workdir "$RUNS/igpt-tiny" --step 1000 --out "$RUNS/igpt-tiny/probes/linear"
cp "$RUNS/igpt-tiny/probes/linear/linear.png" "$HERE/probe.png"
cp "$RUNS/igpt-tiny/probes/linear/linear.json" "$HERE/probe.json"
python "$HERE/summarize.py" "$RUNS/igpt-tiny" "$HERE/probe.json" > "$HERE/table.md"

python "$HERE/shifted_digits.py" "$RUNS/shifted_digits.npz"
python -m transformer.train --workdir "$RUNS/igpt-shifted" --config configs/gpt.py:igpt-tiny,train.steps=1000,train.eval_every=500,train.checkpoint_every=500,data.source="$RUNS/shifted_digits.npz",data.image_side=12,data.seq_len=144,model.max_len=144
python -m transformer.probe linear --workdir "$RUNS/igpt-shifted" --step 500 --out "$RUNS/igpt-shifted/probes/linear"
cp "$RUNS/igpt-shifted/probes/linear/linear.png" "$HERE/probe_shifted.png"
cp "$RUNS/igpt-shifted/probes/linear/linear.json" "$HERE/probe_shifted.json"
python "$HERE/summarize.py" "$RUNS/igpt-shifted" "$HERE/probe_shifted.json" > "$HERE/table_shifted.md"
python -m transformer.generate --workdir "$RUNS/igpt-shifted" --step 500 --images eval --num_images 10 --num_samples 4 \
    --seed 0 --temperature 1.0 --out "$HERE/completions_shifted.png"
