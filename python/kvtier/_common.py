"""Shared pieces of the kvtier Python clients: errors, channels, deadlines,
retries, and numpy <-> DenseTensor."""

from __future__ import annotations

import random
import time
from typing import Callable, Optional, Sequence, TypeVar

import grpc
import numpy as np

from kvtier.v1 import tensor_pb2, worker_pb2

T = TypeVar("T")

# Keep each message under about 1 MiB, as the C++ clients do (the servers
# accept up to 4 MiB).
CHUNK_BYTES = 1 << 20

_DTYPES = {
    "float32": tensor_pb2.DTYPE_FP32,
    "float16": tensor_pb2.DTYPE_FP16,
    "bfloat16": tensor_pb2.DTYPE_BF16,
}


class KvtierError(Exception):
    """A kvtier call failed. `code` is the gRPC status code (grpc.StatusCode),
    `details` the server's message, `method` the call."""

    def __init__(self, method: str, code: grpc.StatusCode, details: str):
        super().__init__(f"{method}: {code.name}: {details}")
        self.method = method
        self.code = code
        self.details = details


def _error(method: str, e: grpc.RpcError) -> KvtierError:
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    details = e.details() if hasattr(e, "details") else str(e)
    return KvtierError(method, code, details or "")


def dtype_enum(name: str) -> int:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r}: expected one of {sorted(_DTYPES)}") from None


def channel(address: str, tls_root_cert: Optional[bytes] = None,
            tls_cert_chain: Optional[bytes] = None,
            tls_private_key: Optional[bytes] = None) -> grpc.Channel:
    """A channel to a kvtier server ("host:port"); TLS when given the CA's PEM,
    presenting this client's certificate chain and key (PEM) when given, for a
    server that requires one (--tls_client_ca)."""
    if (tls_cert_chain is None) != (tls_private_key is None):
        raise ValueError("tls_cert_chain and tls_private_key go together")
    if tls_cert_chain is not None and tls_root_cert is None:
        raise ValueError("a client certificate needs TLS: give tls_root_cert too")
    if tls_root_cert is not None:
        return grpc.secure_channel(address, grpc.ssl_channel_credentials(
            tls_root_cert, private_key=tls_private_key, certificate_chain=tls_cert_chain))
    return grpc.insecure_channel(address)


class CallSettings:
    """What every call of a client carries: the bearer token, the deadline
    (seconds) and how unary calls retry (on UNAVAILABLE only, with jittered
    exponential backoff; streams are never retried by the client, because the
    worker rolls a broken step back and the caller sends the step again)."""

    def __init__(self, token: Optional[str] = None, timeout: float = 30.0, retries: int = 3,
                 backoff: float = 0.1):
        if timeout <= 0:
            raise ValueError(f"timeout {timeout}: must be > 0 seconds")
        if retries < 0:
            raise ValueError(f"retries {retries}: must be >= 0")
        self.token = token
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff

    def metadata(self, session: Optional[str] = None):
        """The call's metadata: the bearer token, and the session's id as
        x-kvtier-session, which a service mesh hashes on to keep a
        conversation on its worker (deploy/k8s/overlays/mesh)."""
        md = []
        if self.token:
            md.append(("authorization", f"Bearer {self.token}"))
        if session:
            md.append(("x-kvtier-session", session))
        return tuple(md) or None

    def unary(self, method: str, fn: Callable[..., T], request, timeout: Optional[float] = None,
              session: Optional[str] = None) -> T:
        attempt = 0
        while True:
            try:
                return fn(request, timeout=timeout or self.timeout,
                          metadata=self.metadata(session))
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or attempt >= self.retries:
                    raise _error(method, e) from None
                time.sleep(self.backoff * (2 ** attempt) * (0.5 + random.random()))
                attempt += 1


def to_dense(x: np.ndarray, dtype: int, out: Optional[worker_pb2.DenseTensor] = None
             ) -> worker_pb2.DenseTensor:
    """A [tokens, heads, head_dim] array as a DenseTensor in `dtype`."""
    x = np.asarray(x)
    if x.ndim != 3:
        raise ValueError(f"expected [tokens, heads, head_dim], got shape {x.shape}")
    t = out if out is not None else worker_pb2.DenseTensor()
    t.dtype = dtype
    del t.shape[:]
    t.shape.extend(int(s) for s in x.shape)
    if dtype == tensor_pb2.DTYPE_FP32:
        t.data = np.ascontiguousarray(x, dtype="<f4").tobytes()
    elif dtype == tensor_pb2.DTYPE_FP16:
        t.data = np.ascontiguousarray(x, dtype="<f2").tobytes()
    elif dtype == tensor_pb2.DTYPE_BF16:
        # Round to nearest even, as the worker's own conversion does.
        u = np.ascontiguousarray(x, dtype="<f4").view("<u4")
        u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2")
        t.data = u.tobytes()
    else:
        raise ValueError(f"unknown dtype {dtype}")
    return t


def from_dense(t: worker_pb2.DenseTensor) -> np.ndarray:
    """A DenseTensor as a float32 array of its shape."""
    shape = tuple(t.shape)
    if t.dtype == tensor_pb2.DTYPE_FP32:
        x = np.frombuffer(t.data, "<f4")
    elif t.dtype == tensor_pb2.DTYPE_FP16:
        x = np.frombuffer(t.data, "<f2").astype(np.float32)
    elif t.dtype == tensor_pb2.DTYPE_BF16:
        x = (np.frombuffer(t.data, "<u2").astype("<u4") << 16).view("<f4")
    else:
        raise ValueError(f"unknown dtype {t.dtype}")
    if int(np.prod(shape)) != x.size:
        raise ValueError(f"tensor of shape {shape} holds {x.size} elements")
    return x.reshape(shape).astype(np.float32, copy=False)


def token_slices(n: int, row_bytes: int) -> Sequence[range]:
    """Token ranges of at most CHUNK_BYTES each (at least one token)."""
    per = max(1, CHUNK_BYTES // max(1, row_bytes))
    return [range(t, min(n, t + per)) for t in range(0, n, per)]
