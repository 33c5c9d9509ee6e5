"""Equivalence check of nopad and its PyTorch twin (scripts/torch_pretrain.py) before a convergence comparison:
both train from the SAME initial weights (drawn here with nopad's initialisation law and given to both as
init_from), with dropout 0, on the same batches in the same order, for a few steps, with the config's optimizer
settings and a schedule that moves the weights (warm-up over the first quarter, decay to 0 at the end); then both
evaluate once on the first --eval-samples of the eval set. Per-step learning rates must be equal, per-step losses and
gradient norms and the final evaluation must agree within the precision's tolerance.

    python3 scripts/compare_twins.py --nopad build-gpu/nopad --config configs/convergence-bert-base.toml \
        --data TRAIN_DIR --eval EVAL_DIR --device cuda --work /tmp/twins [--steps 20] [--report FILE]

Tolerances (--device cuda: bf16 on both sides; cpu: fp32 on both sides), bf16 / fp32:
  * step-1 loss (identical weights and batch, so only rounding differs): 0.01 / 1e-4. In bf16 the loss is a mean
    over thousands of masked positions whose logits are off by ~2^-8 relative at most.
  * every step's loss: 0.05 / 5e-4. Rounding differences grow as the weights move apart step by step; 0.05 is above
    the bf16-vs-fp32 agreement of nopad's own GPU run (docs/training.md: 25-step windows within 0.006) and catches gross
    differences (another batch order, loss denominator or schedule). Subtle optimizer semantics are for the fp32 check:
    measured fp32 agreement is 1e-5, while the trust ratio applied to biases and LayerNorm too moves bert-tiny's loss
    by 0.06 in 20 steps at lr 2e-3 (0.45 at lr 0.05), so only fp32 sees such a difference with a wide margin.
  * gradient norm, relative, step 1 / later: 5% / 10% and 1e-4 / 1e-3 (fp32 measured: 2e-6).
  * eval masked-LM accuracy: 0.01 / 1e-3; eval loss: 0.05 / 1e-3.
Exit status 0 when everything agrees, 1 otherwise; --report writes the table.
"""
import argparse
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
import nopad_twin  # noqa: E402

TOLERANCES = {  # loss step 1, loss any step, grad norm rel step 1, grad norm rel later, eval acc, eval loss
    "cuda": (0.01, 0.05, 0.05, 0.10, 0.01, 0.05),
    "cpu": (1e-4, 5e-4, 1e-4, 1e-3, 1e-3, 1e-3),
}


def run(cmd, log):
    with open(log, "w") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        with open(log) as f:
            tail = f.read()[-3000:]
        sys.exit(f"error: {' '.join(cmd[:3])} ... failed (exit {r.returncode}); log {log}:\n{tail}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nopad", required=True, help="the nopad binary")
    p.add_argument("--config", required=True, help="nopad training config (its model, optimizer, batch)")
    p.add_argument("--set", action="append", default=[], help="extra config override for both systems")
    p.add_argument("--data", required=True, help="training shards")
    p.add_argument("--eval", default="", help="eval shards ('' = no evaluation compared)")
    p.add_argument("--eval-samples", type=int, default=1024)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=4321)
    p.add_argument("--work", required=True, help="scratch folder (replaced)")
    p.add_argument("--report", help="write the comparison table here")
    p.add_argument("--python", default=sys.executable, help="the Python that runs torch_pretrain.py")
    a = p.parse_args()

    cfg = nopad_twin.load_train_config(a.config, a.set)
    mc = nopad_twin.read_hf_config(cfg["model.config"])
    mc["hidden_dropout_prob"] = mc["attention_probs_dropout_prob"] = 0.0
    shutil.rmtree(a.work, ignore_errors=True)
    os.makedirs(a.work)
    model_json = os.path.join(a.work, "model.json")
    with open(model_json, "w") as f:
        f.write(nopad_twin.hf_config_json(mc))
    init_dir = os.path.join(a.work, "init")
    nopad_twin.save_hf_folder(init_dir, mc, nopad_twin.init_params_numpy(mc, a.seed))

    sets = list(a.set) + [f"model.config={model_json}", f"init_from={init_dir}", f"data.train={a.data}",
                          f"data.eval={a.eval}", f"train.max_steps={a.steps}", "train.max_samples=0",
                          f"train.seed={a.seed}", "train.target_mlm_accuracy=0", "log.interval_steps=1",
                          f"schedule.warmup_steps={max(1, a.steps // 4)}", "schedule.start_warmup_step=0",
                          f"schedule.total_steps={a.steps}", "eval.interval_samples=0",
                          f"eval.max_samples={a.eval_samples}", "checkpoint.interval_steps=0",
                          f"train.device={a.device}", "train.precision=auto"]
    runs = {}
    for name in ("nopad", "torch"):
        rd = os.path.join(a.work, name)
        args = [x for s in sets + [f"run_dir={rd}"] for x in ("--set", s)]
        if name == "nopad":
            cmd = [a.nopad, "train", "--config", a.config, "--overwrite"] + args
        else:
            cmd = [a.python, os.path.join(HERE, "torch_pretrain.py"), "--config", a.config] + args
        run(cmd, os.path.join(a.work, name + ".log"))
        runs[name] = nopad_twin.read_metrics(os.path.join(rd, "metrics.jsonl"))

    tol = TOLERANCES[a.device]
    (ns, ne), (ts, te) = runs["nopad"], runs["torch"]
    problems = []
    lines = [f"nopad vs torch twin, {a.device} ({'bf16' if a.device == 'cuda' else 'fp32'}), {a.steps} steps, "
             f"dropout 0, same initial weights (seed {a.seed}), config {a.config}",
             "| step | samples | lr | nopad loss | torch loss | abs diff | nopad grad norm | torch grad norm | rel diff |",
             "|---|---|---|---|---|---|---|---|---|"]
    if [s["step"] for s in ns] != list(range(1, a.steps + 1)) or [s["step"] for s in ts] != [s["step"] for s in ns]:
        problems.append(f"step lines differ: nopad {[s['step'] for s in ns]}, torch {[s['step'] for s in ts]}")
    max_loss, max_gn = 0.0, 0.0
    for x, y in zip(ns, ts):
        k = x["step"]
        dl = abs(x["loss"] - y["loss"])
        dg = abs(x["grad_norm"] - y["grad_norm"]) / max(abs(x["grad_norm"]), 1e-12)
        max_loss, max_gn = max(max_loss, dl), max(max_gn, dg)
        lines.append(f"| {k} | {x['samples']} | {x['lr']:.6g} | {x['loss']:.6f} | {y['loss']:.6f} | {dl:.2e} | "
                     f"{x['grad_norm']:.6g} | {y['grad_norm']:.6g} | {dg:.2e} |")
        if x["samples"] != y["samples"]:
            problems.append(f"step {k}: samples {x['samples']} vs {y['samples']}")
        if abs(x["lr"] - y["lr"]) > 1e-12 * max(1.0, abs(x["lr"])):
            problems.append(f"step {k}: lr {x['lr']!r} vs {y['lr']!r}")
        if dl > (tol[0] if k == 1 else tol[1]):
            problems.append(f"step {k}: loss differs by {dl:.3g} (> {tol[0] if k == 1 else tol[1]})")
        if dg > (tol[2] if k == 1 else tol[3]):
            problems.append(f"step {k}: gradient norm differs by {dg:.3g} relative (> {tol[2] if k == 1 else tol[3]})")
    if a.eval:
        if len(ne) != 1 or len(te) != 1:
            problems.append(f"expected one evaluation each, got {len(ne)} (nopad) and {len(te)} (torch)")
        else:
            x, y = ne[0], te[0]
            lines.append(f"eval on {x['eval_samples']} samples: masked-LM accuracy nopad {x['mlm_accuracy']:.5f} torch "
                         f"{y['mlm_accuracy']:.5f}; loss nopad {x['eval_loss']:.5f} torch {y['eval_loss']:.5f}; "
                         f"NSP accuracy nopad {x['nsp_accuracy']:.4f} torch {y['nsp_accuracy']:.4f}")
            if x["eval_samples"] != y["eval_samples"]:
                problems.append(f"eval sizes {x['eval_samples']} vs {y['eval_samples']}")
            if abs(x["mlm_accuracy"] - y["mlm_accuracy"]) > tol[4]:
                problems.append(f"eval masked-LM accuracy differs by {abs(x['mlm_accuracy'] - y['mlm_accuracy']):.3g}")
            if abs(x["eval_loss"] - y["eval_loss"]) > tol[5]:
                problems.append(f"eval loss differs by {abs(x['eval_loss'] - y['eval_loss']):.3g}")
    lines.append(f"max |loss diff| {max_loss:.3g} (tolerance {tol[0]} at step 1, {tol[1]} after); max gradient-norm "
                 f"relative diff {max_gn:.3g} (tolerance {tol[2]} / {tol[3]})")
    lines.append("EQUIVALENT" if not problems else "NOT EQUIVALENT:\n  " + "\n  ".join(problems))
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if a.report:
        with open(a.report, "w") as f:
            f.write(text)
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
