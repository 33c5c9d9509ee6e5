"""The shipped MLPerf recipes (configs/mlperf-phase2*.toml) carry exactly the hyper-parameters of MLCommons' reference
convergence point (RCP) for their global batch, read from the rcps_bert.json that the mlperf-logging package ships
(the newest training ruleset that has BERT): learning rate, LAMB betas, epsilon, weight decay, decay steps, warm-up
steps and start, no gradient accumulation assumption beyond the batch. Also: the BERT-large model, the 0.720 target,
MLPerf's eval interval rule and a 10,000-sample eval. Run by CTest with NOPAD_SOURCE_DIR set; needs mlperf-logging
(scripts/setup.sh installs it)."""
import glob
import json
import os
import sys
import tomllib

SRC = os.environ["NOPAD_SOURCE_DIR"]


def rcps():
    try:
        import mlperf_logging  # noqa: F401
    except ImportError:
        sys.exit("test_mlperf_configs: the mlperf-logging package is missing (pip install mlperf-logging; "
                 "scripts/setup.sh does)")
    sys.path.insert(0, os.path.join(SRC, "scripts"))
    from project_ttt import default_rcp_source  # the newest training ruleset's rcps_bert.json

    path = default_rcp_source()
    if path is None:
        sys.exit("test_mlperf_configs: mlperf-logging ships no rcps_bert.json")
    print(f"  RCPs from {path}")
    return {v["BS"]: v for v in json.load(open(path)).values()}


def main():
    table = rcps()
    failures = []
    configs = sorted(glob.glob(os.path.join(SRC, "configs", "mlperf-phase2*.toml")))
    if len(configs) < 2:
        failures.append(f"expected the batch-448 and large-batch recipes, found {configs}")
    for path in configs:
        c = tomllib.load(open(path, "rb"))
        name = os.path.basename(path)
        bs = c["train"]["global_batch"]
        ref = table.get(bs)
        if ref is None:
            failures.append(f"{name}: no RCP for global batch {bs} (RCP batches: {sorted(table)})")
            continue
        h = ref["Hyperparams"]
        want = {("optim", "lr"): h["opt_base_learning_rate"], ("optim", "beta1"): h["opt_lamb_beta_1"],
                ("optim", "beta2"): h["opt_lamb_beta_2"], ("optim", "eps"): h["opt_epsilon"],
                ("optim", "weight_decay"): h["opt_lamb_weight_decay_rate"],
                ("schedule", "total_steps"): h["opt_learning_rate_training_steps"],
                ("schedule", "warmup_steps"): h["num_warmup_steps"],
                ("schedule", "start_warmup_step"): h["start_warmup_step"],
                ("train", "target_mlm_accuracy"): 0.72, ("eval", "interval_samples"): -1,
                ("eval", "max_samples"): 10000, ("optim", "name"): "lamb"}
        for (sec, key), value in want.items():
            got = c.get(sec, {}).get(key)
            ok = got == value if isinstance(value, str) else got is not None and abs(got - value) <= 1e-12 * max(1, abs(value))
            if not ok:
                failures.append(f"{name}: {sec}.{key} = {got}, the RCP for batch {bs} says {value}")
        if c["model"]["config"] != "../data/configs/bert-large-mlperf.json":  # relative to configs/
            failures.append(f"{name}: model.config is {c['model']['config']}")
        if bs % c["train"]["grad_accumulation"]:
            failures.append(f"{name}: global_batch {bs} is not a multiple of grad_accumulation")
        mean = sum(ref["Epochs to converge"]) / len(ref["Epochs to converge"])
        print(f"  {name}: batch {bs}, lr {h['opt_base_learning_rate']}, betas {h['opt_lamb_beta_1']}/"
              f"{h['opt_lamb_beta_2']}, {h['opt_learning_rate_training_steps']} decay steps; RCP mean "
              f"{mean / 1e6:.2f}M samples")
    if failures:
        print("\n".join("FAIL: " + f for f in failures))
        sys.exit(1)
    print("test_mlperf_configs: all checks passed")


if __name__ == "__main__":
    main()
