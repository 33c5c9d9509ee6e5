#!/usr/bin/env bash
# The main job on the sample data shipped in the repo: install, build, prepare the MLPerf wiki sample into shards
# with MLPerf's settings, and print their statistics.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
out=${NOPAD_QUICKSTART_DIR:-out/quickstart}
./build/nopad prepare --input data/wiki-sample --vocab data/vocab/bert-uncased-vocab.txt \
  --output "$out/data" --dupe-factor 5 --overwrite
./build/nopad stats "$out/data"
