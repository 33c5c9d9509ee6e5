# Sourced by the GPU scripts (bench.sh, gpu-attention.sh, gpu-scale-out.sh, gpu-tests-dist.sh, profile-step.sh): the
# real Wikipedia shards they all measure on, phase-2 settings (512 tokens, 76 predictions) and one duplicate to keep
# preparation short, made once per machine from .carry/enwiki-20150515-AA.txt.xz.
#   phase2_shards NOPAD SHARDS [LOG]   prepares SHARDS unless SHARDS/dataset.json exists; output to LOG when given
#                                      (printed on failure); returns non-zero, with a message, on failure.
phase2_shards() {
  local nopad=$1 shards=$2 log=${3:-/dev/stderr}
  [ -f "$shards/dataset.json" ] && return 0
  local xz=.carry/enwiki-20150515-AA.txt.xz txt=/tmp/nopad-enwiki-AA.txt
  if [ ! -f "$xz" ]; then
    echo "phase2_shards: $xz is missing: copy ../shared/data/enwiki/enwiki-20150515-AA.txt.xz into .carry/ and name" \
      ".carry in the device call's carry" >&2
    return 1
  fi
  xz -dc "$xz" >"$txt" || return 1
  if ! "$nopad" prepare --input "$txt" --vocab data/vocab/bert-uncased-vocab.txt --output "$shards" \
    --max-seq-length 512 --max-predictions 76 --dupe-factor 1 --quiet --overwrite >"$log" 2>&1; then
    [ "$log" = /dev/stderr ] || cat "$log" >&2
    echo "phase2_shards: nopad prepare failed" >&2
    return 1
  fi
}
