"""scripts/plot_convergence.py on synthetic metrics.jsonl files (nopad's format): two systems whose accuracy curves
are the same law plus seeded noise, nopad at twice torch's throughput. Checks the table rows, the agreement verdict
(agree; differ once torch's curve is lowered by 0.03), the throughput ratio (2.000) and the wall-clock-to-common-
accuracy ratio (~2), the resume verdict (continues with a 0.0005 offset after the checkpoint, not with 0.02), a
missing run skipped with a note, and the SVG (two panels, one polyline per run and panel with one point per
evaluation). Needs no GPU, torch or nopad binary."""
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import xml.dom.minidom

from nopad_checks import check, failures

SRC = os.environ.get("NOPAD_SOURCE_DIR", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
SCRIPT = os.path.join(SRC, "scripts", "plot_convergence.py")
BATCH, STEPS, INTERVAL = 256, 1500, 25_000



def write_run(path, seed, rate, offset=0.0, prefix=None, after_step=None):
    """Training lines every 10 steps, evaluations at nopad's crossings and at the end. prefix: lines copied from
    another run up to after_step (a resumed run)."""
    rng = random.Random(seed)
    lines = []
    if prefix is not None:
        with open(prefix) as f:
            for l in f:
                if json.loads(l)["step"] <= after_step:
                    lines.append(l.rstrip("\n"))
    t = 0.0 if prefix is None else 0.5  # a resumed run restarts its clock a little later
    first = after_step + 1 if prefix is not None else 1
    for step in range(1, STEPS + 1):
        samples = step * BATCH
        t += BATCH / rate
        if step < first:
            continue
        if step % 10 == 0 or step == STEPS:
            lines.append(json.dumps({"step": step, "samples": samples, "loss": 9.0 - step / 200, "mlm_loss": 8.3,
                                     "nsp_loss": 0.7, "mlm_accuracy": 0.1, "lr": 1e-3, "grad_norm": 1.0,
                                     "seq_per_s": rate, "tokens_per_s": rate * 110, "elapsed_s": t + seed * 1e-6}))
        before = samples - BATCH
        if samples // INTERVAL > before // INTERVAL or step == STEPS:
            acc = 0.6 * (1 - math.exp(-samples / 60_000)) + rng.gauss(0, 0.003) + offset
            lines.append(json.dumps({"eval": True, "step": step, "samples": samples, "mlm_accuracy": acc,
                                     "nsp_accuracy": 0.6, "eval_loss": 7.0, "mlm_loss": 6.3, "nsp_loss": 0.7,
                                     "eval_samples": 5000}))
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def run(args):
    r = subprocess.run([sys.executable, SCRIPT] + args, capture_output=True, text=True)
    check(r.returncode == 0, f"plot_convergence exits 0: {r.stderr[-500:]}")
    return r.stdout


def main():
    tmp = tempfile.mkdtemp(prefix="nopad-plotconv-")
    try:
        p = lambda n: os.path.join(tmp, n)
        write_run(p("n1.jsonl"), 1, 4000.0)
        write_run(p("n2.jsonl"), 2, 4000.0)
        write_run(p("t1.jsonl"), 3, 2000.0)
        write_run(p("t2.jsonl"), 4, 2000.0)
        write_run(p("t1low.jsonl"), 3, 2000.0, offset=-0.03)
        write_run(p("t2low.jsonl"), 4, 2000.0, offset=-0.03)
        mid = 750
        write_run(p("res_ok.jsonl"), 1, 4000.0, offset=0.0005, prefix=p("n1.jsonl"), after_step=mid)
        write_run(p("res_bad.jsonl"), 1, 4000.0, offset=0.02, prefix=p("n1.jsonl"), after_step=mid)

        out = run([f"nopad1={p('n1.jsonl')}", f"nopad2={p('n2.jsonl')}", f"torch1={p('t1.jsonl')}",
                   f"torch2={p('t2.jsonl')}", "--resume", p("res_ok.jsonl"), "--resume-of", "nopad1",
                   "--svg", p("c.svg"), "--json", p("r.json")])
        res = json.load(open(p("r.json")))
        evals = [json.loads(l) for l in open(p("n1.jsonl")) if '"eval"' in l]
        rows = [l for l in out.splitlines() if l.startswith("| ") and l.split("|")[1].strip().isdigit()]
        eval_rows = [r for r in rows if len(r.split("|")) > 10]
        check(len(eval_rows) == len(evals) == 16, f"one table row per evaluation: {len(eval_rows)} rows, "
              f"{len(evals)} evaluations")
        first = f"| {evals[0]['samples']} | {evals[0]['mlm_accuracy']:.4f} |"
        check(any(r.startswith(first) for r in rows), f"row {first}")
        check(res["agreement"]["agree"] and "AGREE within run-to-run noise" in out, "same law: the systems agree")
        check(0.001 < res["agreement"]["sigma"] < 0.01, f"sigma from the seed differences: {res['agreement']}")
        check(abs(res["throughput_ratio"] - 2.0) < 1e-9, f"throughput ratio {res['throughput_ratio']}")
        check(1.8 < res["time_to_target_ratio"] < 2.2 and 1.8 < res["steady_time_to_target_ratio"] < 2.2,
              f"wall-clock ratios {res['time_to_target_ratio']}, {res['steady_time_to_target_ratio']}")
        tgt = min(e["mlm_accuracy"] for f in ("n1", "n2", "t1", "t2")
                  for e in [json.loads(l) for l in open(p(f + ".jsonl")) if '"eval"' in l][-1:])
        check(abs(res["target_accuracy"] - tgt) < 1e-12, "the common accuracy is the lowest final accuracy")
        check(res["resume"]["continues"] and res["resume"]["after_samples"] == mid * BATCH and
              res["resume"]["points"] == sum(1 for e in evals if e["samples"] > mid * BATCH),
              f"resumed run continues the curve: {res['resume']}")
        check("CONTINUES the same curve" in out, "resume verdict printed")

        doc = xml.dom.minidom.parse(p("c.svg"))
        polys = doc.getElementsByTagName("polyline")
        counts = [len(x.getAttribute("points").split()) for x in polys]
        check(len(polys) == 10, f"2 panels x 5 series: {len(polys)} polylines")
        check(counts == [16] * 10,
              f"points per polyline {counts}")

        out = run([f"nopad1={p('n1.jsonl')}", f"nopad2={p('n2.jsonl')}", f"torch1={p('t1low.jsonl')}",
                   f"torch2={p('t2low.jsonl')}", f"torch3={p('missing.jsonl')}", "--resume", p("res_bad.jsonl"),
                   "--resume-of", "nopad1", "--resume-after", str(mid * BATCH), "--json", p("r2.json")])
        res = json.load(open(p("r2.json")))
        check(not res["agreement"]["agree"] and "DIFFER" in out, f"a 0.03 offset is detected: {res['agreement']}")
        check(abs(res["agreement"]["mean_gap"] - 0.03) < 0.005, f"mean gap {res['agreement']['mean_gap']}")
        check(not res["resume"]["continues"] and "DOES NOT continue" in out, f"resume offset 0.02: {res['resume']}")
        check("torch3" in out and "missing" in out and "torch3" not in res["runs"], "a missing run is skipped")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if failures:
        print(f"{len(failures)} failure(s)")
        sys.exit(1)
    print("test_plot_convergence: all checks passed")


if __name__ == "__main__":
    main()
