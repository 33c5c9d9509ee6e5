#!/usr/bin/env python3
"""Compares two `nopad train` runs on the same global batches step by step (the data-parallel checks of
scripts/gpu-tests-dist.sh): both logged the expected number of steps, every step's loss agrees within a tolerance,
optionally the same samples per step and a line the second run's log must contain. Prints one summary line
("LABEL: OK (...)" or "LABEL: FAILED: ... (...)") and exits 1 on failure.
Usage: compare_losses.py ONE/metrics.jsonl TWO/metrics.jsonl --label TEXT [--steps 20] [--tol 0.05]
                         [--same-samples] [--log TWO.log --expect TEXT]"""
import argparse
import json
import sys


def steps(path):
    try:
        return [json.loads(l) for l in open(path) if l.strip() and '"eval"' not in l]
    except OSError:
        return []


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("one")
    ap.add_argument("two")
    ap.add_argument("--label", required=True)
    ap.add_argument("--steps", type=int, default=20)
    # bf16 activations: the two runs sum the same per-sample gradients in a different order and the GEMMs see other
    # row counts, so the weights drift apart by rounding; bert-tiny's loss (~10 -> ~8) stays within 0.05 over 20 steps.
    ap.add_argument("--tol", type=float, default=0.05)
    ap.add_argument("--same-samples", action="store_true")
    ap.add_argument("--log")
    ap.add_argument("--expect")
    args = ap.parse_args()
    one, two = steps(args.one), steps(args.two)
    problems = []
    if len(one) != args.steps or len(two) != args.steps:
        problems.append(f"steps logged: {len(one)} and {len(two)} (want {args.steps} each)")
    if args.expect:
        log = open(args.log, errors="replace").read() if args.log else ""
        if args.expect not in log:
            problems.append(f"the log does not say '{args.expect}'")
    if args.same_samples:
        seqs = [(a.get("samples"), b.get("samples")) for a, b in zip(one, two)]
        if any(x != y for x, y in seqs):
            problems.append(f"samples differ: {seqs[:3]}")
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(one, two)]
    worst = max(diffs) if diffs else float("nan")
    if not diffs or not worst <= args.tol:
        problems.append(f"largest per-step loss difference {worst:.4g} (> {args.tol})")
    first = f"step 1 loss {one[0]['loss']:.5f} vs {two[0]['loss']:.5f}, " if one and two else ""
    last = (f"step {args.steps} loss {one[-1]['loss']:.4f} vs {two[-1]['loss']:.4f}, "
            if len(one) == args.steps and len(two) == args.steps else "")
    verdict = "FAILED: " + "; ".join(problems) if problems else "OK"
    print(f"{args.label}: {verdict} ({first}{last}largest difference {worst:.3g})")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
