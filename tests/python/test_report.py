"""`nopad report RUN_DIR` on a real (short, CPU) training run: the summary's numbers are the run's (steps, samples,
first/last loss, evaluation count and best accuracy, the MLPerf status), the six SVG plots parse as XML with one
polyline per series whose point count matches the logged lines, a missing run_dir fails with one clear error line
and writes nothing (test_report_plots.py checks several runs and the legends). Run by CTest with NOPAD_BINARY and NOPAD_SOURCE_DIR set."""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import xml.dom.minidom

from nopad_checks import check, failures
from nopad_test_support import prepare_sample

NOPAD = os.environ["NOPAD_BINARY"]
SRC = os.environ["NOPAD_SOURCE_DIR"]


def train(mode, run, data):
    """12 steps of bert-tiny on the CPU, evaluated every 64 samples; mode is --overwrite or --resume."""
    return subprocess.run([NOPAD, "train", "--config", os.path.join(SRC, "configs/bert-tiny-sample.toml"), mode,
                           "--set", f"run_dir={run}", "--set", f"data.train={data}", "--set", f"data.eval={data}",
                           "--set", "train.device=cpu", "--set", "train.global_batch=16", "--set",
                           "train.max_steps=12", "--set", "eval.interval_samples=64", "--set", "eval.max_samples=32",
                           "--set", "log.interval_steps=1"],
                          capture_output=True, text=True, cwd=SRC)


def main():
    tmp = tempfile.mkdtemp(prefix="nopad-report-")
    try:
        data = os.path.join(tmp, "data")
        r = prepare_sample(data)
        check(r.returncode == 0, f"prepare: {r.stderr}")
        run = os.path.join(tmp, "run")
        r = train("--overwrite", run, data)
        check(r.returncode == 0, f"training: {r.stderr[-300:]}")
        lines = [json.loads(l) for l in open(os.path.join(run, "metrics.jsonl"))]
        steps = [l for l in lines if not l.get("eval")]
        evals = [l for l in lines if l.get("eval")]
        check([e["samples"] for e in evals] == [64, 128, 192], f"eval lines carry the training samples: {evals}")
        check(all(e["eval_samples"] == 32 for e in evals), "eval lines carry the eval set size as eval_samples")

        r = subprocess.run([NOPAD, "report", run], capture_output=True, text=True)
        check(r.returncode == 0, f"report exits 0: {r.stderr}")
        out = r.stdout
        check(f"| steps logged | {len(steps)} (last step 12) |" in out, f"steps in the summary: {out}")
        check("| samples | 192 |" in out, "samples in the summary")
        check(f"{steps[0]['loss']:.6g} / {steps[-1]['loss']:.6g}" in out, "first / last loss in the summary")
        check(f"| evaluations | {len(evals)} |" in out, "evaluation count in the summary")
        best = max(e["mlm_accuracy"] for e in evals)
        check(f"| best masked-LM accuracy | {best:.6g}" in out, f"best accuracy {best:.6g} in the summary")
        check("status aborted" in out, "the MLPerf run status (no target: aborted)")
        rep = os.path.join(run, "report")
        check(open(os.path.join(rep, "report.md")).read() in out, "report.md is the printed summary")
        for name, series in (("loss.svg", [len(steps)]), ("accuracy.svg", [len(steps), len(evals)]),
                             ("throughput.svg", [len(steps)]), ("eval_loss.svg", [len(evals)]),
                             ("learning_rate.svg", [len(steps)]), ("grad_norm.svg", [len(steps)])):
            doc = xml.dom.minidom.parse(os.path.join(rep, name))
            polys = doc.getElementsByTagName("polyline")
            counts = [len(p.getAttribute("points").split()) for p in polys]
            check(counts == series, f"{name}: points per series {counts}, expected {series}")

        # Resuming a finished run with train.max_steps at or below its step trains nothing, and says so.
        r = train("--resume", run, data)
        check(r.returncode == 0 and "nothing to train; raise train.max_steps" in r.stderr,
              f"resume at max_steps warns: {r.returncode} {r.stderr[-300:]!r}")

        # eval: a run folder instead of a checkpoint, and a checkpoint whose weights are not finite.
        r = subprocess.run([NOPAD, "eval", "--checkpoint", run, "--data", data], capture_output=True, text=True)
        check(r.returncode == 1 and "is a run folder: give one of its checkpoints" in r.stderr,
              f"eval of a run folder: {r.returncode} {r.stderr!r}")
        latest = open(os.path.join(run, "checkpoints", "latest")).read().strip()
        nan_ck = os.path.join(tmp, "nan-ck")
        os.makedirs(nan_ck)
        for f in ("config.json", "model.safetensors"):  # a Hugging Face folder: no checksums to stop the edit
            shutil.copy(os.path.join(run, "checkpoints", latest, f), nan_ck)
        with open(os.path.join(nan_ck, "model.safetensors"), "r+b") as f:
            header_len = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(header_len))
            name = next(k for k, v in header.items() if k != "__metadata__" and v["dtype"] == "F32")
            f.seek(8 + header_len + header[name]["data_offsets"][0])
            f.write(bytes.fromhex("0000c07f"))  # a float32 NaN as the tensor's first element
        r = subprocess.run([NOPAD, "eval", "--checkpoint", nan_ck, "--data", data], capture_output=True, text=True)
        check(r.returncode == 1 and "holds a non-finite value" in r.stderr and name in r.stderr,
              f"eval of a checkpoint with a NaN weight ({name}): {r.returncode} {r.stderr!r} {r.stdout!r}")

        # A metrics line whose field has the wrong type: one error line naming the file and the line.
        bad = os.path.join(tmp, "badrun")
        os.makedirs(bad)
        with open(os.path.join(bad, "metrics.jsonl"), "w") as f:
            f.write('{"step": 1, "loss": 10.5}\n{"step": "x", "loss": "abc"}\n')
        r = subprocess.run([NOPAD, "report", bad], capture_output=True, text=True)
        err = [l for l in r.stderr.splitlines() if l.strip()]
        check(r.returncode == 1 and len(err) == 1 and "metrics.jsonl line 2" in err[0] and "wrong type" in err[0],
              f"a wrong-typed metrics line: one error line, exit 1: {r.returncode} {r.stderr!r}")

        r = subprocess.run([NOPAD, "report", os.path.join(tmp, "missing")], capture_output=True, text=True)
        err = [l for l in r.stderr.splitlines() if l.strip()]
        check(r.returncode == 1 and len(err) == 1 and "metrics.jsonl cannot be read" in err[0],
              f"a missing run_dir: one error line, exit 1: {r.returncode} {r.stderr!r}")
        check(not os.path.exists(os.path.join(tmp, "missing")), "nothing written for a missing run_dir")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if failures:
        print(f"{len(failures)} failure(s)")
        sys.exit(1)
    print("test_report: all checks passed")


if __name__ == "__main__":
    main()
