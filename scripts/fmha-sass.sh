#!/usr/bin/env bash
# Compile-time view of the FMHA kernels on this (GPU-less) machine: builds src/ops/cuda/fmha_{forward,backward}.cu for
# sm_90a with `ptxas -v` and prints, per kernel, registers and spill bytes (docs/fmha.md's resources table) and, when a
# cuobjdump is at hand (the CUDA toolkit's, or $CUOBJDUMP), the length of its longest loop in SASS instructions with
# the most frequent opcodes: the per-tile instruction count that the FMHA work of 2026-11-24 was steered by (the
# forward's loop holds its full-tile and partial-tile bodies: about twice its per-tile count).
#   KERNELS=regex   kernels to report (default: the wgmma kernels, e.g. 'bwd_wgmma_kernelILi3ELb0ELb1E')
#   OUT=dir         where the cubins, ptxas logs and SASS go (default /tmp/nopad-fmha-sass)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/nopad-fmha-sass}
KERNELS=${KERNELS:-wgmma_kernel}
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
mkdir -p "$OUT"
CUOBJDUMP=${CUOBJDUMP:-$(command -v cuobjdump || true)}
if [ -z "$CUOBJDUMP" ] && [ -x "$(dirname "$NVCC")/cuobjdump" ]; then CUOBJDUMP="$(dirname "$NVCC")/cuobjdump"; fi
for f in fmha_forward fmha_backward; do
  "$NVCC" -DNOPAD_CUDA_SM90A=1 -DNOPAD_HAVE_CUDA=1 -DNDEBUG -Isrc -O3 -std=c++20 -arch=sm_90a -cubin -Xptxas -v \
    -o "$OUT/$f.cubin" "src/ops/cuda/$f.cu" 2>"$OUT/$f.ptxas" &
done
wait
if [ -n "$CUOBJDUMP" ]; then
  for f in fmha_forward fmha_backward; do "$CUOBJDUMP" -sass "$OUT/$f.cubin" >"$OUT/$f.sass"; done
else
  echo "(no cuobjdump: set CUOBJDUMP=/path/to/cuobjdump for loop lengths)"
fi
python3 - "$OUT" "$KERNELS" <<'PY'
import collections, os, re, sys
out, pat = sys.argv[1], sys.argv[2]
for f in ("fmha_forward", "fmha_backward"):
    sass = {}
    if os.path.exists(f"{out}/{f}.sass"):
        for chunk in open(f"{out}/{f}.sass").read().split("Function : ")[1:]:
            sass[chunk.split("\n")[0].strip()] = chunk
    for block in open(f"{out}/{f}.ptxas").read().split("Compiling entry function '")[1:]:
        name = block.split("'")[0]
        if "sm_90a" not in block.split("\n")[0] or not re.search(pat, name):
            continue
        regs = re.search(r"Used (\d+) registers", block).group(1)
        spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", block)
        line = f"{name[:72]:72s} regs {regs:>3}  spill {spill.group(1)}/{spill.group(2)} B"
        body = sass.get(name)
        if body:
            ins = re.findall(r"/\*([0-9a-f]{4,5})\*/\s+(.*?);", body)
            best = (0, 0, 0)
            for addr, text in ins:  # the longest backward branch: the main loop
                m = re.search(r"BRA\s+(?:\S+\s+)?0x([0-9a-f]+)", text)
                if m and int(m.group(1), 16) < int(addr, 16):
                    n = (int(addr, 16) - int(m.group(1), 16)) // 16
                    if n > best[0]:
                        best = (n, int(m.group(1), 16), int(addr, 16))
            loop = [t for a, t in ins if best[1] <= int(a, 16) <= best[2]]
            ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in loop)
            line += f"  loop {best[0]} instr: " + " ".join(f"{k} {v}" for k, v in ops.most_common(6))
        print(line)
PY
