"""python/nopad_twin.py (the non-model half of scripts/torch_pretrain.py) agrees with nopad train:
  * its config defaults are the keys and defaults `nopad train --help` lists, every shipped config loads, and the
    effective config it computes (file + --set overrides) equals the config.toml nopad writes for the same run;
  * its learning-rate schedule gives every step's lr of a nopad run (warm-up with a positive start_warmup_step, decay
    of power 0.5, steps past schedule.total_steps), and its evaluation rule the steps nopad evaluated at;
  * weights it writes (nopad's initialisation law, safetensors) are what nopad loads with init_from: after one step
    at lr 0 nopad's checkpoint holds them bit for bit, under the names and shapes of param_layout.
Run by CTest with NOPAD_BINARY and NOPAD_SOURCE_DIR set."""
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib

import numpy as np

import nopad_twin

from nopad_checks import check, failures
from nopad_test_support import prepare_sample

NOPAD = os.environ["NOPAD_BINARY"]
SRC = os.environ["NOPAD_SOURCE_DIR"]


def help_defaults():
    r = subprocess.run([NOPAD, "train", "--help"], capture_output=True, text=True)
    out = {}
    for m in re.finditer(r"^  ([a-z0-9_.]+) = (.*)$", r.stdout, re.M):
        out[m.group(1)] = tomllib.loads("v = " + m.group(2))["v"]
    return out


def main():
    # 1. Keys and defaults.
    nopad_keys = help_defaults()
    check(len(nopad_keys) > 30, f"parsed {len(nopad_keys)} keys from nopad train --help")
    check(set(nopad_keys) == set(nopad_twin.TRAIN_DEFAULTS),
          f"key sets differ: only nopad {set(nopad_keys) - set(nopad_twin.TRAIN_DEFAULTS)}, only Python "
          f"{set(nopad_twin.TRAIN_DEFAULTS) - set(nopad_keys)}")
    for k, v in nopad_keys.items():
        py = nopad_twin.TRAIN_DEFAULTS.get(k)
        check(py == v and type(py) is type(v), f"default of {k}: nopad {v!r}, Python {py!r}")
    for path in sorted(glob.glob(os.path.join(SRC, "configs", "*.toml"))):
        try:
            nopad_twin.load_train_config(path)
        except nopad_twin.ConfigError as e:
            check(False, f"{os.path.basename(path)} does not load: {e}")
    bad = None
    try:
        nopad_twin.load_train_config(os.path.join(SRC, "configs/bert-tiny-sample.toml"), ["optim.lr_typo=1"])
    except nopad_twin.ConfigError as e:
        bad = str(e)
    check(bad is not None and "optim.lr_typo" in bad, "an unknown --set key is refused")

    tmp = tempfile.mkdtemp(prefix="nopad-twin-")
    try:
        data = os.path.join(tmp, "data")
        r = prepare_sample(data)
        check(r.returncode == 0, f"prepare: {r.stderr}")
        mc = nopad_twin.read_hf_config(os.path.join(SRC, "data/configs/bert-tiny.json"))
        init = nopad_twin.init_params_numpy(mc, 7)
        init_dir = os.path.join(tmp, "init")
        nopad_twin.save_hf_folder(init_dir, mc, init)
        w = init["bert.encoder.layer.0.intermediate.dense.weight"]
        check(np.abs(w).max() <= 0.04 + 1e-7 and 0.016 < w.std() < 0.019,
              f"truncated normal init: max {np.abs(w).max()}, std {w.std()} (0.02 x 0.880 expected)")

        run = os.path.join(tmp, "run")
        config = os.path.join(SRC, "configs/bert-tiny-sample.toml")
        sets = [f"run_dir={run}", f"data.train={data}", f"data.eval={data}", f"init_from={init_dir}",
                "train.device=cpu", "train.global_batch=16", "train.max_steps=12", "log.interval_steps=1",
                "eval.interval_samples=40", "eval.max_samples=24", "schedule.warmup_steps=3",
                "schedule.start_warmup_step=1", "schedule.total_steps=10", "schedule.power=0.5", "optim.lr=0.02",
                "checkpoint.interval_steps=1", "checkpoint.keep=0", "train.seed=99"]
        r = subprocess.run([NOPAD, "train", "--config", config, "--overwrite"] + [x for s in sets for x in ("--set", s)],
                           capture_output=True, text=True, cwd=SRC)
        check(r.returncode == 0, f"nopad train: {r.stderr[-400:]}")

        # 2. The effective config.
        cfg = nopad_twin.load_train_config(config, sets)
        with open(os.path.join(run, "config.toml"), "rb") as f:
            written = nopad_twin._flatten(tomllib.load(f))
        diff = {k: (written.get(k), cfg[k]) for k in cfg if written.get(k) != cfg[k]}
        check(not diff, f"effective config differs from nopad's config.toml: {diff}")

        # 3. Schedule and evaluation steps.
        steps, evals = nopad_twin.read_metrics(os.path.join(run, "metrics.jsonl"))
        sched = nopad_twin.LrSchedule.from_config(cfg)
        got = [s["lr"] for s in steps]
        want = [sched.lr(s["step"] - 1) for s in steps]
        check(len(got) == 12 and all(abs(a - b) <= 1e-12 * max(1, abs(b)) for a, b in zip(got, want)),
              f"per-step lr: nopad {got}, Python {want}")
        check(got[0] == 0 and got[1] == 0 and got[2] > 0 and got[-1] == 0, f"the schedule's shape: {got}")
        interval = nopad_twin.eval_interval(cfg)
        due = [k for k in range(1, 13) if nopad_twin.eval_due((k - 1) * 16, k * 16, interval)]
        if due[-1] != 12:
            due.append(12)  # the final evaluation
        check([e["step"] for e in evals] == due, f"eval steps: nopad {[e['step'] for e in evals]}, Python {due}")
        check(all(e["eval_samples"] == 24 for e in evals), "eval.max_samples caps the eval set")
        check(nopad_twin.mlperf_eval_interval(448) == 150_000 and nopad_twin.mlperf_eval_interval(3072) == 175_000,
              "MLPerf's eval interval rule")

        # 4. Weights in and out.
        ckpt = os.path.join(run, "checkpoints", "step_00000001")
        raw = nopad_twin.read_safetensors(os.path.join(ckpt, "model.safetensors"))
        layout = nopad_twin.param_layout(mc)
        check(set(raw) == {n for n, _, _, _ in layout} and all(tuple(raw[n].shape) == s for n, s, _, _ in layout),
              "nopad's checkpoint tensors are param_layout's names and shapes")
        loaded = nopad_twin.load_hf_weights(ckpt, mc)
        same = [n for n in init if np.array_equal(init[n], loaded[n])]
        check(len(same) == len(init), f"after a step at lr 0 nopad holds the written weights: "
              f"{len(init) - len(same)} tensors differ")
        moved = nopad_twin.load_hf_weights(os.path.join(run, "checkpoints", "step_00000012"), mc)
        check(not np.array_equal(moved["cls.predictions.bias"], init["cls.predictions.bias"]),
              "later steps do move the weights (the comparison above can fail)")
        with open(os.path.join(ckpt, "config.json")) as f:
            nopad_cfg = json.load(f)
        check(all(nopad_cfg[k] == mc[k] for k in nopad_twin.HF_CONFIG_DEFAULTS),
              "nopad's config.json matches read_hf_config")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if failures:
        print(f"{len(failures)} failure(s)")
        sys.exit(1)
    print("test_twin_config: all checks passed")


if __name__ == "__main__":
    main()
