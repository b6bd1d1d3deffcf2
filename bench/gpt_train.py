#!/usr/bin/env python3
"""A GPT-2-small-sized transformer (124M parameters, written here in plain torch) trained on one GPU,
fed by each loader in turn, side by side in one run: training tokens/s, and the GPU's wait for
data as 1 - (tokens/s with the loader) / (tokens/s of the same steps on one batch already on the
GPU, "gpu-alone"); busy cores: every process's CPU time (/proc/stat) over the timed wall time.

Model: 12 layers, 12 heads, width 768, vocabulary 50,304, context --seq, bf16 autocast, fused
AdamW, scaled_dot_product_attention (causal). Rows (each a fresh loader; --warmup steps, then
--steps timed; median of --runs):
  gpu-alone        one batch on the GPU, reused (the rate no loader can pass)
  ferry-wN         ferry.datasets.tokens(path, seq, dtype="uint16"), DataLoader(shuffle=True,
                   num_workers=N, device=0, persistent_workers=True)
  nanogpt          nanoGPT's get_batch recipe (memmap, random offsets, pinned, non_blocking)
  turboloader      turboloader.TokenDataLoader(device="cuda") (when importable)
  ferry-packed     documents (an end-of-document id every 50-2,000 tokens, a file of its own)
                   packed with position_ids; attention kept inside each document by a boolean
                   block-diagonal causal mask made on the GPU from position_ids (SDPA)
  gpu-alone-packed the same masked steps on one batch already on the GPU

Usage: gpt_train.py [--tokens 100000000] [--seq 1024] [--batch 16] [--steps 40] [--warmup 10] [--runs 3]
       [--rows gpu-alone,ferry-w2,nanogpt,turboloader,gpu-alone-packed,ferry-packed] [--dir /tmp]
"""
import argparse
import os
import statistics
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import ferry

VOCAB, EOD = 50304, 50256


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x, mask):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, seq, layers=12, heads=12, d=768):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, VOCAB, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx, targets, positions=None):
        mask = None
        if positions is None:
            positions = torch.arange(idx.shape[1], device=idx.device).expand_as(idx)
        else:  # a document's tokens see the document's earlier tokens only
            doc = (positions == 0).cumsum(1)
            t = torch.arange(idx.shape[1], device=idx.device)
            mask = ((doc[:, :, None] == doc[:, None, :]) & (t[None, :, None] >= t[None, None, :]))[:, None]
        x = self.tok(idx) + self.pos(positions)
        for b in self.blocks:
            x = b(x, mask)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.float().view(-1, VOCAB), targets.reshape(-1))


def batches(row, a, path, docs_path):
    if row == "gpu-alone" or row == "gpu-alone-packed":
        data = ferry.datasets.tokens(docs_path if row.endswith("packed") else path, seq_len=a.seq, dtype="uint16",
                                     eod=EOD, packed=row.endswith("packed"))
        b = {k: v.clone() for k, v in next(iter(ferry.DataLoader(data, batch_size=a.batch, device=0))).items()}
        while True:
            yield b
    elif row.startswith("ferry"):
        packed = row == "ferry-packed"
        data = ferry.datasets.tokens(docs_path if packed else path, seq_len=a.seq, dtype="uint16", eod=EOD, packed=packed)
        workers = 2 if packed else int(row[7:])
        loader = ferry.DataLoader(data, batch_size=a.batch, shuffle=True, num_workers=workers, device=0,
                                  persistent_workers=True, drop_last=True)
        while True:
            yield from loader
    elif row == "nanogpt":
        data = np.memmap(path, dtype=np.uint16, mode="r")
        while True:
            ix = torch.randint(len(data) - a.seq - 1, (a.batch,)).tolist()
            x = torch.stack([torch.from_numpy(data[i:i + a.seq].astype(np.int64)) for i in ix])
            y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + a.seq].astype(np.int64)) for i in ix])
            yield {"input_ids": x.pin_memory().to("cuda", non_blocking=True), "labels": y.pin_memory().to("cuda", non_blocking=True)}
    elif row == "turboloader":
        import turboloader
        loader = turboloader.TokenDataLoader(path, a.seq, batch_size=a.batch, dtype="uint16", device="cuda")
        while True:
            for x, y in loader:
                yield {"input_ids": x, "labels": y}
    else:
        raise SystemExit(f"unknown row {row}")


def busy_jiffies():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v[:8]) - v[3] - v[4]


def run(row, a, path, docs_path, model, opt):
    src = batches(row, a, path, docs_path)

    def step():
        b = next(src)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(b["input_ids"], b["labels"], b.get("position_ids"))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(a.warmup):
        step()
    torch.cuda.synchronize()
    j0, t0 = busy_jiffies(), time.perf_counter()
    for _ in range(a.steps):
        step()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    busy = (busy_jiffies() - j0) / os.sysconf("SC_CLK_TCK") / wall
    src.close()
    return a.steps * a.batch * a.seq / wall, busy


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=100_000_000)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--rows", default="gpu-alone,ferry-w2,nanogpt,turboloader,gpu-alone-packed,ferry-packed")
    p.add_argument("--dir", default="/tmp")
    a = p.parse_args()
    rng = np.random.default_rng(0)
    path = os.path.join(a.dir, f"gpt-tokens-{a.tokens}.bin")
    docs_path = os.path.join(a.dir, f"gpt-docs-{a.tokens}.bin")
    if not os.path.exists(path):
        rng.integers(0, EOD, a.tokens, dtype=np.uint16).tofile(path)
    if not os.path.exists(docs_path):
        t = rng.integers(0, EOD, a.tokens, dtype=np.uint16)
        ends = np.cumsum(rng.integers(50, 2001, a.tokens // 50))
        t[ends[ends < a.tokens]] = EOD
        t.tofile(docs_path)
    torch.manual_seed(0)
    model = GPT(a.seq).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    params = sum(p.numel() for p in model.parameters())
    print(f"# GPT {params / 1e6:.0f}M params, seq {a.seq}, batch {a.batch}, bf16, {torch.cuda.get_device_name(0)}, "
          f"{os.cpu_count()} CPUs, torch {torch.__version__}, ferry {ferry.__version__}; {a.steps} steps after {a.warmup}, "
          f"median of {a.runs}")
    print("| loader | training tokens/s (median) | range | vs gpu-alone | GPU waiting | busy cores |")
    print("|---|---:|---:|---:|---:|---:|")
    alone = {}
    for row in a.rows.split(","):
        if row == "turboloader":
            try:
                import turboloader  # noqa: F401
            except ImportError as e:
                print(f"| turboloader | not importable: {e} | | | | |")
                continue
        runs = [run(row, a, path, docs_path, model, opt) for _ in range(a.runs)]
        rates = sorted(r[0] for r in runs)
        med = statistics.median(rates)
        busy = statistics.median(r[1] for r in runs)
        base = alone.get("packed" if "packed" in row else "plain")
        if row.startswith("gpu-alone"):
            alone["packed" if "packed" in row else "plain"] = med
        ratio = "" if base is None else f"{med / base:.3f}"
        wait = "" if base is None else f"{max(0.0, 1 - med / base) * 100:.2f}%"
        print(f"| {row} | {med:,.0f} | {rates[0]:,.0f}-{rates[-1]:,.0f} | {ratio} | {wait} | {busy:.2f} |", flush=True)


if __name__ == "__main__":
    main()
