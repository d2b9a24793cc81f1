#!/usr/bin/env bash
# ImageGPT on the embedded 8 x 8 digits, CPU-sized (about 30 minutes on a shared 2-core CPU):
#   bash experiments/imagegpt/run.sh [WORKDIR]
# trains igpt-tiny, completes the upper halves of 8 held-out digits, runs the linear probe and writes
# table.md here (summarize.py) with the completions and the probe's figure.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD
RUN=${1:-runs/igpt-tiny}
HERE=experiments/imagegpt
python -m transformer.train --config configs/gpt.py:igpt-tiny --workdir "$RUN"
python -m transformer.generate --workdir "$RUN" --images eval --num_images 8 --num_samples 4 --seed 0 \
    --temperature 1.0 --out "$HERE/completions.png"
python -m transformer.probe linear --workdir "$RUN" --out "$RUN/probes/linear"
cp "$RUN/probes/linear/linear.png" "$HERE/probe.png"
cp "$RUN/probes/linear/linear.json" "$HERE/probe.json"
python "$HERE/summarize.py" "$RUN" > "$HERE/table.md"
cat "$HERE/table.md"
