"""PyTorch FP8 peer: the unpadded PyTorch BERT-large of the shared peers (packed tokens, varlen attention, MLM head on
masked rows only, bf16 autocast, fused AdamW) with torchao's float8 training on the encoder's four dense layers per
layer (QKV, attention output, FFN in and out), built the way a skilled user would make it fast on variable lengths:
  - the packed token count is padded up to a multiple of --bucket with a fixed number of dummy sequences of at most
    512 tokens (their own cu_seqlens segments, no masked rows, no NSP row), and the masked count to a multiple of
    --mask-bucket with ignored labels, so that a handful of shapes recur and compiled graphs are reused;
  - the whole model is compiled (torch.compile, static shapes), so each bucket costs one compilation; a warm-up step
    per bucket of the workload compiles them all before the timed steps.
    (Compiling each of the 24 layers on its own multiplies the graphs by 24: past dynamo's cache limit the layers
    run eagerly, measured at 280 sequences/s against 490 for the whole-model bf16 peer.)
--recipe none runs the same program in bf16 (the FP8 peer's own baseline). Throughput counts real sequences and
tokens only. Prints one JSON line like the shared peers. Needs torchao (0.18.0 carried as a wheel) for fp8 recipes.
Usage: python3 scripts/peer_torch_fp8.py --batch 256 --steps 20 --lengths WORKLOAD.txt --recipe tensorwise
(common.py of the shared peers must be importable: run from .carry/peers or put it on PYTHONPATH)."""
import argparse
import json
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.varlen import varlen_attn

from common import FF, H, L, NH, V, load_workload, model_flops

p = argparse.ArgumentParser()
p.add_argument("--batch", type=int, default=256)
p.add_argument("--steps", type=int, default=20)
p.add_argument("--lengths", default=None, help="file of 'length masked' lines (nopad stats --workload)")
p.add_argument("--recipe", default="tensorwise", choices=["none", "tensorwise", "rowwise"])
p.add_argument("--bucket", type=int, default=4096, help="pad the packed tokens to a multiple of this")
p.add_argument("--mask-bucket", type=int, default=2048, help="pad the masked-row count to a multiple of this")
p.add_argument("--no-compile", action="store_true")
a = p.parse_args()
D = H // NH
MAXLEN = 512


class Layer(nn.Module):
    def __init__(s):
        super().__init__()
        s.qkv = nn.Linear(H, 3 * H); s.o = nn.Linear(H, H); s.ln1 = nn.LayerNorm(H)
        s.f1 = nn.Linear(H, FF); s.f2 = nn.Linear(FF, H); s.ln2 = nn.LayerNorm(H)

    def forward(s, x, cu):
        T = x.shape[0]
        q, k, v = s.qkv(x).view(T, 3, NH, D).unbind(1)
        att = varlen_attn(q, k, v, cu, cu, MAXLEN, MAXLEN).reshape(T, H)
        x = s.ln1(x + F.dropout(s.o(att), 0.1, s.training))
        return s.ln2(x + F.dropout(s.f2(F.gelu(s.f1(x))), 0.1, s.training))


class Bert(nn.Module):
    def __init__(s):
        super().__init__()
        s.tok = nn.Embedding(V, H); s.pos = nn.Embedding(MAXLEN, H); s.typ = nn.Embedding(2, H); s.ln = nn.LayerNorm(H)
        s.layers = nn.ModuleList([Layer() for _ in range(L)])
        s.mlm_t = nn.Linear(H, H); s.mlm_ln = nn.LayerNorm(H); s.mlm_b = nn.Parameter(torch.zeros(V))
        s.pool = nn.Linear(H, H); s.nsp = nn.Linear(H, 2)

    def forward(s, ids, pos, typ, cu, mpos, mlab, cls_idx, nsp_lab):
        x = F.dropout(s.ln(s.tok(ids) + s.pos(pos) + s.typ(typ)), 0.1, s.training)
        for l in s.layers:
            x = l(x, cu)
        logits = s.mlm_ln(F.gelu(s.mlm_t(x[mpos]))) @ s.tok.weight.t() + s.mlm_b
        pooled = torch.tanh(s.pool(x[cls_idx]))
        return (F.cross_entropy(logits.float(), mlab, ignore_index=-100) +
                F.cross_entropy(s.nsp(pooled).float(), nsp_lab))


torch.manual_seed(0)
m = Bert().cuda()
if a.recipe != "none":
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    encoder_dense = {"qkv", "o", "f1", "f2"}
    convert_to_float8_training(m, config=Float8LinearConfig.from_recipe_name(a.recipe),
                               module_filter_fn=lambda mod, fqn: fqn.startswith("layers.") and
                               fqn.rsplit(".", 1)[-1] in encoder_dense)
if not a.no_compile:
    # Each token bucket is one more graph of the shared layer code; the default cache limit (8) could silently send
    # later buckets back to eager.
    torch._dynamo.config.cache_size_limit = 64
    torch._dynamo.config.accumulated_cache_size_limit = 512
fwd = m if a.no_compile else torch.compile(m, dynamic=False)
opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)


def make(rows):
    lens = [n for n, _ in rows]
    T = sum(lens)
    # Padding: a fixed number of dummy segments (so cu_seqlens has one length and every tensor a bucketed shape),
    # each between 1 and 512 tokens.
    P = 2 * a.bucket // MAXLEN
    pad = -T % a.bucket
    if pad < P:
        pad += a.bucket
    pads = [pad // P + (1 if i < pad % P else 0) for i in range(P)]
    all_lens = lens + pads
    cu = torch.tensor([0] + torch.tensor(all_lens).cumsum(0).tolist(), dtype=torch.int32)
    cu_dev = cu.cuda()
    mp = torch.cat([cu[i] + torch.randperm(n)[:k] for i, (n, k) in enumerate(rows)])
    M = mp.numel()
    ids = torch.randint(1000, 30000, (T + pad,))
    ids[T:] = 0
    mlab = ids[mp].clone()
    mpad = -M % a.mask_bucket
    mp = torch.cat([mp, torch.zeros(mpad, dtype=mp.dtype)])  # row 0, label ignored
    mlab = torch.cat([mlab, torch.full((mpad,), -100, dtype=mlab.dtype)])
    pos = torch.cat([torch.arange(n) for n in all_lens])
    return (ids.cuda(), pos.cuda(), torch.zeros(T + pad, dtype=torch.long, device="cuda"), cu_dev, mp.cuda(),
            mlab.cuda(), cu[:len(rows)].long().cuda(), torch.randint(0, 2, (len(rows),), device="cuda"))


work = load_workload(a.lengths, a.batch, a.steps)
batches = [make(r) for r in work]


def step(b):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = fwd(*b)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


# Warm-up: one step for each padded shape the timed steps will see (each compiles once).
shapes = {}
for b in batches:
    shapes.setdefault((b[0].shape[0], b[4].shape[0]), b)
t_warm = time.time()
for b in shapes.values():
    step(b)
torch.cuda.synchronize()
warm_s = time.time() - t_warm
t0 = time.time()
for b in batches:
    step(b)
torch.cuda.synchronize()
dt = time.time() - t0
rows = [r for w in work for r in w]
real = sum(n for n, _ in rows)
padded = sum(b[0].shape[0] for b in batches)
print(json.dumps(dict(system=f"torch-varlen-fp8-{a.recipe}" + ("" if a.no_compile else "-compiled"), batch=a.batch,
                      steps=a.steps, seqs_per_s=len(rows) / dt, real_tokens_per_s=real / dt,
                      model_tflops=sum(model_flops(w) for w in work) / dt / 1e12, padded_token_share=1 - real / padded,
                      shapes=len(shapes), warmup_s=round(warm_s, 1),
                      max_mem_gib=torch.cuda.max_memory_allocated() / 2**30)))
