"""AttentionConnector's prefill step against calling the worker directly: a
32-layer, 512-token prefill (32 q heads, 8 KV heads, d = 128, fp16), through
a real kvtier-store and kvtier-worker from the build. Prints where the step's
time goes: inside save_kv_layer (queueing), inside wait_for_layer_load
(waiting for the send and the answer), and the whole step, beside the same
step sent layer by layer with PrefillStep.layer (what save_kv_layer did when
it sent at once).

    PYTHONPATH=build/python /usr/bin/python3 bench/connector_bench.py --build build
"""

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time

import numpy as np

LAYERS, Q_HEADS, KV_HEADS, D, TOKENS, REPEATS = 32, 32, 8, 128, 512, 5


def start(binary, args, work, name):
    port_file = os.path.join(work, f"{name}.port")
    log = open(os.path.join(work, f"{name}.log"), "w")
    proc = subprocess.Popen([binary, *args, f"--port_file={port_file}"], stdout=log,
                            stderr=subprocess.STDOUT)
    deadline = time.time() + 30
    while not (os.path.exists(port_file) and os.path.getsize(port_file)):
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"{name} did not start: see {log.name}")
        time.sleep(0.05)
    with open(port_file) as f:
        return proc, "127.0.0.1:" + f.read().strip()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default="build")
    argv = ap.parse_args()
    from kvtier import AttentionConnector, ModelSpec, Policy, WorkerClient

    work = tempfile.mkdtemp(prefix="kvtier-connector-bench-")
    procs = []
    try:
        store, store_addr = start(os.path.join(argv.build, "services/store/kvtier-store"),
                                  [f"--data_dir={work}/db", "--listen=127.0.0.1:0",
                                   "--metrics_listen=127.0.0.1:0"], work, "store")
        procs.append(store)
        worker, worker_addr = start(os.path.join(argv.build, "services/worker/kvtier-worker"),
                                    [f"--store={store_addr}", "--listen=127.0.0.1:0",
                                     "--metrics_listen=127.0.0.1:0"], work, "worker")
        procs.append(worker)
        spec = ModelSpec(layers=LAYERS, q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=D,
                         dtype="float16")
        rng = np.random.default_rng(0)
        q = rng.normal(size=(TOKENS, Q_HEADS, D)).astype(np.float16)
        k = rng.normal(size=(TOKENS, KV_HEADS, D)).astype(np.float16)
        v = rng.normal(size=(TOKENS, KV_HEADS, D)).astype(np.float16)
        client = WorkerClient(worker_addr)
        conn = AttentionConnector(client, spec, Policy(recall="all"))
        rows = {"direct": [], "save": [], "wait": [], "connector": []}
        for i in range(REPEATS):
            s = client.open_session(f"direct-{i}", spec, Policy(recall="all"))
            start_t = time.perf_counter()
            step = s.prefill(TOKENS)
            for layer in range(LAYERS):
                step.layer(layer, q, k, v)
            step.finish()
            rows["direct"].append(time.perf_counter() - start_t)
            s.close(True)

            rid = f"conn-{i}"
            save = wait = 0.0
            start_t = time.perf_counter()
            conn.start_load_kv(rid, TOKENS, prefill=True, question_tokens=TOKENS)
            for layer in range(LAYERS):
                t0 = time.perf_counter()
                conn.save_kv_layer(rid, layer, q, k, v)
                t1 = time.perf_counter()
                conn.wait_for_layer_load(rid, layer)
                save += t1 - t0
                wait += time.perf_counter() - t1
            conn.wait_for_save(rid)
            rows["connector"].append(time.perf_counter() - start_t)
            rows["save"].append(save)
            rows["wait"].append(wait)
            conn.close(rid, delete_from_store=True)
        med = {key: statistics.median(val) for key, val in rows.items()}
        print(f"connector_bench: {LAYERS} layers x {TOKENS} tokens, {Q_HEADS}/{KV_HEADS} heads, "
              f"d={D}, fp16; median of {REPEATS}")
        print("| what | seconds |")
        print("|---|---|")
        print(f"| direct PrefillStep.layer, whole step (baseline) | {med['direct']:.3f} |")
        print(f"| connector, whole step | {med['connector']:.3f} |")
        print(f"| inside save_kv_layer | {med['save']:.4f} |")
        print(f"| inside wait_for_layer_load | {med['wait']:.3f} |")
        print(f"connector / direct: {med['connector'] / med['direct']:.3f}x; "
              f"save_kv_layer holds the engine {med['save'] / LAYERS * 1e6:.0f} us a layer")
    finally:
        for p in reversed(procs):
            p.terminate()
            p.wait(30)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
