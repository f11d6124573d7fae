"""The worker engine inside this Python process, only kvtier-store remote: the
shape of an engine that keeps attention on its own device and uses kvtier for
what it keeps between rounds. Same sessions as WorkerClient, no hop per layer.

    w = InProcessWorker("127.0.0.1:7070")          # the store's address
    s = w.open_session("chat-1", ModelSpec(...), Policy(recall="mass:0.95"))
    with s.prefill(question_tokens=n) as p:
        out = p.layer(0, q, k, v)
    s.decode_layer(0, q1, k1, v1)
    s.end_round(); s.close()

AttentionConnector takes an InProcessWorker in place of a WorkerClient. Arrays
are float32 (others are converted); errors raise KvtierError with the status
the engine gave. The module is kvtier._inproc, built from python/src with
pybind11 (Debian's pybind11-dev).
"""

from __future__ import annotations

from typing import Optional

import grpc
import numpy as np

from kvtier._common import KvtierError
from kvtier.v1 import worker_pb2
from kvtier.worker import ModelSpec, Policy, _check, _StepScope

__all__ = ["InProcessWorker", "InProcessSession"]


try:
    from kvtier import _inproc
except ImportError as e:  # A build without pybind11: InProcessWorker says so.
    _inproc = None
    _missing = e


def _call(method, fn, *args):
    try:
        return fn(*args)
    except _inproc.Error as e:
        code, details = e.args if len(e.args) == 2 else ("UNKNOWN", str(e))
        raise KvtierError(method, getattr(grpc.StatusCode, code, grpc.StatusCode.UNKNOWN),
                          details) from None


class _Step(_StepScope):
    def __init__(self, s: "InProcessSession", question_tokens: int):
        self._s = s
        self._question = question_tokens
        self._started = False
        self._next = 0
        self._done = False
        self.recall: Optional[worker_pb2.RecallDecision] = None
        self.transfer = None

    def layer(self, layer: int, q, k, v) -> np.ndarray:
        spec = self._s.model
        n = np.asarray(q).shape[0]
        _check(q, n, spec.q_heads, spec.head_dim, "q")
        _check(k, n, spec.kv_heads, spec.head_dim, "k")
        _check(v, n, spec.kv_heads, spec.head_dim, "v")
        self._started = True
        out, recall = _call("Prefill", self._s._engine.prefill, self._s.id, layer,
                            np.asarray(q, np.float32), np.asarray(k, np.float32),
                            np.asarray(v, np.float32), self._question)
        if recall is not None:
            self.recall = worker_pb2.RecallDecision.FromString(recall)
        self._next = layer + 1
        return out

    def finish(self) -> None:
        # A step that did not reach its last layer is rolled back, as a
        # Prefill stream that ends early is on kvtier-worker.
        if not self._done:
            self._done = True
            if self._started and self._next != self._s.model.layers:
                _call("Prefill", self._s._engine.abort_step, self._s.id)

    def abandon(self) -> None:
        if not self._done:
            self._done = True
            _call("Prefill", self._s._engine.abort_step, self._s.id)


class InProcessSession:
    def __init__(self, engine, session_id: str, model: ModelSpec, effective: bytes):
        self._engine = engine
        self.id = session_id
        self.model = model
        self.effective_policy = worker_pb2.Policy.FromString(effective)
        self.next_round = 0
        self.on_device = False

    def prefill(self, question_tokens: int = 0, transfer_to: str = "") -> _Step:
        if transfer_to:
            raise ValueError("an in-process session cannot hand off (transfer_to)")
        return _Step(self, question_tokens)

    def decode_layer(self, layer: int, q, k, v, q_next=None) -> np.ndarray:
        spec = self.model
        _check(q, 1, spec.q_heads, spec.head_dim, "q")
        _check(k, 1, spec.kv_heads, spec.head_dim, "k")
        _check(v, 1, spec.kv_heads, spec.head_dim, "v")
        qn = None if q_next is None else np.asarray(q_next, np.float32)
        return _call("Decode", self._engine.decode, self.id, layer, np.asarray(q, np.float32),
                     np.asarray(k, np.float32), np.asarray(v, np.float32), qn)

    def end_round(self) -> worker_pb2.EndRoundResponse:
        return worker_pb2.EndRoundResponse.FromString(
            _call("EndRound", self._engine.end_round, self.id))

    def close(self, delete_from_store: bool = False) -> None:
        _call("CloseSession", self._engine.close, self.id, delete_from_store)


class InProcessWorker:
    """The worker engine in this process over the kvtier-store at
    `store` ("host:port"). Working sets live in host memory."""

    def __init__(self, store: str, token: Optional[str] = None):
        if _inproc is None:
            raise ImportError(f"kvtier._inproc is not built (pybind11-dev, python3-dev): "
                              f"{_missing}")
        self._engine = _call("Connect", _inproc.Engine, store, token or "", True)

    def open_session(self, session_id: str, model: ModelSpec,
                     policy: Optional[Policy] = None) -> InProcessSession:
        p = (policy or Policy()).proto()
        eff = _call("OpenSession", self._engine.open, session_id,
                    model.proto().SerializeToString(), p.SerializeToString())
        return InProcessSession(self._engine, session_id, model, eff)

    def put_skew(self, data: bytes) -> worker_pb2.PutSkewResponse:
        return worker_pb2.PutSkewResponse(skew_id=_call("PutSkew", self._engine.put_skew, data))
