#!/usr/bin/env python3
"""Hugging Face compatibility check of nopad checkpoints (needs torch + transformers; not a CTest test).

(a) nopad -> HF: loads a nopad checkpoint folder with transformers.BertForPreTraining.from_pretrained (eval mode,
    float32), builds one padded batch of the first N samples of a shard folder (input_ids, token_type_ids,
    attention_mask, labels = -100 except at the masked positions, next_sentence_label), computes HF's loss and
    compares it with `nopad eval --checkpoint DIR --data SHARDS --max-samples N --batch N`.
(b) HF -> nopad: builds a BertForPreTraining from the same config with a seeded random init, saves it with
    save_pretrained(tmp, safe_serialization=True) and compares `nopad eval --checkpoint tmp` with HF's loss.

    python3 scripts/hf_compat.py --nopad build/nopad --checkpoint RUN/checkpoints/step_00000100 --data SHARDS
    python3 scripts/hf_compat.py --nopad build/nopad --config data/configs/bert-tiny.json --data SHARDS   # (b) only

Prints one JSON object with the numbers; exits 1 when a loss differs by more than --tol (default 1e-4).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch
import transformers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import nopad_shards  # noqa: E402


def padded_batch(shards, n):
    """The first n samples of the shard folder as one padded Hugging Face batch."""
    samples = []
    for s in nopad_shards.open_dataset(shards):
        samples.append(s)
        if len(samples) == n:
            break
    if len(samples) < n:
        raise SystemExit(f"{shards} holds only {len(samples)} samples, fewer than --samples {n}")
    width = max(len(s["tokens"]) for s in samples)
    input_ids = np.zeros((n, width), np.int64)
    token_type_ids = np.zeros((n, width), np.int64)
    attention_mask = np.zeros((n, width), np.int64)
    labels = np.full((n, width), -100, np.int64)
    nsp = np.zeros((n,), np.int64)
    for b, s in enumerate(samples):
        length = len(s["tokens"])
        input_ids[b, :length] = s["tokens"]
        token_type_ids[b, :length] = s["segment_ids"]
        attention_mask[b, :length] = 1
        labels[b, np.asarray(s["mlm_positions"], np.int64)] = np.asarray(s["mlm_labels"], np.int64)
        nsp[b] = s["nsp_label"]
    t = torch.from_numpy
    return dict(input_ids=t(input_ids), token_type_ids=t(token_type_ids), attention_mask=t(attention_mask),
                labels=t(labels), next_sentence_label=t(nsp))


def hf_loss(model, batch):
    model.eval()
    with torch.no_grad():
        out = model(**batch)
    return float(out.loss)


def load_hf(path):
    kwargs = dict(torch_dtype=torch.float32)
    try:
        return transformers.BertForPreTraining.from_pretrained(path, attn_implementation="eager", **kwargs)
    except TypeError:  # older transformers without attn_implementation
        return transformers.BertForPreTraining.from_pretrained(path, **kwargs)


def nopad_eval(binary, checkpoint, shards, n):
    cmd = [binary, "eval", "--checkpoint", str(checkpoint), "--data", str(shards), "--max-samples", str(n),
           "--batch", str(n)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stderr}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nopad", default="build/nopad", help="the nopad binary")
    ap.add_argument("--checkpoint", help="nopad checkpoint folder for check (a); also gives the config of (b)")
    ap.add_argument("--config", default="data/configs/bert-tiny.json",
                    help="config.json for (b) when no --checkpoint is given")
    ap.add_argument("--data", required=True, help="folder of .nopad shards")
    ap.add_argument("--samples", type=int, default=8, help="samples in the batch")
    ap.add_argument("--seed", type=int, default=1234, help="seed of the random init in (b)")
    ap.add_argument("--tol", type=float, default=1e-4, help="largest accepted |loss difference|")
    args = ap.parse_args()

    batch = padded_batch(args.data, args.samples)
    report = {"samples": args.samples, "masked": int((batch["labels"] != -100).sum()), "tol": args.tol}
    ok = True

    if args.checkpoint:  # (a) nopad checkpoint read by Hugging Face
        hf = hf_loss(load_hf(args.checkpoint), batch)
        nop = nopad_eval(args.nopad, args.checkpoint, args.data, args.samples)
        diff = abs(hf - nop["loss"])
        report["nopad_to_hf"] = {"hf_loss": hf, "nopad_loss": nop["loss"], "abs_diff": diff,
                                 "nopad_mlm_loss": nop["mlm_loss"], "nopad_nsp_loss": nop["nsp_loss"]}
        ok &= diff <= args.tol
        config = transformers.BertConfig.from_pretrained(args.checkpoint)
    else:
        config = transformers.BertConfig.from_json_file(args.config)

    # (b) Hugging Face random init read by nopad
    torch.manual_seed(args.seed)
    model = transformers.BertForPreTraining(config).float()
    with tempfile.TemporaryDirectory(prefix="nopad-hf-") as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        hf = hf_loss(model, batch)
        nop = nopad_eval(args.nopad, tmp, args.data, args.samples)
        diff = abs(hf - nop["loss"])
        report["hf_to_nopad"] = {"hf_loss": hf, "nopad_loss": nop["loss"], "abs_diff": diff,
                                 "saved_files": sorted(os.listdir(tmp))}
        ok &= diff <= args.tol

    report["ok"] = bool(ok)
    print(json.dumps(report, indent=2))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
