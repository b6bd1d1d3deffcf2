"""Run under torchrun by test_tokens.py: a global batch of 8 windows split over WORLD_SIZE ranks;
phase "first" runs `steps` batches and saves rank 0's state_dict, "rest1"/"rest2" restore it and
finish the epoch; each rank writes its batches' first input tokens to <dir>/<phase>-<rank>.json
(and which device it used, to <dir>/<phase>-<rank>.device)."""
import json
import os
import sys

import ferry

out, phase, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
ds = ferry.datasets.tokens(os.environ["FERRY_TEST_TOKENS"], seq_len=16, dtype="uint16")
# Each rank on its own GPU where there is one for every rank (torchrun's LOCAL_RANK), else the host.
import torch

local = int(os.environ.get("LOCAL_RANK", rank))
device = local if torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", world)) else None
loader = ferry.DataLoader(ds, batch_size=8 // world, shuffle=True, seed=5, num_workers=1, num_replicas=world, rank=rank,
                          device=device)
if phase != "first":
    with open(os.path.join(out, "state.json")) as f:
        loader.load_state_dict(json.load(f))
got = []
for i, b in enumerate(loader):
    got.append(b["input_ids"][:, 0].tolist())
    if steps and i + 1 == steps:
        break
if phase == "first" and rank == 0:
    with open(os.path.join(out, "state.json"), "w") as f:
        json.dump(loader.state_dict(), f)
with open(os.path.join(out, f"{phase}-{rank}.json"), "w") as f:
    json.dump(got, f)
with open(os.path.join(out, f"{phase}-{rank}.device"), "w") as f:
    f.write("host" if device is None else f"cuda:{device}")
