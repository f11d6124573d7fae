"""ControllerClient against a real kvtier-controller, with a store and a
worker that join it: routing, node listing, per-model policies, and a round
on the routed worker with the routed store replicas."""

import os
import shutil
import subprocess
import tempfile
import time

import grpc
import numpy as np
import pytest

from conftest import BUILD, Server
from kvtier import ControllerClient, KvtierError, ModelSpec, Policy, StoreClient, WorkerClient

SPEC = ModelSpec(layers=3, q_heads=4, kv_heads=2, head_dim=8, dtype="float32", name="tiny")


def start_cluster(work, roles, servers, worker_args=()):
    """A controller, a store and one worker per entry of `roles` (its
    --role, or None), every node joined to the controller, appended to
    `servers` as each starts (the caller stops them, also after a failure).
    worker_args[i], where given, are more flags for worker i."""
    ctl = Server(os.path.join(BUILD, "services/controller/kvtier-controller"),
                 ["--listen=127.0.0.1:0", "--metrics_listen=", f"--state_dir={work}/ctl",
                  "--heartbeat_interval_ms=200", "--warmup_seconds=0"], work, "controller")
    servers.append(ctl)
    store = Server(os.path.join(BUILD, "services/store/kvtier-store"),
                   [f"--data_dir={work}/db", "--listen=127.0.0.1:0", "--metrics_listen=",
                    f"--controller={ctl.address}"], work, "store")
    servers.append(store)
    for i, role in enumerate(roles):
        args = [f"--store={store.address}", "--listen=127.0.0.1:0", "--metrics_listen=",
                f"--controller={ctl.address}"] + ([f"--role={role}"] if role else [])
        args += list(worker_args[i]) if i < len(worker_args) else []
        servers.append(Server(os.path.join(BUILD, "services/worker/kvtier-worker"), args, work,
                              f"worker{i}"))


@pytest.fixture(scope="module")
def cluster():
    work = tempfile.mkdtemp(prefix="kvtier-py-ctl-")
    servers = []
    try:
        start_cluster(work, [None], servers)
        yield servers
    finally:
        for s in reversed(servers):
            s.stop()
        shutil.rmtree(work, ignore_errors=True)


def test_route_nodes_policies_and_a_round(cluster):
    ctl, store, worker = cluster
    # An unreachable first replica: the client goes on to the next.
    with ControllerClient(f"127.0.0.1:1,{ctl.address}", timeout=5, retries=0) as c:
        deadline = time.time() + 20
        while True:
            nodes = c.list_nodes().nodes
            if sum(n.live for n in nodes) == 2:
                break
            assert time.time() < deadline, nodes
            time.sleep(0.1)
        assert sorted(n.address for n in nodes) == sorted([store.address, worker.address])
        r = c.route("py-routed", SPEC)
        assert r.worker_address == worker.address
        assert list(r.store_addresses) == [store.address]
        assert c.route("py-routed", SPEC).worker_node_id == r.worker_node_id  # Sticky.

        assert c.set_policy("tiny", Policy(codec="kivi4", recall="all")) is False
        assert c.set_policy("tiny", Policy(codec="kivi8", recall="all")) is True
        got = c.get_policy("tiny", "py-routed")
        assert got.policy.codec_params.bits == 8
        with pytest.raises(KvtierError) as e:
            c.get_policy("no-such-model", "py-routed")
        assert e.value.code == grpc.StatusCode.NOT_FOUND

        rng = np.random.default_rng(7)
        with WorkerClient(r.worker_address) as w:
            s = w.open_session("py-routed", SPEC, Policy(recall="all"),
                               store_addresses=list(r.store_addresses))
            with s.prefill() as p:
                for l in range(SPEC.layers):
                    p.layer(l, rng.standard_normal((4, 4, 8)), rng.standard_normal((4, 2, 8)),
                            rng.standard_normal((4, 2, 8)))
            assert s.end_round().round == 0
            s.close(delete_from_store=True)


def test_prefill_and_decode_pools_through_the_controller():
    """Workers registered with --role=prefill and --role=decode: Route places
    sessions on the prefill worker and names the decode worker, and
    kvtier-engine's cluster sessions hand each round off to it."""
    from conftest import require_model

    model = require_model()
    work = tempfile.mkdtemp(prefix="kvtier-py-pd-")
    servers = []
    try:
        start_cluster(work, ["prefill", "decode"], servers)
        ctl, roles = servers[0], {"prefill": servers[2], "decode": servers[3]}
        with ControllerClient(ctl.address) as c:
            deadline = time.time() + 20
            while sum(n.live for n in c.list_nodes().nodes) < 3:
                assert time.time() < deadline
                time.sleep(0.1)
            by_address = {n.address: n.role for n in c.list_nodes().nodes}
            from kvtier.v1 import controller_pb2
            assert by_address[roles["prefill"].address] == controller_pb2.WORKER_ROLE_PREFILL
            assert by_address[roles["decode"].address] == controller_pb2.WORKER_ROLE_DECODE
            r = c.route("pd-0", SPEC)
            assert r.worker_address == roles["prefill"].address
            assert r.decode_worker_address == roles["decode"].address
        out = subprocess.run(
            [os.path.join(BUILD, "refengine/kvtier-engine"), f"--controller={ctl.address}",
             f"--model={model}", "--sessions=2", "--rounds=4", "--quiet"],
            capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr + out.stdout
        # 2 sessions x 4 rounds: 8 hand-offs and 8 hand-backs, all over gRPC.
        assert "hand-offs and hand-backs: grpc 16)" in out.stdout, out.stdout
        # Speculation in the cluster: the skew goes to both workers of each
        # session, and the decode worker speculates.
        skew = os.path.join(work, "s.skew")
        subprocess.run([os.path.join(BUILD, "tools/kvtier"), "calibrate", "infinigen",
                        f"--model={model}", f"--out={skew}"], check=True, capture_output=True)
        spec_run = subprocess.run(
            [os.path.join(BUILD, "refengine/kvtier-engine"), f"--controller={ctl.address}",
             f"--model={model}", "--sessions=2", "--rounds=4", "--quiet", "--speculation=4",
             f"--skew={skew}"], capture_output=True, text=True, timeout=120)
        assert spec_run.returncode == 0, spec_run.stderr + spec_run.stdout
        assert "hand-offs and hand-backs: grpc 16)" in spec_run.stdout, spec_run.stdout
        table = spec_run.stdout[spec_run.stdout.index("speculation (4)"):]
        layer1 = [l for l in table.splitlines() if l.startswith("1 ")][0].split()
        assert int(layer1[1]) > 0, table  # Steps that speculated layer 1.
        print(out.stdout[out.stdout.index("prefill (time"):][:600])
    finally:
        for s in reversed(servers):
            s.stop()
        shutil.rmtree(work, ignore_errors=True)


def test_speculation_from_a_controller_policy():
    """A per-model policy that speculates, set with `kvtier policy set
    --speculation_skew=FILE`: a worker that loaded the skew at start
    (--skew_dir) opens sessions of that model speculating without an upload;
    one that did not refuses them with FAILED_PRECONDITION naming the skew."""
    from conftest import require_model

    model = require_model()
    work = tempfile.mkdtemp(prefix="kvtier-py-spec-")
    servers = []
    try:
        skews = os.path.join(work, "skews")
        os.makedirs(skews)
        skew = os.path.join(skews, "stories.skew")
        kvtier_cli = os.path.join(BUILD, "tools/kvtier")
        subprocess.run([kvtier_cli, "calibrate", "infinigen", f"--model={model}", f"--out={skew}"],
                       check=True, capture_output=True)
        start_cluster(work, [None, None], servers, [[f"--skew_dir={skews}"], []])
        ctl, loaded, bare = servers[0], servers[2], servers[3]
        assert "skew ready" in open(os.path.join(work, "worker0.log")).read()
        out = subprocess.run(
            [kvtier_cli, "policy", "set", f"--controller={ctl.address}", "--model=stories",
             "--recall=all", f"--speculation_skew={skew}", "--speculation_alpha=3",
             "--speculation_budget=6"], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        skew_id = out.stdout.splitlines()[0].rsplit(" ", 1)[1]  # "skew FILE is ID"
        assert "registered the policy of model 'stories'" in out.stdout
        bad = subprocess.run(
            [kvtier_cli, "policy", "set", f"--controller={ctl.address}", "--model=stories",
             "--speculation_alpha=3"], capture_output=True, text=True, timeout=30)
        assert bad.returncode == 2 and "need --speculation_skew" in bad.stderr
        # stories260K: 5 layers, 8 query heads over 4 KV heads of 8.
        spec = ModelSpec(layers=5, q_heads=8, kv_heads=4, head_dim=8, dtype="float32",
                         name="stories")
        with WorkerClient(loaded.address) as w:
            s = w.open_session("spec-0", spec)
            p = s.effective_policy
            assert (p.speculation_skew, p.speculation_alpha, p.speculation_budget) == (
                skew_id, 3.0, 6)
            s.close(delete_from_store=True)
        with WorkerClient(bare.address) as w:
            with pytest.raises(KvtierError) as e:
                w.open_session("spec-1", spec)
            assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert f"unknown skew {skew_id}" in str(e.value)
    finally:
        for s in reversed(servers):
            s.stop()
        shutil.rmtree(work, ignore_errors=True)


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _issue(ca, name, san, cwd):
    """A certificate for `name` (subjectAltName `san`) signed by the CA named `ca`."""
    with open(os.path.join(cwd, f"{name}.ext"), "w") as f:
        f.write(f"subjectAltName={san}\nextendedKeyUsage=serverAuth,clientAuth\n")
    _openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=cwd)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-days", "1", "-extfile", f"{name}.ext", "-out", f"{name}.pem",
             cwd=cwd)


def test_clients_present_certificates_to_a_store_that_requires_them():
    """Mutual TLS from Python: a store that requires client certificates from
    its CA (--tls_client_ca) serves a StoreClient presenting one, as the
    tenant its cert: line names; a client with none, or with one from another
    CA, gets UNAVAILABLE."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not installed (make deps installs it)")
    with tempfile.TemporaryDirectory(prefix="kvtier-mtls-") as work:
        for ca in ("ca", "rogue"):
            _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                     "-nodes", "-keyout", f"{ca}.key", "-out", f"{ca}.pem", "-days", "1",
                     "-subj", f"/CN={ca}", "-addext", "basicConstraints=critical,CA:TRUE",
                     cwd=work)
        _issue("ca", "server", "DNS:localhost,IP:127.0.0.1", work)
        _issue("ca", "acme", "DNS:acme-engine", work)
        _issue("rogue", "fake", "DNS:acme-engine", work)
        with open(os.path.join(work, "tenants"), "w") as f:
            f.write("cert:acme-engine acme readwrite\n")
        store = Server(os.path.join(BUILD, "services/store/kvtier-store"),
                       [f"--data_dir={work}/db", "--listen=127.0.0.1:0", "--metrics_listen=",
                        f"--tenants_file={work}/tenants", f"--tls_cert={work}/server.pem",
                        f"--tls_key={work}/server.key", f"--tls_client_ca={work}/ca.pem"],
                       work, "store")
        try:
            def read(name):
                with open(os.path.join(work, name), "rb") as f:
                    return f.read()
            root = read("ca.pem")
            acme = StoreClient(store.address, timeout=5, retries=0, tls_root_cert=root,
                               tls_cert_chain=read("acme.pem"), tls_private_key=read("acme.key"))
            assert acme.stats().tenant == "acme"
            strangers = [StoreClient(store.address, timeout=5, retries=0, tls_root_cert=root),
                         StoreClient(store.address, timeout=5, retries=0, tls_root_cert=root,
                                     tls_cert_chain=read("fake.pem"),
                                     tls_private_key=read("fake.key"))]
            for c in strangers:
                with pytest.raises(KvtierError) as e:
                    c.stats()
                assert e.value.code == grpc.StatusCode.UNAVAILABLE
            with pytest.raises(ValueError, match="go together"):
                StoreClient(store.address, tls_root_cert=root, tls_cert_chain=read("acme.pem"))
        finally:
            store.stop()
