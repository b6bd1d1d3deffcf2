#!/usr/bin/env python3
"""Time to the first batch of a weighted mixture of 3 Megatron-LM indexed datasets, and the memory
it takes, as the corpus grows: ferry (megatron + mixture + DataLoader) against megatron-core's
BlendedMegatronDatasetBuilder + GPTDataset (when importable; it needs torch >= 2), side by side.

Each corpus: 3 sources of --total/3 tokens in documents of --doc tokens (longer where a source would
otherwise hold more than --max-documents: at 15 T tokens an index of 1,000-token documents would be
300 GB). The .idx files are real
(every document's length and pointer, written here in the published MMIDIDX layout); the .bin
files are sparse (their size only: reading them gives zeros, which is all timing needs). Each
loader runs in a fresh process (so memory and caches start equal): from nothing to the first batch
of --batch sequences of --seq tokens, weights 0.5/0.3/0.2, timed from after the libraries (and
torch) are imported; memory is the process's peak RSS growth over the same span. An epoch is the
corpus once (ferry: the mixture's size, the sources' total; megatron-core: as many samples). megatron-core builds and caches its indices under a fresh folder each run (the cold
start a new run pays).

Usage: tokens_first_batch.py [--totals 3e8,3e9,3e10] [--doc 1000] [--max-documents 3e6] [--seq 2048] [--batch 8]
       [--dir /tmp/ferry-first] [--rows ferry,megatron-core] [--mixture-size N] [--shuffle]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np


def document_tokens(tokens, doc, max_documents):
    """Each document's tokens: `doc`, or longer where a source would hold more than max_documents."""
    return max(doc, -(-(tokens // 3) // max_documents))


def write_corpus(folder, tokens, doc):
    os.makedirs(folder, exist_ok=True)
    prefixes = []
    for s in range(3):
        prefix = os.path.join(folder, f"src{s}")
        prefixes.append(prefix)
        n = tokens // 3 // doc
        if os.path.exists(prefix + ".idx") and os.path.getsize(prefix + ".bin") == n * doc * 2:
            continue
        with open(prefix + ".idx", "wb") as f:
            f.write(b"MMIDIDX\x00\x00")
            f.write(np.array([1], "<u8").tobytes())
            f.write(np.array([8], "u1").tobytes())  # uint16 tokens
            f.write(np.array([n, n + 1], "<u8").tobytes())
            f.write(np.full(n, doc, "<i4").tobytes())
            f.write((np.arange(n, dtype="<i8") * doc * 2).tobytes())
            f.write(np.arange(n + 1, dtype="<i8").tobytes())
        with open(prefix + ".bin", "wb") as f:
            f.truncate(n * doc * 2)
    return prefixes


def rss_mb():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:")) / 1024


def child(kind, prefixes, seq, batch, size, shuffle):
    # The libraries are imported first (torch with them): the clock and the memory count from there.
    import torch
    if kind == "ferry":
        import ferry
    else:
        from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    rss0 = rss_mb()
    t0 = time.perf_counter()
    if kind == "ferry":
        sources = [(ferry.datasets.megatron(p, seq_len=seq), w) for p, w in zip(prefixes, (0.5, 0.3, 0.2), strict=True)]
        mix = ferry.datasets.mixture(sources, seed=1234, size=size)
        b = next(iter(ferry.DataLoader(mix, batch_size=batch, shuffle=shuffle)))
        shape = tuple(b["input_ids"].shape)
    else:
        from collections import OrderedDict

        class Tok:  # what GPTDataset reads of a tokenizer
            vocab_size, eod, pad = 50257, 50256, -1
            unique_identifiers = OrderedDict({"class": "bench"})

        if not torch.distributed.is_initialized():  # its builder asks the process group (one rank here)
            torch.distributed.init_process_group("gloo", init_method="tcp://127.0.0.1:29531", rank=0, world_size=1)
        cache = tempfile.mkdtemp(prefix="megatron-cache-")
        cfg = GPTDatasetConfig(random_seed=1234, sequence_length=seq, blend_per_split=[(prefixes, [0.5, 0.3, 0.2]), None, None],
                               tokenizer=Tok(), reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
                               path_to_cache=cache)
        total = sum(os.path.getsize(p + ".bin") // 2 for p in prefixes)
        train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [total // seq, None, None], lambda: True, cfg).build()
        b = torch.utils.data.default_collate([train[i] for i in range(batch)])
        shape = tuple(b["tokens"].shape)
    seconds = time.perf_counter() - t0
    rss = rss_mb() - rss0
    print(json.dumps({"seconds": seconds, "rss_mb": rss, "shape": shape}))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--totals", default="3e8,3e9,3e10")
    p.add_argument("--doc", type=int, default=1000)
    p.add_argument("--max-documents", type=float, default=3e6, help="documents a source at most (longer documents past it)")
    p.add_argument("--shuffle", action="store_true", help="ferry: DataLoader(shuffle=True) over the mixture")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--dir", default="/tmp/ferry-first")
    p.add_argument("--mixture-size", type=int, default=None, help="ferry: samples an epoch of the mixture (default: the sources' total)")
    p.add_argument("--rows", default="ferry,megatron-core")
    p.add_argument("--child", nargs="*")
    a = p.parse_args()
    if a.child:
        return child(a.child[0], a.child[1:], a.seq, a.batch, a.mixture_size, a.shuffle)
    try:
        import megatron.core  # noqa: F401
        kinds = a.rows.split(",")
    except Exception as e:  # noqa: BLE001 (any import failure: say it and go on)
        kinds = [k for k in a.rows.split(",") if k != "megatron-core"]
        print(f"# megatron-core not importable here: {type(e).__name__}: {e}")
    print(f"# first batch of a 3-source mixture (0.5/0.3/0.2), documents of {a.doc} tokens (at most {int(a.max_documents):,} "
          f"a source), seq {a.seq}, batch {a.batch}, shuffle={a.shuffle}, {os.cpu_count()} CPUs; a fresh process each")
    print("| corpus tokens | documents | loader | first batch (s) | RSS growth (MB) |")
    print("|---:|---:|---|---:|---:|")
    for total in (int(float(t)) for t in a.totals.split(",")):
        doc = document_tokens(total, a.doc, int(a.max_documents))
        prefixes = write_corpus(os.path.join(a.dir, f"c{total}"), total, doc)
        for kind in kinds:
            extra = ([] if a.mixture_size is None else ["--mixture-size", str(a.mixture_size)]) + (["--shuffle"] if a.shuffle else [])
            r = subprocess.run([sys.executable, __file__, "--seq", str(a.seq), "--batch", str(a.batch), *extra, "--child", kind, *prefixes],
                               capture_output=True, text=True, timeout=600)
            if r.returncode != 0:
                print(f"| {total:,} | {total // doc:,} | {kind} | failed: {r.stderr.strip().splitlines()[-1:]} | |")
                continue
            out = json.loads(r.stdout.strip().splitlines()[-1])
            print(f"| {total:,} | {total // doc:,} | {kind} | {out['seconds']:.3f} | {out['rss_mb']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
