#!/usr/bin/env python3
"""A GPU host's side-by-side ratio table (the host named by machine.txt), from one run's outputs of bench_pin, peers_torch
and peers_libtorch (scripts/gpu.sh bench writes them to $OUT). Usage:
    gpu_table.py bench_pin.md peers_torch.md peers_libtorch.md [machine.txt]
Best of each peer's settings (workers, pin mode) per workload; ratios are ferry's best over it."""
import sys


def sections(path):
    out, name = {}, None
    try:
        text = open(path).read()
    except OSError:
        return out
    for line in text.splitlines():
        if line.startswith("## "):
            name = "a" if line.startswith("## (a)") else "b" if line.startswith("## (b)") else "loop" if "training loop" in line else line
            out[name] = []
        elif name and line.startswith("|") and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if cells[0] in ("pipeline", "loader"):
                continue
            out[name].append(cells)
    return out


def best(rows, pred):
    vals = [float(r[2].replace(",", "")) for r in rows if pred(r[0])]
    return max(vals) if vals else None


def main():
    pin, torch, libtorch = (sections(p) for p in sys.argv[1:4])
    machine = open(sys.argv[4]).read().strip().splitlines() if len(sys.argv) > 4 else []
    print("# Side by side on one GPU host (one run)\n")
    if machine:
        print("Machine: " + "; ".join(l for l in machine if l and not l.startswith("name,")) + "\n")
    print("| workload | ferry (best) | bare probe | PyTorch pinned | PyTorch not pinned | libtorch | ferry / probe | ferry / PyTorch | ferry / libtorch |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for w, label in (("a", "(a) 3x224x224 uint8, batch 256"), ("b", "(b) 784 float32, batch 256")):
        f = best(pin.get(w, []), lambda n: n.startswith("ferry"))
        probe = best(pin.get(w, []), lambda n: n.startswith("bare probe"))
        tp = best(torch.get(w, []), lambda n: "pin_memory=True" in n)
        tn = best(torch.get(w, []), lambda n: "pin_memory=False" in n)
        lt = best(libtorch.get(w, []), lambda n: True)
        fmt = lambda v: f"{v:,.0f}" if v else "-"
        ratio = lambda a, b: f"{a / b:.2f}" if a and b else "-"
        print(f"| {label} | {fmt(f)} | {fmt(probe)} | {fmt(tp)} | {fmt(tn)} | {fmt(lt)} | {ratio(f, probe)} | "
              f"{ratio(f, max(tp or 0, tn or 0))} | {ratio(f, lt)} |")
    print("\nbatches/s delivered on the GPU.\n")
    print("| training loop, GPU work per step | ferry: GPU waiting for data | PyTorch pinned | PyTorch not pinned |")
    print("|---|---:|---:|---:|")
    loops = {}
    for source, rows in (("ferry", pin.get("loop", [])), ("torch", torch.get("loop", []))):
        for r in rows:
            step = round(float(r[1].split()[0]) / 10) * 10  # 10 or 20 ms
            key = "ferry" if source == "ferry" else ("pinned" if "pin_memory=True" in r[0] else "pageable")
            value = r[4] if key != "ferry" else f"{r[4]} ({r[0].replace('ferry, device=0, ', '')})"
            loops.setdefault(step, {}).setdefault(key, []).append(value)
    for step in sorted(loops):
        d = loops[step]
        print(f"| {step} ms | {', '.join(d.get('ferry', ['-']))} | {', '.join(d.get('pinned', ['-']))} | "
              f"{', '.join(d.get('pageable', ['-']))} |")


if __name__ == "__main__":
    main()
