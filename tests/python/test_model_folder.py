"""Model folders carry their tokenizer, and `nopad fill-mask` computes what the model says.

1. Uncased: `nopad prepare` (BERT's uncased vocabulary) copies vocab.txt into the dataset folder; a short `nopad train`
   writes a checkpoint holding vocab.txt, tokenizer_config.json, special_tokens_map.json and tokenizer.json, each
   checksummed in trainer_state.json; `transformers.AutoTokenizer.from_pretrained(checkpoint)` tokenizes every line
   of the held-out data/wiki-sample/wiki_03 to exactly the ids of `nopad tokenize`, and the `tokenizers` package reads
   tokenizer.json to the same ids.
2. Cased: a cased WordPiece vocabulary trained here with `tokenizers` on wiki_00..02 (capitalised tokens) makes
   `prepare` keep the case (dataset.json do_lower_case false, found by the vocabulary's casing), the checkpoint says
   do_lower_case false, and AutoTokenizer, `tokenizers`' BertWordPieceTokenizer(lowercase=False) and `nopad tokenize`
   agree token for token on wiki_03.
3. `nopad convert --from-tf-checkpoint` writes the tokenizer too (nopad's default uncased vocabulary, matching the
   fixture's vocab_size), and AutoTokenizer loads it.
4. `nopad fill-mask` on the trained checkpoint: the top-k tokens and probabilities equal a numpy forward of the same
   weights (float64, written here from the model's definition: embeddings + LayerNorm, post-LN encoder layers with
   erf GELU, the MLM head's transform and tied decoder), sorted, within float32 rounding; a text without [MASK] fails
   naming it; --json gives the same numbers.
Needs numpy, tokenizers and transformers (without torch), which scripts/setup.sh installs."""
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

from nopad_checks import check, failures

NOPAD = os.environ["NOPAD_BINARY"]
SRC = os.environ["NOPAD_SOURCE_DIR"]
sys.path.insert(0, os.path.join(SRC, "python"))
import nopad_twin  # noqa: E402

WIKI = os.path.join(SRC, "data", "wiki-sample")
UNCASED = os.path.join(SRC, "data", "vocab", "bert-uncased-vocab.txt")
TOKENIZER_FILES = ["vocab.txt", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.json"]


def run(*args, **kw):
    return subprocess.run([NOPAD, *args], capture_output=True, text=True, **kw)


def prepare(out, vocab, *extra):
    r = run("prepare", "--input", os.path.join(WIKI, "wiki_00"), "--vocab", vocab, "--output", out,
            "--max-seq-length", "64", "--max-predictions", "10", "--dupe-factor", "1", "--quiet", *extra)
    check(r.returncode == 0, f"prepare {out}: {r.stderr}")


def train(run_dir, data, steps=8):
    r = run("train", "--config", os.path.join(SRC, "configs", "bert-tiny-sample.toml"), "--overwrite",
            "--set", f"run_dir={run_dir}", "--set", f"data.train={data}", "--set", "data.eval=",
            "--set", "train.device=cpu", "--set", "train.global_batch=8", "--set", f"train.max_steps={steps}",
            "--set", "checkpoint.interval_steps=0", "--set", "optim.lr=0.01")
    check(r.returncode == 0, f"train {run_dir}: {r.stderr[-400:]}")
    return os.path.join(run_dir, "checkpoints", open(os.path.join(run_dir, "checkpoints", "latest")).read().strip())


def held_out_lines():
    lines = [l for l in open(os.path.join(WIKI, "wiki_03"), encoding="utf-8").read().split("\n") if l.strip()]
    return lines


def nopad_ids(vocab, lines, *extra):
    r = subprocess.run([NOPAD, "tokenize", "--vocab", vocab, *extra], input="\n".join(lines) + "\n",
                       capture_output=True, text=True)
    check(r.returncode == 0, f"tokenize: {r.stderr}")
    return [[int(t) for t in l.split()] for l in r.stdout.split("\n")[:len(lines)]]


def compare(name, want, got, lines):
    bad = [i for i in range(len(lines)) if want[i] != got[i]]
    check(not bad, f"{name}: {len(bad)} of {len(lines)} lines differ from nopad tokenize; first: "
                   f"{lines[bad[0]][:120] if bad else ''!r}")
    return len(bad)


def check_tokenizer_files(ckpt):
    state = json.load(open(os.path.join(ckpt, "trainer_state.json")))
    for f in TOKENIZER_FILES:
        check(os.path.isfile(os.path.join(ckpt, f)), f"{ckpt} holds {f}")
        check(f in state["files"], f"trainer_state.json lists {f} with its checksum")


def uncased_case(tmp):
    from transformers import AutoTokenizer
    from tokenizers import Tokenizer
    data = os.path.join(tmp, "data-uncased")
    prepare(data, UNCASED)
    check(open(os.path.join(data, "vocab.txt")).read() == open(UNCASED).read(), "prepare copies vocab.txt")
    manifest = json.load(open(os.path.join(data, "dataset.json")))
    check(manifest.get("do_lower_case") is True and manifest.get("vocab_file") == "vocab.txt",
          f"dataset.json records the casing and the vocabulary file: {manifest.get('do_lower_case')}")
    ckpt = train(os.path.join(tmp, "run-uncased"), data)
    check_tokenizer_files(ckpt)
    lines = held_out_lines()
    want = nopad_ids(UNCASED, lines)
    tok = AutoTokenizer.from_pretrained(ckpt)
    check(tok.do_lower_case if hasattr(tok, "do_lower_case") else True, "AutoTokenizer is uncased")
    check(len(tok) == 30522, f"AutoTokenizer has the whole vocabulary: {len(tok)}")
    got = [tok(l, add_special_tokens=False)["input_ids"] for l in lines]
    n = compare("AutoTokenizer (uncased checkpoint)", want, got, lines)
    fast = Tokenizer.from_file(os.path.join(ckpt, "tokenizer.json"))
    got = [e.ids[1:-1] for e in fast.encode_batch(lines)]  # the post-processor adds [CLS] ... [SEP]
    compare("tokenizers on tokenizer.json", want, got, lines)
    print(f"uncased: {len(lines)} held-out lines, {sum(map(len, want))} tokens, {n} differences")
    return ckpt, data


def cased_case(tmp):
    from transformers import AutoTokenizer
    from tokenizers import BertWordPieceTokenizer
    vocab_dir = os.path.join(tmp, "cased-vocab")
    os.makedirs(vocab_dir)
    trainer = BertWordPieceTokenizer(lowercase=False, strip_accents=False)
    trainer.train([os.path.join(WIKI, f"wiki_0{i}") for i in range(3)], vocab_size=8000, min_frequency=2,
                  special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    trainer.save_model(vocab_dir)
    vocab = os.path.join(vocab_dir, "vocab.txt")
    tokens = open(vocab).read().split("\n")
    check(sum(any("A" <= c <= "Z" for c in t) for t in tokens) > 0.05 * len(tokens),
          "the trained vocabulary is cased (capitalised tokens)")
    data = os.path.join(tmp, "data-cased")
    prepare(data, vocab)
    check(json.load(open(os.path.join(data, "dataset.json"))).get("do_lower_case") is False,
          "prepare keeps the case with a cased vocabulary (auto)")
    ckpt = train(os.path.join(tmp, "run-cased"), data)
    check_tokenizer_files(ckpt)
    check(json.load(open(os.path.join(ckpt, "tokenizer_config.json")))["do_lower_case"] is False,
          "the checkpoint's tokenizer_config.json says do_lower_case false")
    lines = held_out_lines()
    want = nopad_ids(vocab, lines)
    check(want != nopad_ids(vocab, lines, "--do-lower-case", "true"), "lower-casing changes the cased tokenization")
    tok = AutoTokenizer.from_pretrained(ckpt)
    got = [tok(l, add_special_tokens=False)["input_ids"] for l in lines]
    n = compare("AutoTokenizer (cased checkpoint)", want, got, lines)
    ref = BertWordPieceTokenizer(vocab, lowercase=False, strip_accents=False)
    got = [e.ids[1:-1] for e in ref.encode_batch(lines)]
    compare("tokenizers BertWordPieceTokenizer(lowercase=False)", want, got, lines)
    print(f"cased: {len(tokens)}-token vocabulary, {len(lines)} held-out lines, {n} differences")


def convert_case(tmp):
    from transformers import AutoTokenizer
    out = os.path.join(tmp, "converted")
    r = run("convert", "--from-tf-checkpoint", os.path.join(SRC, "tests", "data", "tf-bert-checkpoint"),
            "--output", out)
    check(r.returncode == 0, f"convert: {r.stderr}")
    for f in TOKENIZER_FILES:
        check(os.path.isfile(os.path.join(out, f)), f"convert --from-tf-checkpoint writes {f}")
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("paris is the capital of france.", add_special_tokens=False)["input_ids"]
    check(ids == nopad_ids(UNCASED, ["paris is the capital of france."])[0] and 100 not in ids,
          f"the converted folder's tokenizer is BERT's uncased one: {ids}")


# ---- a float64 numpy forward of BertForPreTraining's MLM head (the definition fill-mask must match)
def layer_norm(x, g, b, eps):
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) / np.sqrt(v + eps) * g + b


def gelu(x):
    return 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))


def mlm_probs(ckpt, ids, mask_positions):
    cfg = json.load(open(os.path.join(ckpt, "config.json")))
    t = {k: v.astype(np.float64) for k, v in nopad_twin.read_safetensors(os.path.join(ckpt, "model.safetensors")).items()}
    eps, H, nh = cfg["layer_norm_eps"], cfg["hidden_size"], cfg["num_attention_heads"]
    L, d = len(ids), H // nh
    p = "bert.embeddings."
    x = t[p + "word_embeddings.weight"][ids] + t[p + "position_embeddings.weight"][:L] + \
        t[p + "token_type_embeddings.weight"][[0] * L]
    x = layer_norm(x, t[p + "LayerNorm.weight"], t[p + "LayerNorm.bias"], eps)
    for i in range(cfg["num_hidden_layers"]):
        p = f"bert.encoder.layer.{i}."
        lin = lambda name, h: h @ t[p + name + ".weight"].T + t[p + name + ".bias"]  # noqa: E731
        q, k, v = (lin("attention.self." + n, x).reshape(L, nh, d).transpose(1, 0, 2) for n in ("query", "key", "value"))
        s = q @ k.transpose(0, 2, 1) / math.sqrt(d)
        s = np.exp(s - s.max(-1, keepdims=True))
        ctx = ((s / s.sum(-1, keepdims=True)) @ v).transpose(1, 0, 2).reshape(L, H)
        a = layer_norm(lin("attention.output.dense", ctx) + x, t[p + "attention.output.LayerNorm.weight"],
                       t[p + "attention.output.LayerNorm.bias"], eps)
        f = gelu(lin("intermediate.dense", a))
        x = layer_norm(lin("output.dense", f) + a, t[p + "output.LayerNorm.weight"], t[p + "output.LayerNorm.bias"], eps)
    p = "cls.predictions."
    h = x[mask_positions]
    h = gelu(h @ t[p + "transform.dense.weight"].T + t[p + "transform.dense.bias"])
    h = layer_norm(h, t[p + "transform.LayerNorm.weight"], t[p + "transform.LayerNorm.bias"], eps)
    logits = h @ t["bert.embeddings.word_embeddings.weight"].T + t[p + "bias"]
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def fill_mask_case(ckpt):
    texts = ["the city is the [MASK] of the country.", "he was born in [MASK] and [MASK] in 1950."]
    r = run("fill-mask", "--checkpoint", ckpt, "--device", "cpu", "--top-k", "5", "--json", *texts)
    check(r.returncode == 0, f"fill-mask: {r.stderr}")
    answers = [json.loads(l) for l in r.stdout.strip().split("\n")]
    check(len(answers) == 2 and [len(a["masks"]) for a in answers] == [1, 2], f"one answer per text and [MASK]: {r.stdout}")
    vocab = open(os.path.join(ckpt, "vocab.txt")).read().split("\n")
    worst = 0.0
    for text, a in zip(texts, answers):
        ids = [101]
        for i, part in enumerate(text.split("[MASK]")):
            if i:
                ids.append(103)
            if part.strip():
                ids += nopad_ids(UNCASED, [part])[0]
        ids.append(102)
        masks = [i for i, x in enumerate(ids) if x == 103]
        probs = mlm_probs(ckpt, ids, masks)
        for k, cands in enumerate(a["masks"]):
            want = np.argsort(-probs[k], kind="stable")[:5]
            scores = [c["score"] for c in cands]
            check(scores == sorted(scores, reverse=True) and all(0 < s <= 1 for s in scores),
                  f"candidates sorted by probability: {scores}")
            check([c["token"] for c in cands] == list(want) or
                  all(abs(probs[k][c["token"]] - probs[k][w]) < 1e-6 for c, w in zip(cands, want)),
                  f"'{text}' mask {k}: top-5 {[c['token_str'] for c in cands]}, twin {[vocab[w] for w in want]}")
            for c in cands:
                check(c["token_str"] == vocab[c["token"]], "token_str is the vocabulary entry")
                worst = max(worst, abs(c["score"] - probs[k][c["token"]]) / probs[k][c["token"]])
    check(worst < 1e-4, f"fill-mask probabilities match the float64 twin: worst relative error {worst:.2e}")
    r = run("fill-mask", "--checkpoint", ckpt, "--device", "cpu", texts[0])
    check(r.returncode == 0 and "[MASK]:" in r.stdout and answers[0]["filled"] in r.stdout,
          f"plain output shows the filled text and the candidates: {r.stdout}")
    r = run("fill-mask", "--checkpoint", ckpt, "--device", "cpu", "no mask here")
    check(r.returncode == 1 and "has no [MASK]" in r.stderr and r.stderr.count("\n") == 1,
          f"a text without [MASK] is one clear error: {r.stderr}")
    r = run("fill-mask", "--checkpoint", ckpt, "--device", "cpu", input="paris is the [MASK] of france.\n")
    check(r.returncode == 0 and "[MASK]:" in r.stdout, "texts from standard input")
    print(f"fill-mask: worst relative error against the float64 twin {worst:.2e}")


def main():
    tmp = tempfile.mkdtemp(prefix="nopad-modelfolder-")
    try:
        ckpt, _ = uncased_case(tmp)
        fill_mask_case(ckpt)
        cased_case(tmp)
        convert_case(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if failures:
        print(f"{len(failures)} check(s) failed", file=sys.stderr)
        sys.exit(1)
    print("model folder checks passed")


if __name__ == "__main__":
    main()
