#!/usr/bin/env bash
# The main job on the sample data shipped in the repo: install and build, prepare MLPerf's Wikipedia sample into
# pre-training shards (three files for training, the fourth held out for evaluation), print their statistics, then
# train bert-tiny on the CPU for a few minutes; the loss and the held-out masked-LM accuracy are printed as it goes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
out=out/quickstart
vocab=data/vocab/bert-uncased-vocab.txt
./build/nopad prepare --input data/wiki-sample/wiki_00 data/wiki-sample/wiki_01 data/wiki-sample/wiki_02 \
  --vocab $vocab --output $out/train --max-seq-length 128 --dupe-factor 5 --overwrite
./build/nopad prepare --input data/wiki-sample/wiki_03 --vocab $vocab --output $out/eval \
  --max-seq-length 128 --dupe-factor 1 --seed 4321 --overwrite
./build/nopad stats $out/train
./build/nopad train --config configs/bert-tiny-sample.toml --overwrite
