"""A typed client of kvtier-worker (kvtier.v1.Worker): sessions, prefill and
decode layer by layer with numpy arrays, EndRound, skew upload.

    w = WorkerClient("127.0.0.1:7071")
    s = w.open_session("chat-1", ModelSpec(layers=5, q_heads=8, kv_heads=4, head_dim=8),
                       Policy(codec="kivi4", recall="mass:0.95"))
    with s.prefill(question_tokens=10) as p:
        out = p.layer(0, q, k, v)          # q [n, q_heads, d]; k, v [n, kv_heads, d]
        ...
    out = s.decode_layer(0, q, k, v)       # one token: [1, heads, d]
    report = s.end_round()                 # kvtier.v1.EndRoundResponse
    s.close()

Errors raise KvtierError with the worker's status code and message. A step that
fails (or is abandoned: an exception inside `with s.prefill()`, a decode stream
that breaks) is rolled back by the worker, so the caller sends the step again.
"""

from __future__ import annotations

import dataclasses
import queue
from typing import Iterable, List, Optional, Sequence, Tuple

import grpc
import numpy as np

from kvtier._common import (CallSettings, KvtierError, _error, channel, dtype_enum, from_dense,
                            to_dense, token_slices)
from kvtier.v1 import tensor_pb2, worker_pb2, worker_pb2_grpc

__all__ = ["ModelSpec", "Policy", "WorkerClient", "Session", "PrefillStep", "DecodeStream"]


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A model's attention geometry. dtype: what q/k/v travel in and what the
    working set holds the open round in ("float32", "float16", "bfloat16");
    name: what kvtier-controller's per-model policies are registered under."""
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: str = "float16"
    rope_theta: float = 10000.0
    name: str = ""  # The model's name: kvtier-controller's per-model policies key on it.

    def proto(self) -> tensor_pb2.ModelSpec:
        return tensor_pb2.ModelSpec(num_layers=self.layers, num_q_heads=self.q_heads,
                                    num_kv_heads=self.kv_heads, head_dim=self.head_dim,
                                    dtype=dtype_enum(self.dtype), rope_theta=self.rope_theta,
                                    name=self.name)


_CODECS = {"raw": (tensor_pb2.CODEC_RAW, 0)}
for _bits in (2, 4, 8):
    _CODECS[f"kivi{_bits}"] = (tensor_pb2.CODEC_KIVI, _bits)
    _CODECS[f"kcvt{_bits}"] = (tensor_pb2.CODEC_KCVT, _bits)
for _bits in (2, 4):
    _CODECS[f"gear{_bits}"] = (tensor_pb2.CODEC_GEAR, _bits)


@dataclasses.dataclass
class Policy:
    """A session's policy (docs/worker.md). Unset fields take the worker's
    published defaults. codec: "raw", "kivi2|4|8", "kcvt2|4|8", "gear2|4";
    eviction: "none", "streaming", "h2o", "snapkv", "pyramidkv", "ada-snapkv",
    "ada-pyramidkv" (also "streamingllm", "ada-pyramid") with budget_tokens;
    recall: "all", "topk:K",
    "adaptive:LAMBDA", "threshold:THETA", "mass:P"; speculation_skew: an id from
    WorkerClient.put_skew (docs/speculation.md); speculation_pool_bytes caps
    the host pool of a speculating session (0: none), and a trim takes it
    down to speculation_pool_low_bytes (0: the cap itself)."""
    codec: str = "raw"
    eviction: str = "none"
    budget_tokens: int = 0
    window: int = 0
    recall: str = ""
    watershed_layer: int = 0
    keep_recent_round: Optional[bool] = None
    release_after_end_round: Optional[bool] = None
    speculation_skew: str = ""
    speculation_alpha: float = 0.0
    speculation_budget: int = 0
    speculation_pool_bytes: int = 0
    speculation_pool_low_bytes: int = 0

    def proto(self) -> worker_pb2.Policy:
        if self.codec not in _CODECS:
            raise ValueError(f"codec {self.codec!r}: expected one of {sorted(_CODECS)}")
        codec, bits = _CODECS[self.codec]
        p = worker_pb2.Policy(codec=codec, eviction=self.eviction,
                              budget_tokens=self.budget_tokens, window=self.window,
                              recall=self.recall, watershed_layer=self.watershed_layer,
                              speculation_skew=self.speculation_skew,
                              speculation_alpha=self.speculation_alpha,
                              speculation_budget=self.speculation_budget,
                              speculation_pool_bytes=self.speculation_pool_bytes,
                              speculation_pool_low_bytes=self.speculation_pool_low_bytes)
        if bits:
            p.codec_params.bits = bits
        if self.keep_recent_round is not None:
            p.keep_recent_round = self.keep_recent_round
        if self.release_after_end_round is not None:
            p.release_after_end_round = self.release_after_end_round
        return p


_END = object()


class _Stream:
    """A bidirectional stream driven synchronously: send() queues a request,
    recv() waits for the next response."""

    def __init__(self, method: str, fn, settings: CallSettings, timeout: float,
                 session: Optional[str] = None):
        self._method = method
        self._q: "queue.Queue" = queue.Queue()
        self._call = fn(iter(self._q.get, _END), timeout=timeout,
                        metadata=settings.metadata(session))
        self.closed = False

    def send(self, req) -> None:
        if self.closed:
            raise KvtierError(self._method, grpc.StatusCode.FAILED_PRECONDITION,
                              "the stream is closed")
        self._q.put(req)

    def recv(self):
        try:
            return next(self._call)
        except grpc.RpcError as e:
            self.closed = True
            raise _error(self._method, e) from None
        except StopIteration:
            self.closed = True
            raise KvtierError(self._method, grpc.StatusCode.ABORTED,
                              "the worker ended the stream early") from None

    def finish(self) -> None:
        """Half-closes and waits for the worker's status."""
        if self.closed:
            return
        self.closed = True
        self._q.put(_END)
        try:
            for _ in self._call:
                raise KvtierError(self._method, grpc.StatusCode.INTERNAL,
                                  "an unexpected response after the last one")
        except grpc.RpcError as e:
            raise _error(self._method, e) from None

    def cancel(self) -> None:
        if not self.closed:
            self.closed = True
            self._call.cancel()
            self._q.put(_END)


class _StepScope:
    """A step as a context manager: finish() on a clean exit, abandon()
    (the step rolls back) when the block raises."""

    def finish(self) -> None:
        raise NotImplementedError

    def abandon(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finish()
        else:
            self.abandon()


class PrefillStep(_StepScope):
    """One prefill step of a session: every layer in order, then exit (or
    finish()). `recall` holds the recall decision once layer L_w answered
    (completed at L_w + 1 when a fetch was needed); `transfer` the hand-off
    report of a step sent with transfer_to."""

    def __init__(self, session: "Session", question_tokens: int, transfer_to: str):
        self._s = session
        self._question = question_tokens
        self._transfer_to = transfer_to
        self._stream = _Stream("Prefill", session._client._stub.Prefill, session._client.settings,
                               session._client.settings.timeout, session.id)
        self._first = True
        self.recall: Optional[worker_pb2.RecallDecision] = None
        self.transfer: Optional[worker_pb2.TransferReport] = None

    def layer(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Attention output [n, q_heads, d] (float32) of layer `layer` for n new
        tokens: q [n, q_heads, d], k and v [n, kv_heads, d], post-RoPE."""
        spec = self._s.model
        n = np.asarray(q).shape[0]
        _check(q, n, spec.q_heads, spec.head_dim, "q")
        _check(k, n, spec.kv_heads, spec.head_dim, "k")
        _check(v, n, spec.kv_heads, spec.head_dim, "v")
        dt = dtype_enum(spec.dtype)
        es = 4 if spec.dtype == "float32" else 2
        row = (spec.q_heads + 2 * spec.kv_heads) * spec.head_dim * es
        slices = token_slices(n, row)
        for i, sl in enumerate(slices):
            req = worker_pb2.LayerRequest(layer=layer, question_tokens=self._question,
                                          more_chunks=i + 1 < len(slices))
            if self._first:
                # The stream's first message names the session; layer 0's
                # first carries the hand-off target.
                req.session_id = self._s.id
                self._first = False
            if layer == 0 and i == 0 and self._transfer_to:
                req.transfer_to = self._transfer_to
            to_dense(np.asarray(q)[sl.start:sl.stop], dt, req.q)
            to_dense(np.asarray(k)[sl.start:sl.stop], dt, req.k)
            to_dense(np.asarray(v)[sl.start:sl.stop], dt, req.v)
            self._stream.send(req)
        outs = []
        while True:
            resp = self._stream.recv()
            outs.append(from_dense(resp.o))
            if resp.HasField("recall"):
                self.recall = resp.recall
            if resp.HasField("transfer"):
                self.transfer = resp.transfer
            if not resp.more_chunks:
                break
        out = np.concatenate(outs) if len(outs) > 1 else outs[0]
        if out.shape[0] != n:
            raise KvtierError("Prefill", grpc.StatusCode.INTERNAL,
                              f"layer {layer}: {out.shape[0]} output rows for {n} tokens")
        return out

    def finish(self) -> None:
        self._stream.finish()

    def abandon(self) -> None:
        """Cancels the step: the worker rolls it back."""
        self._stream.cancel()


class DecodeStream:
    """A long-lived Decode stream: each call sends one request with the
    layer's items of any number of sessions, and returns their outputs."""

    def __init__(self, client: "WorkerClient", timeout: float, session: Optional[str] = None):
        self._client = client
        self._stream = _Stream("Decode", client._stub.Decode, client.settings, timeout, session)

    def batch(self, items: Iterable[Tuple]) -> List[np.ndarray]:
        """items: (session, layer, q, k, v[, q_next]) with q [1, q_heads, d],
        k and v [1, kv_heads, d]; returns each item's output [1, q_heads, d]."""
        req = worker_pb2.DecodeRequest()
        for item in items:
            s, layer, q, k, v = item[:5]
            q_next = item[5] if len(item) > 5 else None
            spec = s.model
            _check(q, 1, spec.q_heads, spec.head_dim, "q")
            _check(k, 1, spec.kv_heads, spec.head_dim, "k")
            _check(v, 1, spec.kv_heads, spec.head_dim, "v")
            dt = dtype_enum(spec.dtype)
            it = req.items.add(session_id=s.id, layer=layer)
            to_dense(q, dt, it.q)
            to_dense(k, dt, it.k)
            to_dense(v, dt, it.v)
            if q_next is not None:
                _check(q_next, 1, spec.q_heads, spec.head_dim, "q_next")
                to_dense(q_next, dt, it.q_next)
        self._stream.send(req)
        resp = self._stream.recv()
        return [from_dense(o) for o in resp.o]

    def close(self) -> None:
        self._stream.finish()

    def cancel(self) -> None:
        self._stream.cancel()

    @property
    def closed(self) -> bool:
        return self._stream.closed


class Session:
    """A session on a worker (WorkerClient.open_session)."""

    def __init__(self, client: "WorkerClient", session_id: str, model: ModelSpec,
                 opened: worker_pb2.OpenSessionResponse):
        self._client = client
        self.id = session_id
        self.model = model
        self.effective_policy = opened.effective_policy
        self.next_round = opened.next_round
        self.on_device = opened.on_device
        # Speculation runs on the worker's GPU (past rounds in its host pool).
        self.speculation_on_device = opened.speculation_on_device
        self._decode: Optional[DecodeStream] = None

    def prefill(self, question_tokens: int = 0, transfer_to: str = "") -> PrefillStep:
        """Starts a prefill step (use as a context manager)."""
        return PrefillStep(self, question_tokens, transfer_to)

    def decode_layer(self, layer: int, q, k, v, q_next=None) -> np.ndarray:
        """One decode token at `layer` on this session's own Decode stream
        (opened on first use, closed by end_round or close)."""
        if self._decode is None or self._decode.closed:
            self._decode = DecodeStream(self._client, self._client.round_timeout, self.id)
        try:
            return self._decode.batch([(self, layer, q, k, v, q_next)])[0]
        except KvtierError:
            self._decode = None
            raise

    def _close_decode(self) -> None:
        if self._decode is not None:
            d, self._decode = self._decode, None
            if not d.closed:
                d.close()

    def end_round(self) -> worker_pb2.EndRoundResponse:
        """Eviction, encoding and storage of the open round."""
        self._close_decode()
        c = self._client
        return c.settings.unary("EndRound", c._stub.EndRound,
                                worker_pb2.EndRoundRequest(session_id=self.id), session=self.id)

    def close(self, delete_from_store: bool = False) -> None:
        self._close_decode()
        c = self._client
        c.settings.unary("CloseSession", c._stub.CloseSession,
                         worker_pb2.CloseSessionRequest(session_id=self.id,
                                                        delete_from_store=delete_from_store),
                         session=self.id)


def _check(x, n: int, heads: int, d: int, what: str) -> None:
    shape = np.asarray(x).shape
    if shape != (n, heads, d):
        raise ValueError(f"{what}: shape {shape}, expected {(n, heads, d)}")


class WorkerClient:
    """A kvtier-worker at `address` ("host:port"). timeout: seconds per unary
    call and per prefill step; round_timeout: a session's Decode stream, which
    lives for a round; retries: unary calls retried on UNAVAILABLE."""

    def __init__(self, address: str, token: Optional[str] = None, timeout: float = 30.0,
                 round_timeout: float = 300.0, retries: int = 3,
                 tls_root_cert: Optional[bytes] = None,
                 tls_cert_chain: Optional[bytes] = None,
                 tls_private_key: Optional[bytes] = None):
        self.address = address
        self.settings = CallSettings(token, timeout, retries)
        self.round_timeout = round_timeout
        self._channel = channel(address, tls_root_cert, tls_cert_chain, tls_private_key)
        self._stub = worker_pb2_grpc.WorkerStub(self._channel)

    def open_session(self, session_id: str, model: ModelSpec, policy: Optional[Policy] = None,
                     resume: bool = False, store_addresses: Sequence[str] = ()) -> Session:
        req = worker_pb2.OpenSessionRequest(session_id=session_id, model=model.proto(),
                                            resume=resume, store_addresses=list(store_addresses))
        if policy is not None:
            req.policy.CopyFrom(policy.proto())
        resp = self.settings.unary("OpenSession", self._stub.OpenSession, req, session=session_id)
        return Session(self, session_id, model, resp)

    def decode_stream(self) -> DecodeStream:
        """A Decode stream for batching several sessions' layers per request.
        It carries no x-kvtier-session header: in a mesh that routes by the
        header, use each session's own stream (Session.decode_layer)."""
        return DecodeStream(self, self.round_timeout)

    def put_skew(self, data: bytes) -> worker_pb2.PutSkewResponse:
        """Uploads a skew file (kvtier calibrate infinigen) in 1 MiB slices;
        its skew_id goes in Policy.speculation_skew."""
        slices = [worker_pb2.PutSkewRequest(data=data[i:i + (1 << 20)])
                  for i in range(0, len(data), 1 << 20)]
        try:
            return self._stub.PutSkew(iter(slices), timeout=self.settings.timeout,
                                      metadata=self.settings.metadata())
        except grpc.RpcError as e:
            raise _error("PutSkew", e) from None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "WorkerClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
