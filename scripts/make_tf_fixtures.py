#!/usr/bin/env python3
"""Writes the fixtures of nopad's TensorFlow-format import tests, with TensorFlow itself:
tests/data/tf-bert-checkpoint/ (a BERT checkpoint, below) and tests/data/tfrecord/ (pre-training TFRecord files,
see write_tfrecords).

Needs TensorFlow (any 2.x; not a test dependency: the fixture is committed). The checkpoint is saved by TensorFlow's
own tf.compat.v1 Saver, in the format of MLPerf's phase-1 checkpoint (model.ckpt-28252): the variable names of
google-research/bert's modeling.py and run_pretraining.py, dense kernels stored [in, out], optimizer slots
`<variable>/adam_m` and `<variable>/adam_v`, a `global_step`, plus two non-BERT tensors in float16 and bfloat16.

Beside it, `expected.safetensors` holds the same values under Hugging Face BertForPreTraining names and shapes
(kernels transposed to [out, in]), computed here with numpy and written by python/nopad_twin.py's safetensors
writer, so the tests compare nopad's reader and name mapping against values that neither produced.

Values are patterned, not random (element i of tensor k is ((37 i + 101 k) mod 251 - 125) / 500): every tensor
differs from every other and from its own transpose, and git stores the 1 MB of float32 compactly.

A second, tiny checkpoint in `object-based/` is what tf.train.Checkpoint (Keras) writes instead: names that follow
the Python objects and a string tensor `_CHECKPOINTABLE_OBJECT_GRAPH`, which nopad must refuse with a message.

Usage: python3 scripts/make_tf_fixtures.py   (writes both folders below tests/data)
"""
import json
import os
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from nopad_twin import write_safetensors  # noqa: E402 (after the path it lives on)

CONFIG = {
    "attention_probs_dropout_prob": 0.1,
    "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1,
    "hidden_size": 8,
    "initializer_range": 0.02,
    "intermediate_size": 16,
    "max_position_embeddings": 128,
    "num_attention_heads": 2,
    "num_hidden_layers": 2,
    "type_vocab_size": 2,
    "vocab_size": 30522,
}


def bert_variables(c):
    """(TF name, TF shape, HF name, transpose) for every variable of BERT's pre-training graph."""
    h, f, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    out = [
        ("bert/embeddings/word_embeddings", [v, h], "bert.embeddings.word_embeddings.weight", False),
        ("bert/embeddings/token_type_embeddings", [c["type_vocab_size"], h],
         "bert.embeddings.token_type_embeddings.weight", False),
        ("bert/embeddings/position_embeddings", [c["max_position_embeddings"], h],
         "bert.embeddings.position_embeddings.weight", False),
        ("bert/embeddings/LayerNorm/gamma", [h], "bert.embeddings.LayerNorm.weight", False),
        ("bert/embeddings/LayerNorm/beta", [h], "bert.embeddings.LayerNorm.bias", False),
    ]

    def dense(tf_prefix, hf_prefix, n_in, n_out):
        return [(tf_prefix + "/kernel", [n_in, n_out], hf_prefix + ".weight", True),
                (tf_prefix + "/bias", [n_out], hf_prefix + ".bias", False)]

    def layer_norm(tf_prefix, hf_prefix):
        return [(tf_prefix + "/gamma", [h], hf_prefix + ".weight", False),
                (tf_prefix + "/beta", [h], hf_prefix + ".bias", False)]

    for l in range(c["num_hidden_layers"]):
        t, p = f"bert/encoder/layer_{l}", f"bert.encoder.layer.{l}"
        for part in ("query", "key", "value"):
            out += dense(f"{t}/attention/self/{part}", f"{p}.attention.self.{part}", h, h)
        out += dense(f"{t}/attention/output/dense", f"{p}.attention.output.dense", h, h)
        out += layer_norm(f"{t}/attention/output/LayerNorm", f"{p}.attention.output.LayerNorm")
        out += dense(f"{t}/intermediate/dense", f"{p}.intermediate.dense", h, f)
        out += dense(f"{t}/output/dense", f"{p}.output.dense", f, h)
        out += layer_norm(f"{t}/output/LayerNorm", f"{p}.output.LayerNorm")
    out += dense("bert/pooler/dense", "bert.pooler.dense", h, h)
    out += dense("cls/predictions/transform/dense", "cls.predictions.transform.dense", h, h)
    out += layer_norm("cls/predictions/transform/LayerNorm", "cls.predictions.transform.LayerNorm")
    out += [("cls/predictions/output_bias", [v], "cls.predictions.bias", False),
            ("cls/seq_relationship/output_weights", [2, h], "cls.seq_relationship.weight", False),
            ("cls/seq_relationship/output_bias", [2], "cls.seq_relationship.bias", False)]
    return out


def pattern(shape, k):
    i = np.arange(int(np.prod(shape)), dtype=np.int64)
    return (((37 * i + 101 * k) % 251 - 125) / 500.0).astype(np.float32).reshape(shape)


def write_object_based(out):
    """tf.train.Checkpoint runs eagerly: a fresh interpreter, since this one has eager execution disabled."""
    os.makedirs(out, exist_ok=True)
    code = ("import numpy as np, tensorflow as tf\n"
            "class Dense(tf.Module):\n"
            "    def __init__(self):\n"
            "        self.kernel = tf.Variable(np.full((2, 3), 0.5, np.float32))\n"
            f"tf.train.Checkpoint(model=Dense()).write({os.path.join(out, 'ckpt')!r})\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def write_checkpoint(out):
    os.makedirs(out, exist_ok=True)
    import tensorflow as tf  # imported late: --help-free script, TensorFlow is only needed here
    tf.compat.v1.disable_eager_execution()

    specs = bert_variables(CONFIG)
    expected = {}
    graph = tf.Graph()
    with graph.as_default():
        var_list = {}
        for k, (tf_name, shape, hf_name, transpose) in enumerate(specs):
            value = pattern(shape, k)
            var_list[tf_name] = tf.compat.v1.Variable(value, name=tf_name.replace("/", "_"))
            expected[hf_name] = value.T if transpose else value
            if tf_name != "bert/embeddings/word_embeddings":  # slots of the others: what an optimizer leaves
                for slot, offset in (("adam_m", 1000), ("adam_v", 2000)):
                    var_list[f"{tf_name}/{slot}"] = tf.compat.v1.Variable(pattern(shape, k + offset))
        var_list["global_step"] = tf.compat.v1.Variable(np.int64(28252))
        half = pattern([3, 5], 3000)
        bf16 = pattern([7], 3001)
        var_list["extra/half"] = tf.compat.v1.Variable(half.astype(np.float16))
        var_list["extra/bfloat16"] = tf.compat.v1.Variable(tf.constant(bf16, dtype=tf.bfloat16))
        expected["extra.half"] = half.astype(np.float16).astype(np.float32)
        expected["extra.bfloat16"] = tf.constant(bf16, dtype=tf.bfloat16)  # rounded below, in the session
        saver = tf.compat.v1.train.Saver(var_list=var_list, write_version=tf.compat.v1.train.SaverDef.V2)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            expected["extra.bfloat16"] = sess.run(tf.cast(expected["extra.bfloat16"], tf.float32))
            prefix = saver.save(sess, os.path.join(out, "model.ckpt"), global_step=3, write_meta_graph=False)
    with open(os.path.join(out, "bert_config.json"), "w") as fh:
        json.dump(CONFIG, fh, indent=2, sort_keys=True)
        fh.write("\n")
    # The `checkpoint` file TensorFlow writes holds the absolute path; a relative one is what a copied folder has.
    with open(os.path.join(out, "checkpoint"), "w") as fh:
        fh.write('model_checkpoint_path: "model.ckpt-3"\nall_model_checkpoint_paths: "model.ckpt-3"\n')
    write_safetensors(os.path.join(out, "expected.safetensors"), {k: expected[k] for k in sorted(expected)})
    write_object_based(os.path.join(out, "object-based"))
    reader = tf.train.load_checkpoint(prefix)
    print(f"wrote {prefix} ({len(reader.get_variable_to_shape_map())} tensors, TensorFlow {tf.__version__}) and "
          f"expected.safetensors ({len(expected)} tensors)")


def synthetic_instance(rng, max_seq_length, max_predictions):
    """A well-formed instance as create_pretraining_data.py makes them: [CLS] A [SEP] B [SEP], masked positions
    ascending (never [CLS]/[SEP]), labels the original ids."""
    n = int(rng.integers(8, max_seq_length + 1))
    a = int(rng.integers(3, n - 2))  # [CLS] + A + [SEP] = a tokens
    tokens = [101] + [int(t) for t in rng.integers(1000, 30522, a - 2)] + [102] + \
        [int(t) for t in rng.integers(1000, 30522, n - a - 1)] + [102]
    candidates = [i for i in range(1, n - 1) if i != a - 1]
    k = min(max_predictions, max(1, int(round(0.15 * n))))
    positions = sorted(int(p) for p in rng.choice(candidates, size=k, replace=False))
    labels = [tokens[p] for p in positions]
    for p in positions:
        tokens[p] = 103 if rng.random() < 0.8 else int(rng.integers(1000, 30522))
    return {"tokens": tokens, "a_length": a, "mlm_positions": positions, "mlm_labels": labels,
            "nsp_label": int(rng.integers(0, 2))}


def example(tf, inst, max_seq_length, max_predictions, extra=None, drop=(), float_ids=False, weights=None):
    """The tf.train.Example create_pretraining_data.py writes for `inst` (padded as it pads)."""
    n, k = len(inst["tokens"]), len(inst["mlm_positions"])
    pad = max_seq_length - n
    seg = [0] * inst["a_length"] + [1] * (n - inst["a_length"])
    ints = lambda v: tf.train.Feature(int64_list=tf.train.Int64List(value=v))
    floats = lambda v: tf.train.Feature(float_list=tf.train.FloatList(value=v))
    f = {
        "input_ids": floats([float(t) for t in inst["tokens"]] + [0.0] * pad) if float_ids
        else ints(inst["tokens"] + [0] * pad),
        "input_mask": ints([1] * n + [0] * pad),
        "segment_ids": ints(seg + [0] * pad),
        "masked_lm_positions": ints(inst["mlm_positions"] + [0] * (max_predictions - k)),
        "masked_lm_ids": ints(inst["mlm_labels"] + [0] * (max_predictions - k)),
        "masked_lm_weights": floats(weights if weights is not None else [1.0] * k + [0.0] * (max_predictions - k)),
        "next_sentence_labels": ints([inst["nsp_label"]]),
    }
    f.update(extra or {})
    for name in drop:
        del f[name]
    return tf.train.Example(features=tf.train.Features(feature=f)).SerializeToString()


def write_tfrecords(out):
    """sample.tfrecord: 40 instances (max_seq_length 64, 10 predictions) with an extra feature nopad ignores, and
    expected.json, the instances themselves; bad-*.tfrecord: one good record, then one that is wrong in one way."""
    import tensorflow as tf
    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(12345)
    insts = [synthetic_instance(rng, 64, 10) for _ in range(40)]
    with tf.io.TFRecordWriter(os.path.join(out, "sample.tfrecord")) as w:
        for i, inst in enumerate(insts):
            extra = {"doc_id": tf.train.Feature(bytes_list=tf.train.BytesList(value=[b"doc%d" % i]))}
            w.write(example(tf, inst, 64, 10, extra=extra))
    with open(os.path.join(out, "expected.json"), "w") as fh:
        json.dump(insts, fh)
        fh.write("\n")
    good = example(tf, insts[0], 64, 10)
    bad = {
        "missing-feature": example(tf, insts[1], 64, 10, drop=["segment_ids"]),
        "float-ids": example(tf, insts[1], 64, 10, float_ids=True),
        "weights": example(tf, insts[1], 64, 10, weights=[1.0] * (len(insts[1]["mlm_positions"]) - 1) + [0.0] *
                           (11 - len(insts[1]["mlm_positions"]))),
        "segments": example(tf, dict(insts[1], a_length=len(insts[1]["tokens"])), 64, 10),
    }
    for name, record in bad.items():
        with tf.io.TFRecordWriter(os.path.join(out, f"bad-{name}.tfrecord")) as w:
            w.write(good)
            w.write(record)
    with tf.io.TFRecordWriter(os.path.join(out, "sample.tfrecord.gz"), options="GZIP") as w:
        w.write(good)
    print(f"wrote {out}: sample.tfrecord ({len(insts)} records), expected.json, {len(bad)} bad-*.tfrecord, "
          "sample.tfrecord.gz")


def main():
    data = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data")
    write_checkpoint(os.path.join(data, "tf-bert-checkpoint"))
    write_tfrecords(os.path.join(data, "tfrecord"))


if __name__ == "__main__":
    main()
