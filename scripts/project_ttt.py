#!/usr/bin/env python3
"""Projected MLPerf BERT time-to-train from a measured training throughput.

MLPerf's BERT clock runs from run_start to the evaluation that first reaches masked-LM accuracy 0.720. A projection
without a full convergence run takes the samples a global batch needs from MLCommons' reference convergence points
(RCPs: samples to converge of ~20 reference runs per batch size), counts training up to the first evaluation at or
past that point (evaluations every MLPerf eval interval; none at sample 0) and adds the evaluations' time:

  rcp_samples(B)   olympic mean (fastest and slowest run dropped) of the RCP runs at batch B; linear in B between
                   the nearest RCP batch sizes below and above (B outside the RCP batches is refused)
  interval(B)      floor(0.05 * (230.23 B + 3,000,000) / 25,000) * 25,000 samples
  evals            ceil(rcp_samples / interval); trained samples = evals * interval
  minutes          (trained samples / train seq/s + evals * eval seconds) / 60

Eval seconds: --eval-s (measured per 10,000-sample evaluation), else estimated from the training rate with the
forward pass at a third of a training step's work (10,000 / (3 * seq/s)); the output says which. Initialisation and
data staging before run_start are not counted (MLPerf does not count them either).

RCPs come from the rcps_bert.json of the mlperf-logging package (newest training ruleset) when it is installed, or
--rcp-file; without either, the means of ruleset 5.0.0 listed in RCP_MEANS below are used.

Usage: project_ttt.py --seqs-per-s 4480 --global-batch 512 [--eval-s 1.2] [--rcp-file F] [--json]
Exit status 2 with a message on bad input (a batch outside the RCPs, a non-positive rate).
"""
import argparse
import glob
import json
import math
import os
import sys

TARGET_ACCURACY = 0.720
EVAL_SAMPLES = 10_000
# Olympic means of MLCommons' BERT RCPs, training ruleset 5.0.0 (samples to reach 0.720), by global batch.
RCP_MEANS = {256: 2_549_000, 448: 2_414_000, 1536: 2_776_000, 3072: 2_764_000, 4096: 2_844_000, 4608: 2_798_000,
             6144: 3_319_000, 6912: 3_602_000, 8192: 4_186_000, 8704: 4_274_000, 12288: 4_465_000,
             13056: 4_645_000, 16384: 5_505_000}


def fail(msg):
    print(f"project_ttt: {msg}", file=sys.stderr)
    sys.exit(2)


def olympic_mean(runs):
    runs = sorted(runs)
    kept = runs[1:-1] if len(runs) > 2 else runs
    return sum(kept) / len(kept)


def load_rcps(path):
    """{batch: samples} from an rcps_bert.json (its 'Epochs to converge' lists are samples for BERT)."""
    try:
        data = json.load(open(path))
        return {int(v["BS"]): olympic_mean(v["Epochs to converge"]) for v in data.values()}
    except (OSError, ValueError, KeyError, TypeError) as e:
        fail(f"cannot read RCPs from {path}: {e}")


def default_rcp_source():
    """The newest training ruleset's rcps_bert.json of mlperf-logging, or None."""
    try:
        import mlperf_logging
    except ImportError:
        return None
    base = os.path.join(os.path.dirname(mlperf_logging.__file__), "rcp_checker")
    files = glob.glob(os.path.join(base, "training_*", "rcps_bert.json"))

    def version(p):
        return [int(x) for x in os.path.basename(os.path.dirname(p))[len("training_"):].split(".")]

    return max(files, key=version) if files else None


def rcp_samples(table, batch):
    """Samples to converge at `batch`: the RCP itself, or linear between the nearest RCP batches around it."""
    if batch in table:
        return table[batch], f"RCP at batch {batch}"
    lower = [b for b in table if b < batch]
    upper = [b for b in table if b > batch]
    if not lower or not upper:
        fail(f"global batch {batch} is outside the RCP batch sizes {min(table)}..{max(table)}: MLPerf has no "
             f"convergence point to project from; use a batch in that range")
    lo, hi = max(lower), min(upper)
    w = (batch - lo) / (hi - lo)
    return table[lo] + w * (table[hi] - table[lo]), f"interpolated between the RCPs at batch {lo} and {hi}"


def eval_interval(batch):
    return math.floor(0.05 * (230.23 * batch + 3_000_000) / 25_000) * 25_000


def project(seqs_per_s, batch, table, eval_s=None):
    if not (seqs_per_s > 0 and math.isfinite(seqs_per_s)):
        fail(f"--seqs-per-s must be a positive number, got {seqs_per_s}")
    if batch <= 0:
        fail(f"--global-batch must be positive, got {batch}")
    if eval_s is not None and not (eval_s >= 0 and math.isfinite(eval_s)):
        fail(f"--eval-s must be a non-negative number, got {eval_s}")
    samples, source = rcp_samples(table, batch)
    interval = eval_interval(batch)
    evals = math.ceil(samples / interval)
    trained = evals * interval
    eval_estimated = eval_s is None
    per_eval = EVAL_SAMPLES / (3.0 * seqs_per_s) if eval_estimated else eval_s
    train_s = trained / seqs_per_s
    total_s = train_s + evals * per_eval
    return {
        "global_batch": batch, "seqs_per_s": seqs_per_s, "rcp_samples": round(samples), "rcp_source": source,
        "eval_interval": interval, "evals": evals, "trained_samples": trained, "train_minutes": train_s / 60,
        "eval_seconds_each": per_eval, "eval_seconds_estimated": eval_estimated,
        "eval_minutes": evals * per_eval / 60, "minutes": total_s / 60, "target_accuracy": TARGET_ACCURACY,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs-per-s", type=float, required=True, help="measured training sequences/s (all GPUs)")
    ap.add_argument("--global-batch", type=int, required=True, help="global batch of the measured run")
    ap.add_argument("--eval-s", type=float, help="seconds per 10,000-sample evaluation (default: estimated)")
    ap.add_argument("--rcp-file", help="an rcps_bert.json (default: mlperf-logging's newest, else built-in means)")
    ap.add_argument("--json", action="store_true", help="print one JSON line instead of the text")
    a = ap.parse_args(argv)
    path = a.rcp_file or default_rcp_source()
    table = load_rcps(path) if path else dict(RCP_MEANS)
    r = project(a.seqs_per_s, a.global_batch, table, a.eval_s)
    r["rcp_file"] = path or "built-in ruleset 5.0.0 means"
    if a.json:
        print(json.dumps(r))
        return
    print(f"projected time-to-train at global batch {r['global_batch']}, {r['seqs_per_s']:.1f} seq/s:")
    print(f"  samples to {TARGET_ACCURACY:.3f}: {r['rcp_samples'] / 1e6:.3f}M ({r['rcp_source']}; {r['rcp_file']})")
    print(f"  evaluations every {r['eval_interval']:,} samples: {r['evals']}, training to {r['trained_samples']:,} "
          f"samples: {r['train_minutes']:.2f} min")
    how = "estimated: forward at 1/3 of a training step" if r["eval_seconds_estimated"] else "measured"
    print(f"  evaluation {r['eval_seconds_each']:.2f} s each ({how}): {r['eval_minutes']:.2f} min")
    print(f"  total {r['minutes']:.2f} min")


if __name__ == "__main__":
    main()
