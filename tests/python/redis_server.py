"""A redis-server of a test's own on a loopback port (no persistence), and a free port: shared by the Python tests
and benchmarks that need a Redis store."""
import socket
import subprocess
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A redis-server of the test's own on a loopback port (no persistence)."""

    def __init__(self, workdir, maxmemory=None):
        self.port = free_port()
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(workdir)]
        if maxmemory:
            args += ["--maxmemory", str(maxmemory), "--maxmemory-policy", "allkeys-lru"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        t0 = time.time()
        while time.time() - t0 < 20:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.5).close()
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("redis-server did not start")

    def url(self, ns):
        return f"redis://127.0.0.1:{self.port}/{ns}"

    def stop(self):
        self.proc.terminate()
        self.proc.wait(10)
