"""An engine connector shaped like vLLM's KV connector (KVConnectorBase_V1):
per-layer save and load hooks, start-load / wait-for-layer, request finished.

kvtier computes attention where the K/V live, so the hooks carry a layer's
q/k/v to kvtier-worker and bring back the layer's attention output instead of
K/V blocks. One request id is one conversation (a kvtier session); a turn of
the conversation is a round, ended by request_finished.

    conn = AttentionConnector("127.0.0.1:7071", ModelSpec(...), Policy(recall="mass:0.95"))
    conn.start_load_kv("chat-1", num_tokens=len(prompt), prefill=True)
    for layer in range(L):                       # inside the model's forward
        conn.save_kv_layer("chat-1", layer, q, k, v)
        out = conn.wait_for_layer_load("chat-1", layer)
    conn.wait_for_save("chat-1")                 # the step is done
    ...                                          # decode steps: prefill=False, n = 1
    conn.request_finished("chat-1")              # EndRound: the turn is stored
    conn.close("chat-1")                         # when the conversation ends

save_kv_layer queues the layer and returns: one sender thread per connector
sends the queued layers in order, so the send overlaps whatever the engine
does before wait_for_layer_load (another request's layer, say), which waits
for that layer's output. The arrays given to save_kv_layer must stay
unchanged until that layer's wait_for_layer_load returns. A connector may be
used from one engine thread at a time. A failed step raises KvtierError (at
wait_for_layer_load or wait_for_save); the worker has rolled it back, and
the engine runs the step again (start_load_kv again, every layer from 0).
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Dict, Optional

import numpy as np

from kvtier._common import KvtierError
from kvtier.worker import ModelSpec, Policy, PrefillStep, Session, WorkerClient, _check

__all__ = ["AttentionConnector"]


@dataclasses.dataclass
class _Request:
    session: Session
    step: Optional[PrefillStep] = None
    prefill: bool = False
    num_tokens: int = 0
    # Each saved layer's send, resolving to its attention output.
    outputs: Dict[int, Future] = dataclasses.field(default_factory=dict)
    q_next: Optional[np.ndarray] = None
    failed: bool = False  # A send of this step failed; the step is abandoned.
    rounds: list = dataclasses.field(default_factory=list)


class AttentionConnector:
    def __init__(self, worker: "str | WorkerClient | InProcessWorker", model: ModelSpec,
                 policy: Optional[Policy] = None, token: Optional[str] = None,
                 skew: Optional[bytes] = None):
        """worker: a kvtier-worker's address, a WorkerClient, or an
        InProcessWorker (kvtier.inproc: the worker engine in this process).
        skew: a skew file's bytes to speculate with (docs/speculation.md); it
        is uploaded once and named in every session's policy."""
        self.worker = WorkerClient(worker, token) if isinstance(worker, str) else worker
        self.model = model
        self.policy = dataclasses.replace(policy) if policy is not None else Policy()
        if skew is not None:
            self.policy.speculation_skew = self.worker.put_skew(skew).skew_id
        self._requests: Dict[str, _Request] = {}
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-connector")

    # ---- the step ----

    def start_load_kv(self, request_id: str, num_tokens: int, prefill: bool,
                      question_tokens: int = 0) -> None:
        """Begins a step of `num_tokens` new tokens: a prefill (a turn's
        prompt) or one decode token. Opens the session on first use, and ends
        the previous step (wait_for_save) if the engine did not."""
        r = self._requests.get(request_id)
        if r is None:
            s = self.worker.open_session(request_id, self.model, self.policy)
            r = self._requests[request_id] = _Request(s)
        if not prefill and num_tokens != 1:
            raise ValueError(f"a decode step carries one token, not {num_tokens}")
        # The previous step ends here if the engine did not end it; one
        # that failed was abandoned, and this step runs it again.
        if r.failed:
            self._drain(r)
            r.failed = False
        self.wait_for_save(request_id)
        r.prefill, r.num_tokens = prefill, num_tokens
        r.outputs.clear()
        r.step = r.session.prefill(question_tokens) if prefill else None

    def save_kv_layer(self, request_id: str, layer: int, q: np.ndarray, k: np.ndarray,
                      v: np.ndarray) -> None:
        """Queues the layer's new q [n, q_heads, d] and k, v [n, kv_heads, d]
        (post-RoPE) for the worker and returns."""
        r = self._get(request_id)
        if layer in r.outputs:
            raise ValueError(f"{request_id}: layer {layer} was already saved in this step")
        # Shapes are checked here, so a wrong one fails the call that made it.
        spec = r.session.model
        n = r.num_tokens
        _check(q, n, spec.q_heads, spec.head_dim, "q")
        _check(k, n, spec.kv_heads, spec.head_dim, "k")
        _check(v, n, spec.kv_heads, spec.head_dim, "v")
        q_next, r.q_next = r.q_next, None
        if r.prefill:
            step = r.step
            r.outputs[layer] = self._sender.submit(step.layer, layer, q, k, v)
        else:
            r.outputs[layer] = self._sender.submit(r.session.decode_layer, layer, q, k, v,
                                                   q_next)

    def save_next_layer_query(self, request_id: str, q_next: np.ndarray) -> None:
        """For a speculating session: the next layer's approximate query
        [1, q_heads, d], sent with the next save_kv_layer of a decode step."""
        self._get(request_id).q_next = q_next

    def wait_for_layer_load(self, request_id: str, layer: int) -> np.ndarray:
        """The layer's attention output [n, q_heads, d] (float32), once its
        send is answered. KvtierError: the step failed and was abandoned."""
        r = self._get(request_id)
        try:
            sent = r.outputs.pop(layer)
        except KeyError:
            raise ValueError(f"{request_id}: layer {layer} was not saved in this step") from None
        try:
            return sent.result()
        except KvtierError:
            self._abandon(r)
            raise

    def wait_for_save(self, request_id: str) -> None:
        """Ends the step: waits for every queued layer, then closes the step.
        KvtierError: a send failed and the step was abandoned."""
        r = self._get(request_id)
        try:
            for layer in sorted(r.outputs):
                r.outputs[layer].result()
        except KvtierError:
            self._abandon(r)
            raise
        if r.step is not None:
            step, r.step = r.step, None
            step.finish()

    def _abandon(self, r: _Request) -> None:
        r.failed = True
        self._drain(r)
        if r.step is not None:
            r.step.abandon()
            r.step = None

    @staticmethod
    def _drain(r: _Request) -> None:
        """Waits out the step's queued sends, whatever their outcome."""
        for sent in r.outputs.values():
            try:
                sent.result()
            except KvtierError:
                pass
        r.outputs.clear()

    # ---- the turn and the conversation ----

    def request_finished(self, request_id: str):
        """The turn is over: EndRound (eviction, encoding, storage). Returns the
        worker's kvtier.v1.EndRoundResponse."""
        r = self._get(request_id)
        self.wait_for_save(request_id)
        rep = r.session.end_round()
        r.rounds.append(rep)
        return rep

    def close(self, request_id: str, delete_from_store: bool = False) -> None:
        r = self._requests.pop(request_id, None)
        if r is None:
            return
        self._drain(r)
        if r.step is not None:
            r.step.abandon()
        r.session.close(delete_from_store)

    def rounds(self, request_id: str) -> list:
        """The EndRound reports of the request's turns so far."""
        return list(self._get(request_id).rounds)

    def _get(self, request_id: str) -> _Request:
        try:
            return self._requests[request_id]
        except KeyError:
            raise KeyError(f"unknown request {request_id!r}: call start_load_kv first") from None
