"""AttentionConnector driving kvtier-worker from the numpy llama2.c model on the
sample conversations (traces/stories260k_chats.jsonl): the tier's logits match
an in-process full cache, and its greedy answers on the scored spans match the
ones the C++ reference engine recorded in the file."""

import json
import os
import subprocess
import tempfile

import numpy as np
import pytest

from conftest import BUILD, SOURCE, require_model
from kvtier import AttentionConnector, ModelSpec, Policy
from kvtier.llama import FullCacheAttention, Llama

CONVERSATIONS = os.path.join(SOURCE, "traces", "stories260k_chats.jsonl")


def load_conversations():
    with open(CONVERSATIONS) as f:
        return [json.loads(line) for line in f if line.strip()]


class Through:
    """The model's attention through the connector, one step at a time."""

    def __init__(self, conn, request_id, speculate=False):
        self.conn, self.id, self.speculate = conn, request_id, speculate

    def __call__(self, layer, pos, q, k, v):
        self.conn.save_kv_layer(self.id, layer, q, k, v)
        return self.conn.wait_for_layer_load(self.id, layer)

    def next_layer_query(self, layer, pos, q_next):
        if q_next.shape[0] == 1:
            self.conn.save_next_layer_query(self.id, q_next)


def replay(m, conn, conv, request_id, speculate=False):
    """Teacher-forced replay of one conversation, as kvtier-engine does it:
    each round's user tokens as one prefill, then one decode step per
    assistant token. Returns per round the tier's and the full cache's logits
    before each assistant token."""
    local = FullCacheAttention(m.config)
    tier = Through(conn, request_id)
    nlq = tier.next_layer_query if speculate else None
    pos, rounds = 0, []
    for r in conv["rounds"]:
        user, answer = r["user"], r["assistant"]
        conn.start_load_kv(request_id, len(user), prefill=True, question_tokens=len(user))
        got = m.forward(user, pos, tier, nlq)[-1]
        conn.wait_for_save(request_id)
        want = m.forward(user, pos, local)[-1]
        pos += len(user)
        tl, ll = [], []
        for t in answer:
            tl.append(got)
            ll.append(want)
            conn.start_load_kv(request_id, 1, prefill=False)
            got = m.forward([t], pos, tier, nlq)[-1]
            conn.wait_for_save(request_id)
            want = m.forward([t], pos, local)[-1]
            pos += 1
        conn.request_finished(request_id)
        rounds.append((np.array(tl), np.array(ll)))
    return rounds


def in_process(store_address):
    """An InProcessWorker over the store, or a skip (a failure under CI=true)
    when this build has no kvtier._inproc."""
    from kvtier.inproc import InProcessWorker
    try:
        return InProcessWorker(store_address)
    except ImportError as e:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but kvtier._inproc is not built: {e}")
        pytest.skip(str(e))


@pytest.mark.parametrize("mode", ["remote", "inproc"])
def test_replay_matches_full_cache_and_reference_engine(stack, mode):
    m = Llama.load(require_model())
    store, worker = stack
    c = m.config
    spec = ModelSpec(c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, dtype="float32")
    target = worker.address if mode == "remote" else in_process(store.address)
    conn = AttentionConnector(target, spec, Policy(recall="all"))
    worst, flips, scored, positions = 0.0, 0, 0, 0
    for i, conv in enumerate(load_conversations()):
        rounds = replay(m, conn, conv, f"{mode}-{i}")
        reports = conn.rounds(f"{mode}-{i}")
        assert [x.round for x in reports] == list(range(len(conv["rounds"])))
        for (tier, local), r in zip(rounds, conv["rounds"]):
            if len(tier) == 0:
                continue
            positions += len(tier)
            worst = max(worst, float(np.abs(tier - local).max()))
            for b, e in r.get("score", []):
                for j in range(b, e):
                    scored += 1
                    flips += int(np.argmax(tier[j])) != r["assistant"][j]
        conn.close(f"{mode}-{i}", delete_from_store=True)
    # recall=all and raw rounds are lossless: the tier is the full cache up to
    # float rounding, and its greedy answers are the C++ reference engine's.
    assert positions == 971
    assert worst < 1e-3, worst
    assert scored == 308
    assert flips <= 3, flips
    print(f"{mode}: {positions} positions, logits within {worst:.2e}, {flips} of {scored} scored flipped")


def speculating(model):
    """The model, its ModelSpec and its skew file's bytes (kvtier calibrate
    infinigen)."""
    m = Llama.load(model)
    with tempfile.TemporaryDirectory(prefix="kvtier-skew-") as d:
        skew = os.path.join(d, "s.skew")
        subprocess.run([os.path.join(BUILD, "tools/kvtier"), "calibrate", "infinigen",
                        f"--model={model}", f"--out={skew}"], check=True, capture_output=True)
        with open(skew, "rb") as f:
            data = f.read()
    c = m.config
    spec = ModelSpec(c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, dtype="float32")
    return m, spec, data


@pytest.mark.parametrize("mode", ["remote", "inproc"])
def test_speculation_through_the_connector(stack, mode):
    m, spec, skew = speculating(require_model())
    c = m.config
    store, worker = stack
    target = worker.address if mode == "remote" else in_process(store.address)
    conn = AttentionConnector(target, spec,
                           Policy(recall="all", speculation_alpha=4, speculation_budget=16),
                           skew=skew)
    conv = load_conversations()[0]
    replay(m, conn, conv, f"spec-{mode}", speculate=True)
    reports = conn.rounds(f"spec-{mode}")
    assert len(reports[0].speculation) == 0  # Nothing in the past yet.
    for rep, r in zip(reports[1:], conv["rounds"][1:]):
        layers = rep.speculation
        assert len(layers) == c.n_layers
        assert layers[0].steps == 0
        for x in layers[1:]:
            assert x.steps == len(r["assistant"])
            assert x.kept <= 16 * x.steps
            assert x.bytes_speculative < x.bytes_dense
    conn.close(f"spec-{mode}", delete_from_store=True)


def test_speculation_pool_through_the_connector(stack):
    """A host-pool cap (Policy.speculation_pool_bytes): EndRound trims the
    pool under the cap and reports it."""
    m, spec, skew = speculating(require_model())
    _, worker = stack
    cap = 32768
    conn = AttentionConnector(worker.address, spec,
                           Policy(recall="all", speculation_alpha=4, speculation_pool_bytes=cap),
                           skew=skew)
    conv = load_conversations()[0]
    replay(m, conn, conv, "pool", speculate=True)
    pools = [rep.speculation_pool for rep in conn.rounds("pool")]
    assert all(p.cap_bytes == cap for p in pools), pools
    trimmed = [p for p in pools if p.evicted_tokens > 0]
    assert trimmed, pools
    for p in trimmed:
        assert p.bytes_after <= cap < p.bytes_before, p
        assert p.reencoded_layers > 0
    conn.close("pool", delete_from_store=True)
