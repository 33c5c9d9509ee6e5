"""`nopad prepare --eval-output`: a held-out evaluation set of exactly --eval-samples instances from documents that the
training set never sees (MLPerf's eval protocol). On the shipped wiki sample: the count is exact; training documents
+ held-out documents = all documents; both sets are byte-identical when made again; the eval instances share almost
no 8-grams of text with the training set, while the same documents prepared without holding out share most of
them (the check can fail); bad requests (too many samples, the same folder twice, an existing eval set without
--overwrite) are refused with a message and a non-zero exit. Run by CTest with NOPAD_BINARY, NOPAD_SOURCE_DIR and
PYTHONPATH (python/) set."""
import filecmp
import json
import os
import subprocess
import sys
import tempfile

import nopad_shards

from nopad_checks import check, failures

NOPAD = os.environ["NOPAD_BINARY"]
SRC = os.environ["NOPAD_SOURCE_DIR"]


def prepare(out, *extra):
    cmd = [NOPAD, "prepare", "--input", os.path.join(SRC, "data/wiki-sample"), "--vocab",
           os.path.join(SRC, "data/vocab/bert-uncased-vocab.txt"), "--output", out, "--quiet", *extra]
    return subprocess.run(cmd, capture_output=True, text=True)


def texts(directory):
    """Each instance's original token ids (masked positions restored from their labels)."""
    out = []
    for s in nopad_shards.open_dataset(directory):
        t = [int(x) for x in s["tokens"]]
        for p, label in zip(s["mlm_positions"], s["mlm_labels"]):
            t[int(p)] = int(label)
        out.append(t)
    return out


def grams(instances, n=8, special=(101, 102)):
    g = set()
    for t in instances:
        for i in range(len(t) - n + 1):
            w = tuple(t[i:i + n])
            if not any(x in special for x in w):  # [CLS]/[SEP] joints are not text
                g.add(w)
    return g


def main():
    tmp = tempfile.mkdtemp(prefix="nopad-eval-")
    train, ev = os.path.join(tmp, "train"), os.path.join(tmp, "eval")
    r = prepare(train, "--eval-output", ev, "--eval-samples", "500")
    check(r.returncode == 0, f"prepare with --eval-output: exit {r.returncode}: {r.stderr[-500:]}")
    if r.returncode != 0:
        sys.exit(1)
    print("  " + " | ".join(l.strip() for l in r.stdout.splitlines()))
    em = json.load(open(os.path.join(ev, "dataset.json")))
    tm = json.load(open(os.path.join(train, "dataset.json")))
    eval_set = nopad_shards.open_dataset(ev)
    check(len(eval_set) == 500 and em["num_seqs"] == 500, f"eval set size {len(eval_set)} / {em['num_seqs']}, want 500")
    check(em["candidates"] >= 500, f"candidates {em['candidates']} < 500")
    check(tm["held_out_documents"] == em["documents"] and em["documents"] >= 1, "held-out document counts")
    check("held-out" in em["source"] and os.path.samefile(tm["eval_set"], ev), "manifests name each other")

    plain = os.path.join(tmp, "plain")
    r = prepare(plain)
    check(r.returncode == 0, f"plain prepare: exit {r.returncode}")
    pm = json.load(open(os.path.join(plain, "dataset.json")))
    check(tm["documents"] + em["documents"] == pm["documents"],
          f"documents: training {tm['documents']} + held out {em['documents']} != all {pm['documents']}")
    check(len(nopad_shards.open_dataset(train)) < len(nopad_shards.open_dataset(plain)), "training set not smaller")

    # Deterministic: the same command again gives the same bytes.
    train2, ev2 = os.path.join(tmp, "train2"), os.path.join(tmp, "eval2")
    r = prepare(train2, "--eval-output", ev2, "--eval-samples", "500")
    check(r.returncode == 0, "second run")
    for a, b in ((train, train2), (ev, ev2)):
        shards = sorted(f for f in os.listdir(a) if f.endswith(".nopad"))
        same = shards == sorted(f for f in os.listdir(b) if f.endswith(".nopad")) and all(
            filecmp.cmp(os.path.join(a, f), os.path.join(b, f), shallow=False) for f in shards)
        check(same, f"{os.path.basename(a)} differs between two identical runs")

    # Held out: eval text shares almost no 8-grams with the training text; with the same documents in training
    # (the plain run) it shares most of them.
    eg = grams(texts(ev))
    held = len(eg & grams(texts(train))) / max(1, len(eg))
    control = len(eg & grams(texts(plain))) / max(1, len(eg))
    print(f"  eval 8-grams also in training: {held:.4f} held out, {control:.4f} when not held out")
    check(held < 0.02, f"{held:.4f} of the eval 8-grams occur in the training set")
    check(control > 0.5, f"control: only {control:.4f} of the eval 8-grams occur in a set made from all documents")

    # Refusals: clear message, non-zero exit, nothing written where a dataset stood.
    r = prepare(os.path.join(tmp, "t3"), "--eval-output", os.path.join(tmp, "e3"), "--eval-samples", "100000000")
    check(r.returncode != 0 and "--eval-samples" in r.stderr, f"too many eval samples: {r.returncode} {r.stderr!r}")
    r = prepare(os.path.join(tmp, "t4"), "--eval-output", os.path.join(tmp, "t4"))
    check(r.returncode != 0 and "--eval-output" in r.stderr, f"same folder: {r.returncode} {r.stderr!r}")
    before = open(os.path.join(ev, "dataset.json")).read()
    r = prepare(os.path.join(tmp, "t5"), "--eval-output", ev, "--eval-samples", "300")
    check(r.returncode != 0 and "--overwrite" in r.stderr, f"existing eval set: {r.returncode} {r.stderr!r}")
    check(open(os.path.join(ev, "dataset.json")).read() == before, "the existing eval set was changed")

    if failures:
        sys.exit(1)
    print("test_prepare_eval: all checks passed")


if __name__ == "__main__":
    main()
