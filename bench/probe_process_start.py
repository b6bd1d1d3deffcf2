import multiprocessing as mp, pickle, sys, time
import torch, torchvision  # noqa: F401 (imported for what importing them costs a process)
from multiprocessing import forkserver
from multiprocessing.reduction import ForkingPickler

def child(conn, payload):
    conn.send("ready")

if __name__ == "__main__":
    t = torchvision.transforms
    recipe = t.Compose([t.RandomResizedCrop(224), t.RandomHorizontalFlip(), t.ToTensor(), t.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    ds = torchvision.datasets.ImageFolder(sys.argv[1], transform=recipe)
    ds.samples = ds.samples * 60; ds.imgs = ds.samples; ds.targets = ds.targets * 60
    payload = (ds, "map", None, None)
    s = time.perf_counter(); b = pickle.dumps(payload); print("pickle %.3f s, %d bytes" % (time.perf_counter() - s, len(b)), flush=True)
    s = time.perf_counter(); b = ForkingPickler.dumps(payload); print("ForkingPickler %.3f s" % (time.perf_counter() - s), flush=True)
    ctx = mp.get_context("forkserver")
    s = time.perf_counter(); forkserver.ensure_running(); print("ensure_running %.3f s" % (time.perf_counter() - s), flush=True)
    for load, name in ((payload, "ImageFolder payload"), ((None,), "empty payload")):
        procs = []
        for _ in range(4):
            a, c = ctx.Pipe()
            s = time.perf_counter()
            p = ctx.Process(target=child, args=(c, load), daemon=True)
            p.start()
            st = time.perf_counter() - s
            s = time.perf_counter(); a.recv(); rd = time.perf_counter() - s
            print("%s: start() %.3f s, then ready after %.3f s" % (name, st, rd), flush=True)
            procs.append(p)
        for p in procs: p.join()
