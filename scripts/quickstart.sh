#!/usr/bin/env bash
# The main job on the sample data shipped in the repo, from a fresh clone: install and build, prepare MLPerf's
# Wikipedia sample into pre-training shards (wiki_00..02 for training, wiki_03 held out for evaluation), print their
# statistics, pre-train BERT for about four minutes with the held-out masked-LM accuracy printed as it rises past the
# frequency baseline, then ask the trained model to fill in masked words (nopad fill-mask).
#   CPU (the default): bert-tiny, configs/quickstart.toml.
#   GPU (a CUDA device visible and the CUDA backend built): bert-mini, further, configs/quickstart-gpu.toml.
#   QUICKSTART_DEVICE=cpu|gpu forces one.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
nopad=./build/nopad
out=out/quickstart
vocab=data/vocab/bert-uncased-vocab.txt
start=$(date +%s)

device=${QUICKSTART_DEVICE:-auto}
if [ "$device" = auto ]; then
  if $nopad info | grep -qE '^  \[0\] '; then device=gpu; else device=cpu; fi
fi
case $device in
  cpu) config=configs/quickstart.toml ;;
  gpu) config=configs/quickstart-gpu.toml ;;
  *) echo "quickstart: QUICKSTART_DEVICE must be cpu, gpu or auto, got $device" >&2; exit 1 ;;
esac

$nopad prepare --input data/wiki-sample/wiki_00 data/wiki-sample/wiki_01 data/wiki-sample/wiki_02 \
  --vocab $vocab --output $out/train --max-seq-length 128 --dupe-factor 5 --overwrite
$nopad prepare --input data/wiki-sample/wiki_03 --vocab $vocab --output $out/eval \
  --max-seq-length 128 --dupe-factor 1 --seed 4321 --overwrite
$nopad stats $out/train
train_start=$(date +%s)
$nopad train --config $config --overwrite
train_s=$(( $(date +%s) - train_start ))

run=$out/run
[ "$device" = gpu ] && run=$out/run-gpu
checkpoint=$run/checkpoints/$(cat $run/checkpoints/latest)
echo
echo "== the trained model fills in the blanks ($checkpoint)"
$nopad fill-mask --checkpoint "$checkpoint" --top-k 5 \
  "the united [MASK] of america." "new [MASK] city." "in the [MASK] century." "the [MASK] river flows into the sea."

echo
python3 - "$run/metrics.jsonl" "$train_s" "$(( $(date +%s) - start ))" "$device" <<'PY'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
evals = [l for l in lines if l.get("eval")]
print("held-out masked-LM accuracy: " + ", ".join(f"{e['mlm_accuracy']:.3f} at step {e['step']}" for e in evals))
e = evals[-1]
print(f"quickstart ({sys.argv[4]}): held-out masked-LM accuracy {e['mlm_accuracy']:.3f} after {e['step']} steps, "
      f"frequency baseline {e['mlm_frequency_baseline']:.3f}; training {sys.argv[2]} s, whole job {sys.argv[3]} s")
PY
