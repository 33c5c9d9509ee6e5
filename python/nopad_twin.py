"""What `nopad train` does apart from the model, in plain Python + numpy, for scripts/torch_pretrain.py (its PyTorch
twin) and the tools that compare the two:

  * load_train_config(path, sets): nopad's TOML config with `--set key=value` overrides and nopad's defaults
    (TRAIN_DEFAULTS mirrors train_config_schema() in src/train/trainer.cpp; a test compares it with `nopad train
    --help`), every key checked; returns {"section.key": value}.
  * LrSchedule: src/optim/schedule.h (TF reference convention): linear warm-up then polynomial decay to 0.
  * eval_interval / eval_due: when nopad evaluates (crossing a multiple of eval.interval_samples; -1 = MLPerf's rule).
  * read_hf_config / param_layout: the BertForPreTraining tensors in nopad's ParamLayout order (src/model/params.cpp)
    with Hugging Face names and shapes, init kind and the no-weight-decay flag (biases and LayerNorm).
  * init_params_numpy: nopad's initialisation law (truncated normal at 2 std; zeros; ones), not its random stream.
  * read_safetensors / write_safetensors: the checkpoint format nopad reads (init_from) and writes, numpy only.
  * MetricsWriter: metrics.jsonl lines with nopad's field names.
"""
import json
import math
import os
import struct
import tomllib

import numpy as np

# key -> default, as train_config_schema() (types follow the defaults: str, int, float, bool).
TRAIN_DEFAULTS = {
    "run_dir": "", "init_from": "", "model.config": "", "data.train": "", "data.eval": "", "data.vocab": "",
    "data.do_lower_case": "auto", "data.placement": "shared",
    "train.global_batch": 32, "train.grad_accumulation": 1, "train.max_steps": 1000, "train.max_samples": 0,
    "train.seed": 12345, "train.target_mlm_accuracy": 0.0, "train.threads": 0, "train.device": "auto",
    "train.precision": "auto", "train.loss_scale": "auto", "train.loss_scale_init": 65536.0,
    "train.loss_scale_window": 2000,
    "dist.balance": "cost", "dist.cost_per_token": 1.0, "dist.cost_per_token_sq": 0.0, "dist.overlap": True,
    "dist.nccl_max_ctas": 0, "dist.clip": "global", "dist.reduce": "fp32", "dist.timeout_s": 600.0,
    "mllog.submission_org": "nopad", "mllog.submission_platform": "", "mllog.submission_division": "closed",
    "mllog.cache_clear": False, "mllog.stdout": False,
    "optim.name": "lamb", "optim.lr": 1e-3, "optim.beta1": 0.9, "optim.beta2": 0.999, "optim.eps": 1e-6,
    "optim.weight_decay": 0.01, "optim.max_grad_norm": 1.0,
    "schedule.warmup_steps": 0, "schedule.start_warmup_step": 0, "schedule.total_steps": 0, "schedule.power": 1.0,
    "eval.interval_samples": 0, "eval.max_samples": 0, "log.interval_steps": 10, "log.tensorboard": True,
    "log.tensorboard_dir": "",
    "checkpoint.interval_steps": 0, "checkpoint.keep": 3,
}

# Keys naming files or folders: relative values from a config file are relative to its folder, from --set to the
# working directory; both are made absolute (as nopad's Config does).
PATH_KEYS = {"run_dir", "init_from", "model.config", "data.train", "data.eval", "data.vocab", "log.tensorboard_dir"}


class ConfigError(Exception):
    pass


def _flatten(d, prefix=""):
    out = {}
    for k, v in d.items():
        key = prefix + k
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _typed(key, value, where):
    default = TRAIN_DEFAULTS[key]
    if isinstance(default, bool):
        if isinstance(value, str) and value in ("true", "false"):
            return value == "true"
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true or false for {key}, got {value!r}")
    if isinstance(default, int):
        try:
            if isinstance(value, bool) or (isinstance(value, float)):
                raise ValueError
            return int(value)
        except ValueError:
            raise ConfigError(f"{where}: expected an integer for {key}, got {value!r}") from None
    if isinstance(default, float):
        try:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        except ValueError:
            raise ConfigError(f"{where}: expected a number for {key}, got {value!r}") from None
    if not isinstance(value, str):
        raise ConfigError(f"{where}: expected a string for {key}, got {value!r}")
    if len(value) >= 2 and value[0] == value[-1] == '"':
        value = value[1:-1]
    return value


def load_train_config(path, sets=()):
    """nopad's effective training config: defaults, then the file, then each "key=value" of `sets`."""
    with open(path, "rb") as f:
        try:
            raw = _flatten(tomllib.load(f))
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config {path}: {e}") from None
    cfg = dict(TRAIN_DEFAULTS)
    base = os.path.dirname(os.path.abspath(path))
    for k, v in raw.items():
        if k not in TRAIN_DEFAULTS:
            raise ConfigError(f"config {path}: unknown key '{k}'")
        cfg[k] = _resolved(k, _typed(k, v, f"config {path}"), base)
    for s in sets:
        if "=" not in s:
            raise ConfigError(f"--set {s}: expected key=value")
        k, v = (x.strip() for x in s.split("=", 1))
        if k not in TRAIN_DEFAULTS:
            raise ConfigError(f"--set {s}: unknown key '{k}'")
        if v == "" and not isinstance(TRAIN_DEFAULTS[k], str):
            raise ConfigError(f"--set {s}: missing value for {k} (only text keys can be set empty)")
        cfg[k] = _resolved(k, _typed(k, v, f"--set {s}"), os.getcwd())
    return cfg


def _resolved(key, value, base):
    if key in PATH_KEYS and value and not os.path.isabs(value):
        return os.path.normpath(os.path.join(base, value))
    return value


class LrSchedule:
    """nopad's LrSchedule (kTfReference): lr(steps already taken)."""

    def __init__(self, base_lr, warmup_steps=0, start_warmup_step=0, total_steps=1, power=1.0, end_lr=0.0):
        if total_steps <= 0 or warmup_steps < 0 or power <= 0 or base_lr < 0:
            raise ConfigError("lr schedule: total_steps > 0, warmup_steps >= 0, power > 0 and lr >= 0 are required")
        self.base_lr, self.warmup_steps, self.start_warmup_step = base_lr, warmup_steps, start_warmup_step
        self.total_steps, self.power, self.end_lr = total_steps, power, end_lr

    @classmethod
    def from_config(cls, cfg):
        total = cfg["schedule.total_steps"] or cfg["train.max_steps"]
        return cls(cfg["optim.lr"], cfg["schedule.warmup_steps"], cfg["schedule.start_warmup_step"], total,
                   cfg["schedule.power"])

    def lr(self, steps_taken):
        adjusted = steps_taken - self.start_warmup_step
        if self.warmup_steps > 0 and adjusted < self.warmup_steps:
            return self.base_lr * max(adjusted, 0) / self.warmup_steps
        progress = min(max(steps_taken, 0), self.total_steps) / self.total_steps
        return (self.base_lr - self.end_lr) * (1.0 - progress) ** self.power + self.end_lr


def mlperf_eval_interval(global_batch):
    return int(math.floor(0.05 * (230.23 * global_batch + 3_000_000.0) / 25_000.0)) * 25_000


def eval_interval(cfg):
    i = cfg["eval.interval_samples"]
    return mlperf_eval_interval(cfg["train.global_batch"]) if i == -1 else i


def eval_due(samples_before, samples_after, interval):
    """nopad evaluates after a step whose samples cross a multiple of the interval."""
    return interval > 0 and samples_after // interval > samples_before // interval


# --------------------------------------------------------------------------------------------- model description

HF_CONFIG_DEFAULTS = {
    "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072,
    "vocab_size": 30522, "max_position_embeddings": 512, "type_vocab_size": 2, "hidden_dropout_prob": 0.1,
    "attention_probs_dropout_prob": 0.1, "initializer_range": 0.02, "hidden_act": "gelu", "layer_norm_eps": 1e-12,
}
GELU_TANH_NAMES = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


def read_hf_config(path):
    """A Hugging Face config.json (file, or a folder holding one) with nopad's defaults for absent fields."""
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    with open(path) as f:
        j = json.load(f)
    cfg = dict(HF_CONFIG_DEFAULTS)
    cfg.update({k: j[k] for k in HF_CONFIG_DEFAULTS if k in j})
    if cfg["hidden_act"] not in ("gelu",) + GELU_TANH_NAMES:
        raise ConfigError(f"{path}: hidden_act {cfg['hidden_act']!r} is not gelu or its tanh form")
    if cfg["hidden_size"] % cfg["num_attention_heads"]:
        raise ConfigError(f"{path}: hidden_size is not a multiple of num_attention_heads")
    return cfg


def hf_config_json(cfg):
    """config.json text that transformers and nopad load (BertForPreTraining)."""
    out = {"architectures": ["BertForPreTraining"], "model_type": "bert"}
    out.update({k: cfg[k] for k in HF_CONFIG_DEFAULTS})
    return json.dumps(out, indent=2) + "\n"


def param_layout(cfg):
    """[(name, shape, init, no_weight_decay)] in nopad's ParamLayout order; init is "normal", "zeros" or "ones"."""
    H, F, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    out = []
    weight = lambda n, shape: out.append((n, tuple(shape), "normal", False))
    bias = lambda n, size: out.append((n, (size,), "zeros", True))

    def layernorm(prefix):
        out.append((prefix + ".weight", (H,), "ones", True))
        out.append((prefix + ".bias", (H,), "zeros", True))

    weight("bert.embeddings.word_embeddings.weight", (V, H))
    weight("bert.embeddings.position_embeddings.weight", (cfg["max_position_embeddings"], H))
    weight("bert.embeddings.token_type_embeddings.weight", (cfg["type_vocab_size"], H))
    layernorm("bert.embeddings.LayerNorm")
    for l in range(cfg["num_hidden_layers"]):
        p = f"bert.encoder.layer.{l}."
        for n in ("query", "key", "value"):
            weight(p + f"attention.self.{n}.weight", (H, H))
        for n in ("query", "key", "value"):
            bias(p + f"attention.self.{n}.bias", H)
        weight(p + "attention.output.dense.weight", (H, H))
        bias(p + "attention.output.dense.bias", H)
        layernorm(p + "attention.output.LayerNorm")
        weight(p + "intermediate.dense.weight", (F, H))
        bias(p + "intermediate.dense.bias", F)
        weight(p + "output.dense.weight", (H, F))
        bias(p + "output.dense.bias", H)
        layernorm(p + "output.LayerNorm")
    weight("bert.pooler.dense.weight", (H, H))
    bias("bert.pooler.dense.bias", H)
    bias("cls.predictions.bias", V)
    weight("cls.predictions.transform.dense.weight", (H, H))
    bias("cls.predictions.transform.dense.bias", H)
    layernorm("cls.predictions.transform.LayerNorm")
    weight("cls.seq_relationship.weight", (2, H))
    bias("cls.seq_relationship.bias", 2)
    return out


def init_params_numpy(cfg, seed):
    """{name: float32 array}: nopad's initialisation law (normal(0, initializer_range) truncated at 2 std, zero
    biases, LayerNorm ones/zeros) from numpy's generator: the same distribution, not nopad's draws."""
    rng = np.random.default_rng(seed)
    std = cfg["initializer_range"]
    out = {}
    for name, shape, init, _ in param_layout(cfg):
        if init == "zeros":
            out[name] = np.zeros(shape, np.float32)
        elif init == "ones":
            out[name] = np.ones(shape, np.float32)
        else:
            z = rng.standard_normal(shape)
            bad = np.abs(z) > 2.0
            while bad.any():  # redraw outside +-2 std, as nopad's rejection does
                z[bad] = rng.standard_normal(int(bad.sum()))
                bad = np.abs(z) > 2.0
            out[name] = (z * std).astype(np.float32)
    return out


# ------------------------------------------------------------------------------------------------ safetensors

_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64, "I64": np.int64}


def read_safetensors(path):
    """{name: float32 numpy array} of a .safetensors file (F32, F16, BF16 or F64 tensors; others are skipped)."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise ValueError(f"{path}: header of {n} bytes runs past the end of the file")
    header = json.loads(data[8:8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__" or info["dtype"] not in _ST_DTYPES:
            continue
        b, e = info["data_offsets"]
        a = np.frombuffer(data, dtype=_ST_DTYPES[info["dtype"]], count=(e - b) // np.dtype(
            _ST_DTYPES[info["dtype"]]).itemsize, offset=base + b)
        if info["dtype"] == "BF16":
            a = (a.astype(np.uint32) << 16).view(np.float32)
        out[name] = a.astype(np.float32).reshape(info["shape"])
    return out


def write_safetensors(path, tensors, metadata=None):
    """Writes {name: array} as F32 safetensors (the tensors in the given order), atomically."""
    header, blobs, offset = {}, [], 0
    for name, a in tensors.items():
        b = np.ascontiguousarray(a, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(np.shape(a)), "data_offsets": [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    header["__metadata__"] = dict(metadata or {"format": "pt"})
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)
    os.replace(tmp, path)


def load_hf_weights(path, cfg):
    """{name: float32 array} for every tensor of param_layout(cfg) from a nopad checkpoint / Hugging Face folder
    (model.safetensors) or a .safetensors file; accepts names without "bert." and cls.predictions.decoder.bias,
    as nopad's init_from does. Raises ValueError naming a missing tensor or a wrong shape."""
    file = os.path.join(path, "model.safetensors") if os.path.isdir(path) else path
    raw = read_safetensors(file)
    out = {}
    for name, shape, _, _ in param_layout(cfg):
        candidates = [name]
        if name.startswith("bert."):
            candidates.append(name[len("bert."):])
        if name == "cls.predictions.bias":
            candidates.append("cls.predictions.decoder.bias")
        found = next((c for c in candidates if c in raw), None)
        if found is None:
            raise ValueError(f"{file}: tensor {name} is missing")
        if tuple(raw[found].shape) != shape:
            raise ValueError(f"{file}: tensor {name} has shape {tuple(raw[found].shape)}, the model needs {shape}")
        out[name] = raw[found]
    return out


def save_hf_folder(folder, cfg, params):
    """A folder nopad's init_from and transformers load: model.safetensors (F32) + config.json."""
    os.makedirs(folder, exist_ok=True)
    write_safetensors(os.path.join(folder, "model.safetensors"), params)
    with open(os.path.join(folder, "config.json"), "w") as f:
        f.write(hf_config_json(cfg))


# ---------------------------------------------------------------------------------------------------- metrics

class MetricsWriter:
    """RUN_DIR/metrics.jsonl with nopad's fields: training lines {"step", "samples", "loss", "mlm_loss", "nsp_loss",
    "mlm_accuracy", "lr", "grad_norm", "seq_per_s", "tokens_per_s", "elapsed_s"}; eval lines {"eval": true, "step",
    "samples", "mlm_accuracy", "nsp_accuracy", "eval_loss", "mlm_loss", "nsp_loss", "eval_samples"}."""

    def __init__(self, path):
        self.f = open(path, "w")

    def _write(self, rec):
        self.f.write(json.dumps(rec) + "\n")
        self.f.flush()

    def train(self, step, samples, loss, mlm_loss, nsp_loss, mlm_accuracy, lr, grad_norm, seq_per_s, tokens_per_s,
              elapsed_s):
        fin = lambda x: x if math.isfinite(x) else None
        self._write({"step": step, "samples": samples, "loss": fin(loss), "mlm_loss": mlm_loss, "nsp_loss": nsp_loss,
                     "mlm_accuracy": mlm_accuracy, "lr": lr, "grad_norm": fin(grad_norm), "seq_per_s": seq_per_s,
                     "tokens_per_s": tokens_per_s, "elapsed_s": elapsed_s})

    def eval(self, step, samples, r):
        self._write({"eval": True, "step": step, "samples": samples, "mlm_accuracy": r["mlm_accuracy"],
                     "nsp_accuracy": r["nsp_accuracy"], "eval_loss": r["mlm_loss"] + r["nsp_loss"],
                     "mlm_loss": r["mlm_loss"], "nsp_loss": r["nsp_loss"], "eval_samples": r["samples"]})

    def close(self):
        self.f.close()


def read_metrics(path):
    """(training lines, eval lines) of a metrics.jsonl."""
    steps, evals = [], []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            rec = json.loads(line)
            (evals if rec.get("eval") else steps).append(rec)
    return steps, evals
