"""Fixtures: real kvtier-store and kvtier-worker processes from the build
(KVTIER_BUILD_DIR), on 127.0.0.1 with ports the servers pick themselves."""

import os
import shutil
import subprocess
import tempfile
import time

import pytest

BUILD = os.environ.get("KVTIER_BUILD_DIR", os.path.join(os.path.dirname(__file__), "../../build"))
SOURCE = os.environ.get("KVTIER_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "../.."))
MODEL = os.path.join(SOURCE, "..", "shared", "models", "stories260K.bin")


def require_model():
    """The path of stories260K, or a skip (a failure under CI=true)."""
    if os.path.exists(MODEL):
        return MODEL
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true but {MODEL} is missing")
    pytest.skip("needs ../shared/models/stories260K.bin beside the checkout")


class Server:
    def __init__(self, binary, args, workdir, name):
        self.name = name
        self.log = open(os.path.join(workdir, f"{name}.log"), "w")
        port_file = os.path.join(workdir, f"{name}.port")
        self.proc = subprocess.Popen([binary, *args, f"--port_file={port_file}"],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 30
        while time.time() < deadline:
            if os.path.exists(port_file) and os.path.getsize(port_file) > 0:
                with open(port_file) as f:
                    self.address = f"127.0.0.1:{f.read().strip()}"
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.stop()
        with open(self.log.name) as f:
            raise RuntimeError(f"{name} did not start:\n{f.read()[-2000:]}")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def stack():
    """A store and a worker that keeps its rounds there, shared by a module's tests
    (each uses its own session ids)."""
    work = tempfile.mkdtemp(prefix="kvtier-py-")
    servers = []
    try:
        store = Server(os.path.join(BUILD, "services/store/kvtier-store"),
                       [f"--data_dir={work}/db", "--listen=127.0.0.1:0",
                        "--metrics_listen=127.0.0.1:0"], work, "store")
        servers.append(store)
        worker = Server(os.path.join(BUILD, "services/worker/kvtier-worker"),
                        [f"--store={store.address}", "--listen=127.0.0.1:0",
                         "--metrics_listen=127.0.0.1:0"], work, "worker")
        servers.append(worker)
        yield store, worker
    finally:
        for s in reversed(servers):
            s.stop()
        shutil.rmtree(work, ignore_errors=True)
