#!/usr/bin/env python3
"""Summarises one kernel's per-instruction ncu export (`ncu -i REP --page source --csv --print-source sass`, as
scripts/ncu-gemm.sh and scripts/gpu-attention.sh write it): where the warp-state samples fall, by stall reason, by
opcode, by code block and by instruction.

Code blocks are runs of instructions with the same execution count: a loop body executes all its instructions equally
often, so each run is one loop level or one straight-line stretch (a k-block of a GEMM's main loop, a tile's epilogue).
Offsets are from the kernel's first instruction (the CSV's addresses are absolute and change between runs).

  python3 scripts/ncu_sass_summary.py KERNEL-sass.csv [--top 30] [--blocks 20] [--range 0x1000:0x1800]

--range prints every instruction between two offsets with its samples and top stall reasons."""
import argparse
import collections
import csv
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def load(path):
    """(kernel name, rows): rows are dicts with offset, source, opcode, samples, executed and stalls (reason -> n)."""
    with open(path, newline="") as f:
        table = list(csv.reader(f))
    if len(table) < 2:
        sys.exit(f"{path}: no rows (expected ncu's --page source --csv --print-source sass export)")
    kernel = ""
    if table[0] and table[0][0] == "Kernel Name":  # the export's first line names the kernel
        kernel = table[0][1] if len(table[0]) > 1 else ""
        table = table[1:]
    header = table[0]
    for need in ("Address", "Source", SAMPLES, EXECUTED):
        if need not in header:
            sys.exit(f"{path}: no '{need}' column (expected ncu's source page exported as SASS)")
    col = {h: i for i, h in enumerate(header)}
    stall_cols = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    rows, base = [], None
    for r in table[1:]:
        if len(r) < len(header) or not r[col["Address"]].startswith("0x"):
            continue
        addr = int(r[col["Address"]], 16)
        base = addr if base is None else base
        src = r[col["Source"]].strip()
        words = src.split()
        opcode = (words[1] if words and words[0].startswith("@") and len(words) > 1 else words[0]) if words else ""
        num = lambda c: int(float(r[col[c]] or 0))
        rows.append({"offset": addr - base, "source": src, "opcode": opcode.rstrip(";"), "samples": num(SAMPLES),
                     "executed": num(EXECUTED), "stalls": {c[len("stall_"):]: num(c) for c in stall_cols}})
    if not rows:
        sys.exit(f"{path}: no instructions")
    return kernel, rows


def top_stalls(stalls, n=3):
    return " ".join(f"{k}={v}" for k, v in sorted(stalls.items(), key=lambda kv: -kv[1])[:n] if v > 0)


def blocks(rows):
    """Runs of consecutive instructions with equal execution counts (zero-count runs dropped)."""
    out, cur = [], None
    for r in rows:
        if cur is None or r["executed"] != cur["executed"]:
            cur = {"first": r["offset"], "last": r["offset"], "executed": r["executed"], "instructions": 0,
                   "samples": 0, "hgmma": 0}
            out.append(cur)
        cur["last"] = r["offset"]
        cur["instructions"] += 1
        cur["samples"] += r["samples"]
        cur["hgmma"] += r["opcode"].startswith("HGMMA")
    return [b for b in out if b["executed"] > 0]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=30, help="instructions with the most samples to list (default 30)")
    ap.add_argument("--blocks", type=int, default=20, help="code blocks with the most samples to list (default 20)")
    ap.add_argument("--range", help="print the instructions between two offsets, e.g. 0x1000:0x1800")
    args = ap.parse_args(argv)
    kernel, rows = load(args.csv)
    total = sum(r["samples"] for r in rows)
    executed = sum(r["executed"] for r in rows)
    pct = lambda n: 100.0 * n / total if total else 0.0
    print(f"kernel: {kernel or '(unnamed)'}")
    print(f"{len(rows)} instructions in the code, {executed:,} warp instructions executed, {total:,} samples")
    if total == 0:
        print("no samples: was the export made with --section SourceCounters (ncu-gemm.sh and gpu-attention.sh do)?")
        return 0
    reasons = collections.Counter()
    opcodes = collections.Counter()
    for r in rows:
        reasons.update(r["stalls"])
        opcodes[r["opcode"]] += r["samples"]
    print("by stall reason: " + ", ".join(f"{k} {pct(v):.1f}%" for k, v in reasons.most_common(12) if v > 0))
    print("by opcode:       " + ", ".join(f"{k} {pct(v):.1f}%" for k, v in opcodes.most_common(12) if v > 0))
    print("\ncode blocks (runs of equal execution count), by samples:")
    print(f"{'offsets':>17} {'executed':>10} {'instr':>6} {'HGMMA':>6} {'samples':>8}")
    for b in sorted(blocks(rows), key=lambda b: -b["samples"])[: args.blocks]:
        print(f"{b['first']:#07x}-{b['last']:#07x} {b['executed']:>10,} {b['instructions']:>6} {b['hgmma']:>6} "
              f"{pct(b['samples']):>7.1f}%")
    print("\ninstructions with the most samples:")
    for r in sorted(rows, key=lambda r: -r["samples"])[: args.top]:
        print(f"{r['offset']:#07x} {pct(r['samples']):5.1f}% exec {r['executed']:>10,}  {r['source'][:70]:70s} "
              f"{top_stalls(r['stalls'])}")
    if args.range:
        lo, _, hi = args.range.partition(":")
        try:
            lo, hi = int(lo, 0), int(hi, 0)
        except ValueError:
            sys.exit(f"--range {args.range}: expected two offsets such as 0x1000:0x1800")
        print(f"\ninstructions {lo:#x}-{hi:#x}:")
        for r in rows:
            if lo <= r["offset"] < hi:
                print(f"{r['offset']:#07x} {pct(r['samples']):5.2f}% exec {r['executed']:>10,}  "
                      f"{r['source'][:70]:70s} {top_stalls(r['stalls'], 2)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
