"""PyTorch twin of `nopad train`, for comparing convergence and speed: the same BERT pre-training on the same nopad
shards, global batches, hyper-parameters and metrics.jsonl format, written the way a skilled PyTorch user would
(unpadded like /work/shared/peers/peer_torch_varlen.py).

    python3 scripts/torch_pretrain.py --config configs/convergence-bert-base.toml --seed 1 --out /tmp/torch1
        [--set key=value ...] [--data DIR] [--eval DIR] [--device cuda|cpu] [--init-from DIR] [--max-steps N]
        [--compile]

What is the same as nopad (each read from nopad's sources):
  * config: nopad's TOML file and --set overrides, nopad's defaults (python/nopad_twin.py); --data, --eval, --out,
    --seed, --max-steps are shorthands for data.train, data.eval, run_dir, train.seed, train.max_steps.
  * data: global batch k is nopad's (python/nopad_order.py: train.seed, per-epoch shuffles, dropped tails), read
    from the shards with python/nopad_shards.py; split into train.grad_accumulation contiguous micro-batches whose
    losses use the global batch's masked-position and sequence counts as denominators.
  * model: Hugging Face BertForPreTraining (post-LN encoder; MLM transform dense + GELU + LayerNorm, decoder tied to
    the word embeddings plus its own bias; pooler tanh + NSP), every layer on the packed [tokens, hidden] matrix and
    the MLM head on the masked rows only; parameter names are Hugging Face's.
  * init: nopad's law (normal(0, initializer_range) truncated at 2 std, zero biases, LayerNorm 1/0), drawn from
    torch's generator seeded with train.seed; or --init-from / init_from (a nopad checkpoint or HF folder).
  * loss: sum(MLM cross-entropy) / masked positions + sum(NSP cross-entropy) / sequences.
  * optimizer: LAMB with nopad's (apex FusedLAMB) semantics: global gradient norm, clipped to optim.max_grad_norm
    before the moments; bias correction; decoupled weight decay and the trust ratio only on tensors that decay
    (not biases, LayerNorm, cls.predictions.bias); lr from nopad's schedule (warm-up, polynomial decay).
  * evaluation: the first eval.max_samples samples of data.eval in order, dropout off; masked-LM accuracy = correct
    masked predictions / all masked positions, NSP accuracy, mean losses; after every step whose samples cross a
    multiple of eval.interval_samples, and at the end; train.target_mlm_accuracy stops the run.
  * RUN_DIR/metrics.jsonl with nopad's field names (training lines every log.interval_steps and the last step;
    "seq_per_s" there is the mean since the previous line), RUN_DIR/config.json (the effective config).

What differs: arithmetic (bf16 autocast on CUDA with fp32 weights, gradients and optimizer; fp32 on the CPU),
dropout draws (torch's generator, not nopad's per-sample Philox), and attention dropout: PyTorch's varlen_attn has
no dropout, so when attention_probs_dropout_prob > 0 training pads each batch to its longest sequence and runs
F.scaled_dot_product_attention with a key-padding mask and dropout_p (evaluation and dropout-free training use
varlen_attn on CUDA; the CPU always takes the padded path). No checkpoints are written.
"""
import argparse
import json
import math
import os
import queue
import sys
import threading
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import nopad_order  # noqa: E402
import nopad_shards  # noqa: E402
import nopad_twin  # noqa: E402

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # older PyTorch: the padded path is used everywhere
    varlen_attn = None


# ------------------------------------------------------------------------------------------------------- model

class Embeddings(nn.Module):
    def __init__(self, c):
        super().__init__()
        H = c["hidden_size"]
        self.word_embeddings = nn.Embedding(c["vocab_size"], H)
        self.position_embeddings = nn.Embedding(c["max_position_embeddings"], H)
        self.token_type_embeddings = nn.Embedding(c["type_vocab_size"], H)
        self.LayerNorm = nn.LayerNorm(H, eps=c["layer_norm_eps"])


class SelfAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        H = c["hidden_size"]
        self.query, self.key, self.value = nn.Linear(H, H), nn.Linear(H, H), nn.Linear(H, H)


class DenseLayerNorm(nn.Module):  # attention.output and output: dense, then LayerNorm(dropout(.) + residual)
    def __init__(self, c, d_in):
        super().__init__()
        self.dense = nn.Linear(d_in, c["hidden_size"])
        self.LayerNorm = nn.LayerNorm(c["hidden_size"], eps=c["layer_norm_eps"])


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.self = SelfAttention(c)
        self.output = DenseLayerNorm(c, c["hidden_size"])


class Intermediate(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.dense = nn.Linear(c["hidden_size"], c["intermediate_size"])


class Layer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.attention = Attention(c)
        self.intermediate = Intermediate(c)
        self.output = DenseLayerNorm(c, c["intermediate_size"])


class Encoder(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.layer = nn.ModuleList([Layer(c) for _ in range(c["num_hidden_layers"])])


class Pooler(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.dense = nn.Linear(c["hidden_size"], c["hidden_size"])


class Bert(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embeddings = Embeddings(c)
        self.encoder = Encoder(c)
        self.pooler = Pooler(c)


class Transform(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.dense = nn.Linear(c["hidden_size"], c["hidden_size"])
        self.LayerNorm = nn.LayerNorm(c["hidden_size"], eps=c["layer_norm_eps"])


class Predictions(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.transform = Transform(c)
        self.bias = nn.Parameter(torch.zeros(c["vocab_size"]))  # the decoder's bias; its weight is tied


class Heads(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.predictions = Predictions(c)
        self.seq_relationship = nn.Linear(c["hidden_size"], 2)


class BertForPreTraining(nn.Module):
    """Parameter names and shapes are Hugging Face's (state_dict() == nopad's checkpoint tensors). forward() takes a
    packed batch (see to_device) and returns (the cross-entropy sums [mlm, nsp] to differentiate, detached
    [mlm_ce, nsp_ce, mlm_correct, nsp_correct] in float64). The loss denominators are applied by the caller, so
    that a compiled forward does not see a new constant every step."""

    def __init__(self, c):
        super().__init__()
        self.c = c
        self.bert = Bert(c)
        self.cls = Heads(c)
        self.heads, self.head_dim = c["num_attention_heads"], c["hidden_size"] // c["num_attention_heads"]
        self.gelu_approx = "tanh" if c["hidden_act"] in nopad_twin.GELU_TANH_NAMES else "none"

    def act(self, x):
        return F.gelu(x, approximate=self.gelu_approx)

    def attention(self, qkv, b):
        T = qkv.shape[0]
        p = self.c["attention_probs_dropout_prob"] if self.training else 0.0
        if "pad_index" not in b:  # the batch was built for varlen_attn (CUDA, 16-bit, no attention dropout)
            q, k, v = qkv.view(T, 3, self.heads, self.head_dim).unbind(1)
            return varlen_attn(q, k, v, b["cu_seqlens"], b["cu_seqlens"], b["max_seqlen"], b["max_seqlen"])
        # Padded: rows gathered into [B, Lmax] (pad slots read an appended zero row), keys masked, dropout on P.
        Bn, L = b["pad_index"].shape
        padded = torch.cat([qkv, qkv.new_zeros(1, qkv.shape[1])])[b["pad_index"]]
        q, k, v = padded.view(Bn, L, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=b["key_mask"][:, None, None, :], dropout_p=p)
        return out.transpose(1, 2).reshape(Bn * L, self.heads, self.head_dim)[b["valid_rows"]]

    def forward(self, b):
        c, e = self.c, self.bert.embeddings
        p_h = c["hidden_dropout_prob"] if self.training else 0.0
        x = e.word_embeddings(b["tokens"]) + e.position_embeddings(b["positions"]) + \
            e.token_type_embeddings(b["segments"])
        x = F.dropout(e.LayerNorm(x), p_h, self.training)
        H = c["hidden_size"]
        for layer in self.bert.encoder.layer:
            sa = layer.attention.self
            w = torch.cat([sa.query.weight, sa.key.weight, sa.value.weight])
            bias = torch.cat([sa.query.bias, sa.key.bias, sa.value.bias])
            ctx = self.attention(F.linear(x, w, bias), b).reshape(-1, H)
            o = layer.attention.output
            x = o.LayerNorm(F.dropout(o.dense(ctx), p_h, self.training) + x)
            f = self.act(layer.intermediate.dense(x))
            o = layer.output
            x = o.LayerNorm(F.dropout(o.dense(f), p_h, self.training) + x)
        pr = self.cls.predictions
        t = pr.transform.LayerNorm(self.act(pr.transform.dense(x[b["mlm_positions"]])))
        logits = F.linear(t, e.word_embeddings.weight, pr.bias).float()
        pooled = torch.tanh(self.bert.pooler.dense(x[b["cls_rows"]]))
        nsp_logits = self.cls.seq_relationship(pooled).float()
        mlm_ce = F.cross_entropy(logits, b["mlm_labels"], reduction="sum")
        nsp_ce = F.cross_entropy(nsp_logits, b["nsp_labels"], reduction="sum")
        # nopad counts a masked prediction correct when the first maximal logit is the label, and NSP "random"
        # (1) only when its logit is strictly larger.
        mlm_correct = (logits.argmax(-1) == b["mlm_labels"]).sum()
        nsp_correct = ((nsp_logits[:, 1] > nsp_logits[:, 0]).long() == b["nsp_labels"]).sum()
        sums = torch.stack([mlm_ce.detach().double(), nsp_ce.detach().double(), mlm_correct.double(),
                            nsp_correct.double()])
        return torch.stack([mlm_ce, nsp_ce]), sums


def init_nopad_law(model, layout, std, seed):
    """nopad's initialisation law on the model's parameters (torch's generator, seeded)."""
    g = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, shape, init, _ in layout:
            p = params[name]
            if init == "zeros":
                p.zero_()
            elif init == "ones":
                p.fill_(1.0)
            else:
                cpu = torch.empty(shape)
                nn.init.trunc_normal_(cpu, mean=0.0, std=std, a=-2 * std, b=2 * std, generator=g)
                p.copy_(cpu)


# ------------------------------------------------------------------------------------------------------ LAMB

def norms(tensors):
    """Per-tensor L2 norms as a 1-D fp32 tensor: foreach kernels on the GPU (fp32 sums, as nopad's FusedLamb); on
    the CPU in double (as nopad's CPU optimizer), since torch's CPU foreach norm sums large tensors in fp32 serially
    and is off by ~1e-4 relative for the word embeddings."""
    if tensors[0].is_cuda:
        return torch.stack(torch._foreach_norm(tensors))
    return torch.stack([torch.linalg.vector_norm(t, dtype=torch.float64) for t in tensors]).float()


class Lamb:
    """nopad's LAMB (src/optim/optimizer.h, apex FusedLAMB): fp32 moments, sync-free (foreach ops, the clip factor
    and trust ratios stay on the device)."""

    def __init__(self, params, no_weight_decay, beta1, beta2, eps, weight_decay, max_grad_norm):
        self.params = params
        self.decayed = [i for i, nd in enumerate(no_weight_decay) if not nd and weight_decay > 0]
        self.m = [torch.zeros_like(p) for p in params]
        self.v = [torch.zeros_like(p) for p in params]
        self.b1, self.b2, self.eps, self.wd, self.max_norm = beta1, beta2, eps, weight_decay, max_grad_norm
        self.step_count = 0

    @torch.no_grad()
    def step(self, lr):
        """One update; returns the global gradient norm before clipping (a device tensor)."""
        g = [p.grad for p in self.params]
        norm = torch.linalg.vector_norm(norms(g))
        if self.max_norm > 0:  # g <- g / (norm / max_grad_norm) when norm > max_grad_norm
            g = torch._foreach_mul(g, torch.where(norm > self.max_norm, self.max_norm / norm, torch.ones_like(norm)))
        t = self.step_count + 1
        c1, c2 = 1.0 - self.b1 ** t, 1.0 - self.b2 ** t
        torch._foreach_mul_(self.m, self.b1)
        torch._foreach_add_(self.m, g, alpha=1.0 - self.b1)
        torch._foreach_mul_(self.v, self.b2)
        torch._foreach_addcmul_(self.v, g, g, value=1.0 - self.b2)
        den = torch._foreach_div(self.v, c2)
        torch._foreach_sqrt_(den)
        torch._foreach_add_(den, self.eps)
        u = torch._foreach_div(self.m, c1)
        torch._foreach_div_(u, den)
        if self.decayed:  # u += wd w, then the trust ratio ||w|| / ||u|| (1 when either is 0), w before the update
            ud = [u[i] for i in self.decayed]
            wd = [self.params[i] for i in self.decayed]
            torch._foreach_add_(ud, wd, alpha=self.wd)
            w_norm = norms(wd)
            u_norm = norms(ud)
            ratio = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
            torch._foreach_mul_(ud, list(ratio.unbind(0)))
        torch._foreach_add_(self.params, u, alpha=-lr)
        self.step_count = t
        return norm


# ------------------------------------------------------------------------------------------------------- data

def host_batch(ds, ids, need_padded):
    """nopad's unpadded batch plus the host-side indices of the padded attention path, as numpy arrays."""
    b = ds.build_batch(ids)
    cu = b["cu_seqlens"].astype(np.int64)
    b["cls_rows"] = cu[:-1]
    if need_padded:
        lengths = np.diff(cu)
        B, L, T = len(lengths), int(lengths.max()), int(cu[-1])
        col = np.arange(L)[None, :]
        mask = col < lengths[:, None]
        b["pad_index"] = np.where(mask, cu[:-1, None] + col, T).astype(np.int64)
        b["key_mask"] = mask
        b["valid_rows"] = np.flatnonzero(mask.ravel()).astype(np.int64)
    return b


def to_device(b, device):
    pin = device.type == "cuda"
    out = {"max_seqlen": int(b["max_seqlen"])}
    for k in ("tokens", "positions", "segments", "mlm_positions", "mlm_labels", "nsp_labels", "cls_rows",
              "pad_index", "valid_rows", "key_mask", "cu_seqlens"):
        if k not in b:
            continue
        t = torch.from_numpy(np.ascontiguousarray(b[k]))
        if pin:
            t = t.pin_memory()
        t = t.to(device, non_blocking=True)
        if k not in ("cu_seqlens", "key_mask"):
            t = t.long()
        out[k] = t
    out["num_seqs"] = len(b["nsp_labels"])
    out["num_masked"] = len(b["mlm_labels"])
    out["num_tokens"] = len(b["tokens"])
    return out


def split_micro(ds, ids, accumulation):
    """Contiguous micro-batches of the global batch (nopad's slice_batch), ceil(B / accumulation) sequences each."""
    micro = (len(ids) + accumulation - 1) // accumulation
    return [ids[i:i + micro] for i in range(0, len(ids), micro)]


class Prefetcher:
    """Builds the next steps' micro-batches on a background thread (numpy + pinned copies) while the GPU works."""

    def __init__(self, ds, batches, accumulation, need_padded, device, depth=3):
        self.q = queue.Queue(maxsize=depth)
        self.error = None

        def run():
            try:
                for ids in batches:
                    self.q.put([to_device(host_batch(ds, m, need_padded), device)
                                for m in split_micro(ds, ids, accumulation)])
            except BaseException as e:  # surfaced by get()
                self.error = e
                self.q.put(None)

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def get(self):
        item = self.q.get()
        if item is None:
            raise RuntimeError(f"batch builder failed: {self.error!r}")
        return item


# -------------------------------------------------------------------------------------------------- evaluation

@torch.no_grad()
def evaluate(model, fwd, ds, max_samples, batch, device, autocast, padded):
    """nopad's evaluate_with: the first max_samples (0 = all) samples in order, dropout off, loss sums averaged over
    all masked positions / all sequences."""
    was_training = model.training
    model.eval()
    n = min(max_samples, ds.num_seqs) if max_samples > 0 else ds.num_seqs
    sums = torch.zeros(4, dtype=torch.float64, device=device)
    masked = 0
    for start in range(0, n, batch):
        ids = list(range(start, min(n, start + batch)))
        b = to_device(host_batch(ds, ids, padded), device)
        with autocast():
            _, s = fwd(b)
        sums += s
        masked += b["num_masked"]
    model.train(was_training)
    mlm_ce, nsp_ce, mlm_correct, nsp_correct = sums.tolist()
    return {"mlm_accuracy": mlm_correct / masked if masked else 0.0, "nsp_accuracy": nsp_correct / n if n else 0.0,
            "mlm_loss": mlm_ce / masked if masked else 0.0, "nsp_loss": nsp_ce / n if n else 0.0, "samples": n,
            "masked": masked}


# ------------------------------------------------------------------------------------------------------- main

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="nopad training config (TOML)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    p.add_argument("--data", help="data.train")
    p.add_argument("--eval", help="data.eval ('' = no evaluation)")
    p.add_argument("--out", help="run_dir: metrics.jsonl, config.json, summary.json")
    p.add_argument("--seed", type=int, help="train.seed")
    p.add_argument("--max-steps", type=int, help="train.max_steps")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], help="train.device")
    p.add_argument("--init-from", help="init_from: a nopad checkpoint or Hugging Face folder, or a .safetensors")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (dynamic shapes)")
    a = p.parse_args(argv)
    sets = list(a.set)
    for flag, key in (("data", "data.train"), ("eval", "data.eval"), ("out", "run_dir"), ("seed", "train.seed"),
                      ("max_steps", "train.max_steps"), ("device", "train.device"), ("init_from", "init_from")):
        if getattr(a, flag) is not None:
            sets.append(f"{key}={getattr(a, flag)}")
    return a, nopad_twin.load_train_config(a.config, sets)


def main(argv=None):
    args, cfg = parse_args(argv)
    for key in ("run_dir", "model.config", "data.train"):
        if not cfg[key]:
            sys.exit(f"error: {key} is not set")
    if cfg["optim.name"] != "lamb":
        sys.exit("error: optim.name must be lamb (the twin implements nopad's LAMB only)")
    dev = cfg["train.device"]
    if dev == "auto":
        dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cuda" and not torch.cuda.is_available():
        sys.exit("error: train.device cuda but torch sees no GPU")
    device = torch.device(dev)
    precision = cfg["train.precision"]
    if precision == "auto":
        precision = "bf16" if dev == "cuda" else "fp32"
    if precision not in ("bf16", "fp32") or (precision == "bf16" and dev != "cuda"):
        sys.exit(f"error: train.precision {precision} on {dev}: the twin runs bf16 autocast on CUDA or fp32")
    if cfg["train.threads"] > 0:
        torch.set_num_threads(cfg["train.threads"])

    mc = nopad_twin.read_hf_config(cfg["model.config"])
    layout = nopad_twin.param_layout(mc)
    train_ds = nopad_shards.open_dataset(cfg["data.train"])
    eval_ds = nopad_shards.open_dataset(cfg["data.eval"]) if cfg["data.eval"] else None
    gb, acc = cfg["train.global_batch"], cfg["train.grad_accumulation"]
    if gb <= 0 or acc <= 0 or gb % acc:
        sys.exit("error: train.global_batch must be a positive multiple of train.grad_accumulation")
    if gb > train_ds.num_seqs:
        sys.exit(f"error: data.train has {train_ds.num_seqs} samples, fewer than train.global_batch ({gb})")
    micro = gb // acc
    max_steps, max_samples, seed = cfg["train.max_steps"], cfg["train.max_samples"], cfg["train.seed"]
    schedule = nopad_twin.LrSchedule.from_config(cfg)
    interval = nopad_twin.eval_interval(cfg)
    target = cfg["train.target_mlm_accuracy"]
    log_interval = cfg["log.interval_steps"]

    torch.manual_seed(seed)
    model = BertForPreTraining(mc)
    names = [n for n, _ in model.named_parameters()]
    if sorted(names) != sorted(n for n, _, _, _ in layout):
        sys.exit("error: the torch model's parameters differ from nopad's layout")
    if cfg["init_from"]:
        weights = nopad_twin.load_hf_weights(cfg["init_from"], mc)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(torch.from_numpy(weights[n]))
    else:
        init_nopad_law(model, layout, mc["initializer_range"], seed)
    model.to(device).train()
    params = dict(model.named_parameters())
    if cfg["data.placement"] != "shared":
        sys.exit(f"error: data.placement = {cfg['data.placement']} is for several ranks; the twin is one process "
                 "reading data.train whole: use data.placement = shared")
    if cfg["dist.clip"] != "global":
        sys.exit(f"error: dist.clip = {cfg['dist.clip']} is not implemented by the twin (it clips the global norm, "
                 "as LAMB does); use dist.clip = global")
    opt = Lamb([params[n] for n, _, _, _ in layout], [nd for _, _, _, nd in layout], cfg["optim.beta1"],
               cfg["optim.beta2"], cfg["optim.eps"], cfg["optim.weight_decay"], cfg["optim.max_grad_norm"])
    fwd = torch.compile(model, dynamic=True) if args.compile else model
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if precision == "bf16" else \
        (lambda: torch.autocast(dev, enabled=False))

    run_dir = cfg["run_dir"]
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump({"config": cfg, "device": dev, "precision": precision, "compile": args.compile,
                   "torch": torch.__version__}, f, indent=1)
    metrics = nopad_twin.MetricsWriter(os.path.join(run_dir, "metrics.jsonl"))

    # The run's global batches, nopad's order (a step count bounded by max_samples too).
    steps_total = max_steps if max_samples <= 0 else min(max_steps, -(-max_samples // gb))
    batches = nopad_order.global_batches(train_ds.num_seqs, seed, gb, steps_total)
    # varlen_attn: CUDA, 16-bit, no dropout; otherwise batches carry the padded path's indices.
    eval_padded = dev != "cuda" or varlen_attn is None or precision == "fp32"
    need_padded = eval_padded or mc["attention_probs_dropout_prob"] > 0
    prefetch = Prefetcher(train_ds, batches, acc, need_padded, device)
    gpu_name = torch.cuda.get_device_name(device) if dev == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    print(f"torch {torch.__version__} on {gpu_name}, {precision}{', compiled' if args.compile else ''}; "
          f"{len(layout)} tensors, {sum(p.numel() for p in model.parameters())} parameters; attention "
          f"{'padded SDPA' if need_padded else 'varlen_attn'} in training, {'padded SDPA' if eval_padded else 'varlen_attn'} "
          f"in evaluation; {steps_total} steps of {gb}", flush=True)

    step, samples = 0, 0
    pending = []  # per step since the last line: (step, samples, lr, sums tensor, grad norm tensor, masked, seqs)
    evals, last_eval_step = [], -1
    eval_s = 0.0
    t_start = time.perf_counter()
    t_line, samples_line, tokens_line = t_start, 0, 0
    reached = False

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    def run_eval():
        nonlocal eval_s, last_eval_step
        t0 = time.perf_counter()
        r = evaluate(model, fwd, eval_ds, cfg["eval.max_samples"], micro, device, autocast, eval_padded)
        eval_s += time.perf_counter() - t0
        metrics.eval(step, samples, r)
        evals.append(r)
        last_eval_step = step
        print(f"eval at step {step} ({samples} samples): mlm accuracy {r['mlm_accuracy']:.4f}, nsp accuracy "
              f"{r['nsp_accuracy']:.4f}, loss {r['mlm_loss'] + r['nsp_loss']:.4f}", flush=True)
        return r

    def write_lines(last):
        nonlocal t_line, samples_line, tokens_line
        sync()
        now = time.perf_counter()
        dt = max(now - t_line, 1e-9)
        for k, (s, smp, lr, sums, gnorm, m, bsz) in enumerate(pending):
            if not (s % log_interval == 0 or (last and k == len(pending) - 1)):
                continue
            mlm_ce, nsp_ce, mlm_ok, _ = sums.tolist()
            g = float(gnorm)
            mlm_loss, nsp_loss = mlm_ce / max(1, m), nsp_ce / bsz
            if not (math.isfinite(mlm_loss + nsp_loss) and math.isfinite(g)):
                metrics.close()
                sys.exit(f"error: step {s}: the loss or gradients are not finite: training diverged")
            metrics.train(s, smp, mlm_loss + nsp_loss, mlm_loss, nsp_loss, mlm_ok / m if m else 0.0, lr, g,
                          samples_line / dt, tokens_line / dt, now - t_start)
            print(f"step {s}/{steps_total}  loss {mlm_loss + nsp_loss:.4f}  mlm acc {mlm_ok / max(1, m):.4f}  "
                  f"lr {lr:.3g}  {samples_line / dt:.1f} seq/s", flush=True)
        pending.clear()
        t_line, samples_line, tokens_line = now, 0, 0

    while step < max_steps and not (max_samples > 0 and samples >= max_samples):
        micros = prefetch.get()
        masked = sum(b["num_masked"] for b in micros)
        seqs = sum(b["num_seqs"] for b in micros)
        lr = schedule.lr(step)
        for p in opt.params:
            p.grad = None
        sums = torch.zeros(4, dtype=torch.float64, device=device)
        for b in micros:
            with autocast():
                ce, s = fwd(b)
            (ce[0] / max(1, masked) + ce[1] / seqs).backward()
            sums += s
        gnorm = opt.step(lr)
        before = samples
        step += 1
        samples += seqs
        samples_line += seqs
        tokens_line += sum(b["num_tokens"] for b in micros)
        pending.append((step, samples, lr, sums, gnorm, masked, seqs))
        last = step >= max_steps or (max_samples > 0 and samples >= max_samples)
        due = eval_ds is not None and nopad_twin.eval_due(before, samples, interval)
        if step % log_interval == 0 or last or due:
            write_lines(last)
        if due:
            r = run_eval()
            t_line = time.perf_counter()  # the eval's time is not training throughput
            if target > 0 and r["mlm_accuracy"] >= target:
                print(f"reached train.target_mlm_accuracy {target:.4f} at step {step}", flush=True)
                reached = True
                break
    if pending:
        write_lines(True)
    if eval_ds is not None and last_eval_step != step:
        run_eval()
    sync()
    elapsed = time.perf_counter() - t_start
    metrics.close()
    train_s = elapsed - eval_s
    summary = {"system": "torch" + ("-compiled" if args.compile else ""), "device": gpu_name, "precision": precision,
               "steps": step, "samples": samples, "elapsed_s": elapsed, "eval_s": eval_s, "train_s": train_s,
               "seq_per_s": samples / train_s if train_s > 0 else 0.0, "reached_target": reached,
               "final_eval": evals[-1] if evals else None,
               "max_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if dev == "cuda" else None}
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"done: step {step}, {samples} samples, {elapsed:.1f} s ({train_s:.1f} s training, {eval_s:.1f} s eval), "
          f"{summary['seq_per_s']:.1f} seq/s" + (f"; final eval mlm accuracy {evals[-1]['mlm_accuracy']:.4f}"
                                                  if evals else ""), flush=True)


if __name__ == "__main__":
    main()
