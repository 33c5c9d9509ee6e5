"""`nopad convert --from-tfrecord`: the MLPerf reference's pre-training TFRecord files (tests/data/tfrecord, written
by TensorFlow) -> shards that hold exactly the instances the records were made from (expected.json, read back with
python/nopad_shards.py); a bad record fails the whole conversion and leaves no shard.

`nopad convert --from-tf-checkpoint`: a TensorFlow BERT checkpoint (tests/data/tf-bert-checkpoint, written by
TensorFlow; scripts/make_tf_fixtures.py) -> a Hugging Face BertForPreTraining folder. The converted tensors equal
the values numpy computed for the fixture (expected.safetensors), config.json carries the checkpoint's
bert_config.json, `nopad eval` loads the folder; an existing model is kept unless --overwrite, a damaged checkpoint
or a missing config fails with a message and a non-zero exit and leaves the output folder as it was. Run by CTest
with NOPAD_BINARY and NOPAD_SOURCE_DIR set."""
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

import nopad_shards
from nopad_twin import read_safetensors

from nopad_checks import check, failures

NOPAD = os.environ["NOPAD_BINARY"]
SRC = os.environ["NOPAD_SOURCE_DIR"]
FIXTURE = os.path.join(SRC, "tests/data/tf-bert-checkpoint")
VOCAB = os.path.join(SRC, "data/vocab/bert-uncased-vocab.txt")


def convert(*args):
    """`nopad convert` run from another folder than the source tree (the default vocabulary is not found there)."""
    return subprocess.run([NOPAD, "convert", *args], capture_output=True, text=True, cwd=tempfile.gettempdir())


def snapshot(folder):
    return {f: open(os.path.join(folder, f), "rb").read() for f in sorted(os.listdir(folder))}


def check_tfrecord(tmp):
    records = os.path.join(SRC, "tests/data/tfrecord")
    shards = os.path.join(tmp, "tfrecord-shards")
    r = convert("--from-tfrecord", os.path.join(records, "sample.tfrecord"), os.path.join(records, "sample.tfrecord"),
                "--output", shards, "--seqs-per-shard", "30", "--vocab", VOCAB)
    check(r.returncode == 0, f"convert --from-tfrecord: exit {r.returncode}: {r.stderr[-500:]}")
    if r.returncode != 0:
        return
    want = json.load(open(os.path.join(records, "expected.json"))) * 2
    got = list(nopad_shards.open_dataset(shards))
    check(len(got) == len(want), f"{len(got)} samples, expected {len(want)}")
    for i, (g, w) in enumerate(zip(got, want)):
        same = ([int(t) for t in g["tokens"]] == w["tokens"] and int(g["a_length"]) == w["a_length"] and
                [int(p) for p in g["mlm_positions"]] == w["mlm_positions"] and
                [int(x) for x in g["mlm_labels"]] == w["mlm_labels"] and int(g["nsp_label"]) == w["nsp_label"])
        check(same, f"sample {i} differs from the instance its record was made from")
    manifest = json.load(open(os.path.join(shards, "dataset.json")))
    check(manifest["source"] == "tfrecord" and manifest["num_seqs"] == 80 and manifest["num_shards"] == 3 and
          manifest["inputs"][0]["layout"] == "tfrecord", f"dataset.json: {manifest}")

    # One bad record fails the conversion: the message names file, record and feature; nothing is written.
    fresh = os.path.join(tmp, "tfrecord-bad")
    r = convert("--from-tfrecord", os.path.join(records, "sample.tfrecord"),
                os.path.join(records, "bad-segments.tfrecord"), "--output", fresh, "--vocab", VOCAB)
    check(r.returncode != 0 and "bad-segments.tfrecord, feature 'segment_ids', record 1: no segment-B tokens"
          in r.stderr, f"bad record: exit {r.returncode}: {r.stderr}")
    check(not os.path.exists(fresh) or os.listdir(fresh) == [], f"a failed conversion left {os.listdir(fresh)}")
    r = convert("--from-tfrecord", os.path.join(records, "sample.tfrecord"), "--from-hdf5", "x.hdf5",
                "--output", fresh)
    check(r.returncode != 0 and "excludes" in r.stderr.lower(), f"two data sources: {r.stderr}")


def main():
    tmp = tempfile.mkdtemp(prefix="nopad-tfconv-")
    check_tfrecord(tmp)
    out = os.path.join(tmp, "hf")

    # The folder form (through its `checkpoint` file), config found beside the checkpoint.
    r = convert("--from-tf-checkpoint", FIXTURE, "--output", out)
    check(r.returncode == 0, f"convert: exit {r.returncode}: {r.stderr[-500:]}")
    check("46 tensors loaded, 90 optimizer slots left out" in r.stdout, f"convert summary: {r.stdout}")
    got = read_safetensors(os.path.join(out, "model.safetensors"))
    want = read_safetensors(os.path.join(FIXTURE, "expected.safetensors"))
    want = {k: v for k, v in want.items() if not k.startswith("extra.")}
    check(sorted(got) == sorted(want), f"tensor names: {sorted(set(got) ^ set(want))}")
    for name in sorted(set(got) & set(want)):
        check(got[name].shape == want[name].shape and np.array_equal(got[name], want[name]),
              f"tensor {name} differs from the expected values")
    config = json.load(open(os.path.join(out, "config.json")))
    tf_config = json.load(open(os.path.join(FIXTURE, "bert_config.json")))
    for key, value in tf_config.items():
        check(config.get(key) == value, f"config.json {key}: {config.get(key)} vs bert_config.json {value}")
    check(config.get("architectures") == ["BertForPreTraining"], f"config.json architectures: {config}")
    check(sorted(os.listdir(out)) == ["config.json", "model.safetensors", "special_tokens_map.json", "tokenizer.json",
                                      "tokenizer_config.json", "vocab.txt"], f"output folder: {os.listdir(out)}")

    # nopad eval loads the converted folder (the fixture's config fits shards of up to 128 tokens).
    data = os.path.join(tmp, "data")
    p = subprocess.run([NOPAD, "prepare", "--input", os.path.join(SRC, "data/wiki-sample/wiki_00"), "--vocab",
                        os.path.join(SRC, "data/vocab/bert-uncased-vocab.txt"), "--output", data,
                        "--max-seq-length", "128", "--dupe-factor", "1", "--quiet"], capture_output=True, text=True)
    check(p.returncode == 0, f"prepare: {p.stderr[-300:]}")
    e = subprocess.run([NOPAD, "eval", "--checkpoint", out, "--data", data, "--max-samples", "16", "--threads", "1"],
                       capture_output=True, text=True)
    check(e.returncode == 0, f"eval of the converted folder: exit {e.returncode}: {e.stderr[-300:]}")
    if e.returncode == 0:
        res = json.loads(e.stdout.strip().splitlines()[-1])
        check(res["samples"] == 16 and math.isfinite(res["loss"]) and res["loss"] > 0, f"eval result: {res}")

    # An existing model is kept without --overwrite; the prefix and .index forms convert the same.
    before = snapshot(out)
    r = convert("--from-tf-checkpoint", os.path.join(FIXTURE, "model.ckpt-3"), "--output", out)
    check(r.returncode != 0 and "already holds a model" in r.stderr and "--overwrite" in r.stderr,
          f"second convert without --overwrite: exit {r.returncode}: {r.stderr}")
    check(snapshot(out) == before, "the refused convert changed the output folder")
    r = convert("--from-tf-checkpoint", os.path.join(FIXTURE, "model.ckpt-3.index"), "--output", out, "--overwrite")
    check(r.returncode == 0 and snapshot(out) == before, f"--overwrite from the .index form: {r.stderr}")

    # A damaged checkpoint: the error names the tensor, the output folder is untouched, nothing is left behind.
    bad = os.path.join(tmp, "bad")
    shutil.copytree(FIXTURE, bad)
    os.remove(os.path.join(bad, "expected.safetensors"))
    data_file = os.path.join(bad, "model.ckpt-3.data-00000-of-00001")
    blob = bytearray(open(data_file, "rb").read())
    blob[len(blob) // 2] ^= 0x40
    open(data_file, "wb").write(blob)
    r = convert("--from-tf-checkpoint", bad, "--output", out, "--overwrite")
    check(r.returncode != 0 and "does not match its checksum" in r.stderr, f"damaged checkpoint: {r.stderr}")
    check(snapshot(out) == before, "a failed convert changed the output folder")

    # No config beside the checkpoint and none given; a wrong one; the HDF5 options mixed in.
    os.remove(os.path.join(bad, "bert_config.json"))
    fresh = os.path.join(tmp, "fresh")
    r = convert("--from-tf-checkpoint", bad, "--output", fresh)
    check(r.returncode != 0 and "no model config: pass --config FILE" in r.stderr, f"no config: {r.stderr}")
    r = convert("--from-tf-checkpoint", FIXTURE, "--config", os.path.join(SRC, "data/configs/bert-tiny.json"),
                "--output", fresh)
    check(r.returncode != 0 and "has shape [30522, 8], the model (model.config) expects [30522, 128]" in r.stderr,
          f"a config that does not fit: {r.stderr}")
    check(not os.path.exists(fresh) or os.listdir(fresh) == [], f"failed converts left files: {fresh}")
    r = convert("--from-tf-checkpoint", FIXTURE, "--from-hdf5", "x.hdf5", "--output", fresh)
    check(r.returncode != 0 and "excludes" in r.stderr.lower(), f"both sources: {r.stderr}")
    r = convert("--output", fresh)
    check(r.returncode != 0 and "nothing to convert" in r.stderr, f"no source: {r.stderr}")

    shutil.rmtree(tmp)
    if failures:
        sys.exit(f"{len(failures)} check(s) failed")
    print("test_tf_convert: all checks passed")


if __name__ == "__main__":
    main()
