"""WorkerClient against a real kvtier-worker and kvtier-store."""

import grpc
import numpy as np
import pytest

from kvtier import KvtierError, ModelSpec, Policy, StoreClient, WorkerClient
from kvtier.llama import attend

SPEC = ModelSpec(layers=3, q_heads=4, kv_heads=2, head_dim=8, dtype="float32")


def rnd(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


class Local:
    """Full attention over every token so far, per layer."""

    def __init__(self, spec):
        self.k = [np.zeros((0, spec.kv_heads, spec.head_dim), np.float32)] * spec.layers
        self.v = list(self.k)

    def layer(self, l, q, k, v):
        first = self.k[l].shape[0]
        self.k[l] = np.concatenate([self.k[l], k])
        self.v[l] = np.concatenate([self.v[l], v])
        return attend(q, self.k[l], self.v[l], first)


def run_round(s, local, rng, n, decode, spec=SPEC, tol=1e-4):
    worst = 0.0
    with s.prefill(question_tokens=n) as p:
        for l in range(spec.layers):
            q, k, v = (rnd(rng, n, spec.q_heads, 8), rnd(rng, n, spec.kv_heads, 8),
                       rnd(rng, n, spec.kv_heads, 8))
            out = p.layer(l, q, k, v)
            worst = max(worst, float(np.abs(out - local.layer(l, q, k, v)).max()))
    for _ in range(decode):
        for l in range(spec.layers):
            q, k, v = rnd(rng, 1, spec.q_heads, 8), rnd(rng, 1, spec.kv_heads, 8), rnd(rng, 1, spec.kv_heads, 8)
            out = s.decode_layer(l, q, k, v)
            worst = max(worst, float(np.abs(out - local.layer(l, q, k, v)).max()))
    assert worst < tol, worst
    return s.end_round()


def test_rounds_match_full_attention(stack):
    store, worker = stack
    rng = np.random.default_rng(1)
    with WorkerClient(worker.address) as w:
        s = w.open_session("py-1", SPEC, Policy(recall="all", watershed_layer=1))
        assert s.effective_policy.watershed_layer == 1
        local = Local(SPEC)
        for r in range(3):
            rep = run_round(s, local, rng, n=7, decode=4)
            assert rep.round == r
            assert rep.stored_bytes > 0
        # A prefill larger than one message (1 MiB) travels in slices.
        big = ModelSpec(layers=3, q_heads=32, kv_heads=8, head_dim=8, dtype="float32")
        b = w.open_session("py-big", big, Policy(recall="all", watershed_layer=1))
        run_round(b, Local(big), rng, n=700, decode=1, spec=big)
        s.close(delete_from_store=True)
        b.close(delete_from_store=True)


def test_fp16_model(stack):
    _, worker = stack
    spec = ModelSpec(layers=3, q_heads=4, kv_heads=2, head_dim=8, dtype="float16")
    rng = np.random.default_rng(2)
    with WorkerClient(worker.address) as w:
        s = w.open_session("py-fp16", spec, Policy(codec="kivi4", recall="all", watershed_layer=1))
        local = Local(spec)
        for _ in range(2):
            run_round(s, local, rng, n=40, decode=3, spec=spec, tol=0.6)


def test_errors_are_precise(stack):
    _, worker = stack
    rng = np.random.default_rng(3)
    with WorkerClient(worker.address) as w:
        with pytest.raises(ValueError, match="codec 'kivi3'"):
            w.open_session("e", SPEC, Policy(codec="kivi3"))
        with pytest.raises(KvtierError) as e:
            w.open_session("e", SPEC, Policy(eviction="snapkv"))
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.method == "OpenSession"
        s = w.open_session("e", SPEC)
        with pytest.raises(KvtierError) as e:
            w.open_session("e", SPEC)
        assert e.value.code == grpc.StatusCode.ALREADY_EXISTS
        with pytest.raises(KvtierError) as e:
            s.decode_layer(0, rnd(rng, 1, 4, 8), rnd(rng, 1, 2, 8), rnd(rng, 1, 2, 8))
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "before the round's first prefill" in e.value.details
        with pytest.raises(ValueError, match=r"k: shape \(1, 3, 8\)"):
            with s.prefill() as p:
                p.layer(0, rnd(rng, 1, 4, 8), rnd(rng, 1, 3, 8), rnd(rng, 1, 2, 8))
        with pytest.raises(KvtierError) as e:
            with s.prefill() as p:
                p.layer(1, rnd(rng, 1, 4, 8), rnd(rng, 1, 2, 8), rnd(rng, 1, 2, 8))
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "out of order" in e.value.details
        with pytest.raises(KvtierError) as e:
            w.open_session("x", SPEC).end_round()
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        s.close()
        with pytest.raises(KvtierError) as e:
            s.close()
        assert e.value.code == grpc.StatusCode.NOT_FOUND


def test_abandoned_step_rolls_back(stack):
    _, worker = stack
    rng = np.random.default_rng(4)
    with WorkerClient(worker.address) as w:
        s = w.open_session("ab", SPEC, Policy(recall="all", watershed_layer=1))
        local = Local(SPEC)
        run_round(s, local, rng, n=5, decode=2)

        class Stop(Exception):
            pass

        # Two layers of a prefill, then the engine gives up: the worker rolls
        # the step back, and the next prefill matches attention without it.
        with pytest.raises(Stop):
            with s.prefill() as p:
                for l in range(2):
                    p.layer(l, rnd(rng, 3, 4, 8), rnd(rng, 3, 2, 8), rnd(rng, 3, 2, 8))
                raise Stop()
        run_round(s, local, rng, n=6, decode=2)


def test_one_decode_stream_batches_sessions(stack):
    _, worker = stack
    rng = np.random.default_rng(5)
    with WorkerClient(worker.address) as w:
        sessions = [w.open_session(f"b{i}", SPEC, Policy(recall="all", watershed_layer=1))
                    for i in range(3)]
        locals_ = [Local(SPEC) for _ in sessions]
        for s, local in zip(sessions, locals_):
            with s.prefill() as p:
                for l in range(SPEC.layers):
                    q, k, v = rnd(rng, 4, 4, 8), rnd(rng, 4, 2, 8), rnd(rng, 4, 2, 8)
                    p.layer(l, q, k, v)
                    local.layer(l, q, k, v)
        d = w.decode_stream()
        for _ in range(3):
            for l in range(SPEC.layers):
                items, want = [], []
                for s, local in zip(sessions, locals_):
                    q, k, v = rnd(rng, 1, 4, 8), rnd(rng, 1, 2, 8), rnd(rng, 1, 2, 8)
                    items.append((s, l, q, k, v))
                    want.append(local.layer(l, q, k, v))
                outs = d.batch(items)
                for o, x in zip(outs, want):
                    assert np.abs(o - x).max() < 1e-4
        d.close()
        for s in sessions:
            assert s.end_round().round == 0


def test_store_client_sees_the_rounds(stack):
    store, worker = stack
    rng = np.random.default_rng(6)
    with WorkerClient(worker.address) as w, StoreClient(store.address) as st:
        s = w.open_session("st", SPEC, Policy(recall="all", watershed_layer=1))
        local = Local(SPEC)
        run_round(s, local, rng, n=5, decode=1)
        run_round(s, local, rng, n=5, decode=1)
        rounds = st.list_rounds("st").rounds
        assert [r.round for r in rounds] == [0, 1]
        segs = [(r.round, g.ref.segment, g.payload_bytes) for r in rounds for g in r.segments]
        assert len(segs) == 4
        got = st.get_segments("st", [(r, g) for r, g, _ in segs])
        assert {k: len(v) for k, v in got.items()} == {(r, g): n for r, g, n in segs}
        assert st.stats().tenant_bytes >= sum(n for *_, n in segs)
        assert "st" in [x.session_id for x in st.list_sessions().sessions]
        s.close()
        st.delete_session("st")
        with pytest.raises(KvtierError) as e:
            st.list_rounds("st")
        assert e.value.code == grpc.StatusCode.NOT_FOUND


def test_session_calls_carry_the_mesh_header():
    """Each call of a session names it in x-kvtier-session, the header a mesh
    hashes on (deploy/k8s/overlays/mesh). A recording server stands in for
    the worker: only the metadata is under test."""
    from concurrent.futures import ThreadPoolExecutor

    from kvtier.v1 import worker_pb2, worker_pb2_grpc

    seen = []

    class Recorder(worker_pb2_grpc.WorkerServicer):
        def OpenSession(self, request, context):
            seen.append(("OpenSession", dict(context.invocation_metadata()).get("x-kvtier-session")))
            return worker_pb2.OpenSessionResponse()

        def EndRound(self, request, context):
            seen.append(("EndRound", dict(context.invocation_metadata()).get("x-kvtier-session")))
            return worker_pb2.EndRoundResponse()

    server = grpc.server(ThreadPoolExecutor(2))
    worker_pb2_grpc.add_WorkerServicer_to_server(Recorder(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with WorkerClient(f"127.0.0.1:{port}", token="t") as w:
            s = w.open_session("chat-9", SPEC)
            s.end_round()
    finally:
        server.stop(None)
    assert seen == [("OpenSession", "chat-9"), ("EndRound", "chat-9")]
