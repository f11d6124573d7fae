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

save_kv_layer sends at once; wait_for_layer_load waits for that layer's
output, so an engine can do other work between the two. A failed step raises
KvtierError; the worker has rolled it back, and the engine runs the step again
(start_load_kv again, every layer from 0).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional

import numpy as np

from kvtier._common import KvtierError
from kvtier.worker import ModelSpec, Policy, PrefillStep, Session, WorkerClient

__all__ = ["AttentionConnector"]


@dataclasses.dataclass
class _Request:
    session: Session
    step: Optional[PrefillStep] = None
    prefill: bool = False
    num_tokens: int = 0
    outputs: Dict[int, np.ndarray] = dataclasses.field(default_factory=dict)
    q_next: Optional[np.ndarray] = None
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
        # The previous step ends here if the engine did not end it.
        self.wait_for_save(request_id)
        r.prefill, r.num_tokens = prefill, num_tokens
        r.outputs.clear()
        r.step = r.session.prefill(question_tokens) if prefill else None

    def save_kv_layer(self, request_id: str, layer: int, q: np.ndarray, k: np.ndarray,
                      v: np.ndarray) -> None:
        """The layer's new q [n, q_heads, d] and k, v [n, kv_heads, d]
        (post-RoPE), sent to the worker."""
        r = self._get(request_id)
        try:
            if r.prefill:
                r.outputs[layer] = r.step.layer(layer, q, k, v)
            else:
                r.outputs[layer] = r.session.decode_layer(layer, q, k, v, r.q_next)
                r.q_next = None
        except KvtierError:
            if r.step is not None:
                r.step.abandon()
                r.step = None
            raise

    def save_next_layer_query(self, request_id: str, q_next: np.ndarray) -> None:
        """For a speculating session: the next layer's approximate query
        [1, q_heads, d], sent with the next save_kv_layer of a decode step."""
        self._get(request_id).q_next = q_next

    def wait_for_layer_load(self, request_id: str, layer: int) -> np.ndarray:
        """The layer's attention output [n, q_heads, d] (float32)."""
        r = self._get(request_id)
        try:
            return r.outputs.pop(layer)
        except KeyError:
            raise ValueError(f"{request_id}: layer {layer} was not saved in this step") from None

    def wait_for_save(self, request_id: str) -> None:
        """Ends the step (every layer sent)."""
        r = self._get(request_id)
        if r.step is not None:
            step, r.step = r.step, None
            step.finish()

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
