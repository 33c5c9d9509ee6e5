# Sourced by the GPU scripts (bench.sh, gpu-attention.sh, gpu-scale-out.sh, gpu-tests-dist.sh, profile-step.sh): the
# real Wikipedia shards they all measure on, phase-2 settings (512 tokens, 76 predictions) and one duplicate to keep
# preparation short, made once per machine from .carry/enwiki-20150515-AA.txt.xz.
#   phase2_shards NOPAD SHARDS [LOG]   prepares SHARDS unless SHARDS/dataset.json exists; output to LOG when given
#                                      (printed on failure); returns non-zero, with a message, on failure.
_phase2_prepare() {  # NOPAD TXT SHARDS
  "$1" prepare --input "$2" --vocab data/vocab/bert-uncased-vocab.txt --output "$3" --max-seq-length 512 \
    --max-predictions 76 --dupe-factor 1 --quiet --overwrite
}
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
  # Without a log file the output goes to the caller's stderr as it is: `>/dev/stderr` would reopen (and truncate) a
  # stderr that is itself redirected to a file, leaving a hole of NUL bytes before the caller's next write.
  local ok=1
  if [ "$log" = /dev/stderr ]; then
    _phase2_prepare "$nopad" "$txt" "$shards" >&2 || ok=0
  else
    _phase2_prepare "$nopad" "$txt" "$shards" >"$log" 2>&1 || ok=0
  fi
  if [ "$ok" = 0 ]; then
    [ "$log" = /dev/stderr ] || cat "$log" >&2
    echo "phase2_shards: nopad prepare failed" >&2
    return 1
  fi
}
