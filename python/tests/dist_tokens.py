"""Run under torchrun by test_tokens.py: a global batch of 8 windows split over WORLD_SIZE ranks;
phase "first" runs `steps` batches and saves rank 0's state_dict, "rest1"/"rest2" restore it and
finish the epoch; each rank writes its batches' first input tokens to <dir>/<phase>-<rank>.json."""
import json
import os
import sys

import ferry

out, phase, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
ds = ferry.datasets.tokens(os.environ["FERRY_TEST_TOKENS"], seq_len=16, dtype="uint16")
loader = ferry.DataLoader(ds, batch_size=8 // world, shuffle=True, seed=5, num_workers=1, num_replicas=world, rank=rank)
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
