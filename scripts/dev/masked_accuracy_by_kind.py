"""Masked-LM accuracy of a checkpoint split by what the input holds at each masked position: [MASK] (80% of them in
BERT's recipe), the original token kept (10%), a random token (10%). A model that has only learnt to copy what it sees
scores high on the kept ones and the frequency baseline on [MASK]. A float64 numpy replay of BertForPreTraining's MLM
head (dropout off), no torch needed.
Usage: python3 scripts/dev/masked_accuracy_by_kind.py CHECKPOINT EVAL_DATA [SAMPLES]   (from the repository root)"""
import json
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
import nopad_shards  # noqa: E402
import nopad_twin  # noqa: E402


def layer_norm(x, g, b, eps):
    m = x.mean(-1, keepdims=True)
    return (x - m) / np.sqrt(((x - m) ** 2).mean(-1, keepdims=True) + eps) * g + b


def gelu(x):
    return 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))


ck, data = sys.argv[1], sys.argv[2]
samples = int(sys.argv[3]) if len(sys.argv) > 3 else 300
cfg = json.load(open(ck + "/config.json"))
t = {k: v.astype(np.float64) for k, v in nopad_twin.read_safetensors(ck + "/model.safetensors").items()}
eps, H, nh = cfg["layer_norm_eps"], cfg["hidden_size"], cfg["num_attention_heads"]; d = H // nh
ds = nopad_shards.open_dataset(data)
mask_id = open(os.path.join(ck, "vocab.txt")).read().split("\n").index("[MASK]")
stats = {"mask": [0, 0], "kept": [0, 0], "random": [0, 0]}
for i in range(min(samples, len(ds))):
    s = ds.sample(i)
    ids = np.array(s["tokens"]); L = len(ids); seg = np.array([0] * s["a_length"] + [1] * (L - s["a_length"]))
    p = "bert.embeddings."
    x = t[p+"word_embeddings.weight"][ids] + t[p+"position_embeddings.weight"][:L] + t[p+"token_type_embeddings.weight"][seg]
    x = layer_norm(x, t[p+"LayerNorm.weight"], t[p+"LayerNorm.bias"], eps)
    for l in range(cfg["num_hidden_layers"]):
        p = f"bert.encoder.layer.{l}."
        lin = lambda n, h: h @ t[p+n+".weight"].T + t[p+n+".bias"]
        q, k, v = (lin("attention.self."+n, x).reshape(L, nh, d).transpose(1, 0, 2) for n in ("query", "key", "value"))
        sc = q @ k.transpose(0, 2, 1) / math.sqrt(d); sc = np.exp(sc - sc.max(-1, keepdims=True))
        ctx = ((sc / sc.sum(-1, keepdims=True)) @ v).transpose(1, 0, 2).reshape(L, H)
        a = layer_norm(lin("attention.output.dense", ctx) + x, t[p+"attention.output.LayerNorm.weight"], t[p+"attention.output.LayerNorm.bias"], eps)
        x = layer_norm(lin("output.dense", gelu(lin("intermediate.dense", a))) + a, t[p+"output.LayerNorm.weight"], t[p+"output.LayerNorm.bias"], eps)
    pos = np.array(s["mlm_positions"]); lab = np.array(s["mlm_labels"])
    p = "cls.predictions."
    h = gelu(x[pos] @ t[p+"transform.dense.weight"].T + t[p+"transform.dense.bias"])
    h = layer_norm(h, t[p+"transform.LayerNorm.weight"], t[p+"transform.LayerNorm.bias"], eps)
    pred = (h @ t["bert.embeddings.word_embeddings.weight"].T + t[p+"bias"]).argmax(-1)
    for j, ps in enumerate(pos):
        kind = "mask" if ids[ps] == mask_id else ("kept" if ids[ps] == lab[j] else "random")
        stats[kind][0] += int(pred[j] == lab[j]); stats[kind][1] += 1
tot = sum(v[1] for v in stats.values())
for k, (c, n) in stats.items():
    print(f"{k}: {n} positions ({n/tot:.1%}), accuracy {c/n:.3f}, share of all correct {c/tot:.3f}")
print("overall", sum(v[0] for v in stats.values()) / tot)
