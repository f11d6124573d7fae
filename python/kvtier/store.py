"""A typed client of kvtier-store (kvtier.v1.Store) for inspection and
housekeeping: the rounds a session holds, their segments' bytes, usage, and
deletion. (Workers write and recall rounds; an engine rarely needs more.)"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import grpc

from kvtier._common import CallSettings, _error, channel
from kvtier.v1 import store_pb2, store_pb2_grpc

__all__ = ["StoreClient"]


class StoreClient:
    def __init__(self, address: str, token: Optional[str] = None, timeout: float = 30.0,
                 retries: int = 3, tls_root_cert: Optional[bytes] = None,
                 tls_cert_chain: Optional[bytes] = None,
                 tls_private_key: Optional[bytes] = None):
        self.address = address
        self.settings = CallSettings(token, timeout, retries)
        self._channel = channel(address, tls_root_cert, tls_cert_chain, tls_private_key)
        self._stub = store_pb2_grpc.StoreStub(self._channel)

    def list_rounds(self, session_id: str) -> store_pb2.ListRoundsResponse:
        """Every stored round of the session, ascending (NOT_FOUND: none)."""
        return self.settings.unary("ListRounds", self._stub.ListRounds,
                                   store_pb2.ListRoundsRequest(session_id=session_id))

    def list_sessions(self, limit: int = 1000, start_after: str = ""
                      ) -> store_pb2.ListSessionsResponse:
        return self.settings.unary("ListSessions", self._stub.ListSessions,
                                   store_pb2.ListSessionsRequest(limit=limit,
                                                                 start_after=start_after))

    def stats(self) -> store_pb2.StatsResponse:
        return self.settings.unary("Stats", self._stub.Stats, store_pb2.StatsRequest())

    def delete_session(self, session_id: str) -> None:
        self.settings.unary("DeleteSession", self._stub.DeleteSession,
                            store_pb2.DeleteSessionRequest(session_id=session_id))

    def get_segments(self, session_id: str, refs: Sequence[Tuple[int, int]],
                     uncounted: bool = True) -> Dict[Tuple[int, int], bytes]:
        """The payloads of (round, segment) refs (a serialized
        kvtier.v1.SegmentPayload each). uncounted: a read that does not count
        as a recall (the default here, for inspection)."""
        # accept_batches: small segments come whole, several to a message.
        req = store_pb2.GetSegmentsRequest(session_id=session_id, uncounted=uncounted,
                                           accept_batches=True)
        for r, s in refs:
            req.refs.add(round=r, segment=s)
        out: Dict[Tuple[int, int], bytes] = {}
        cur: Optional[Tuple[int, int]] = None
        parts: List[bytes] = []
        try:
            for msg in self._stub.GetSegments(req, timeout=self.settings.timeout,
                                              metadata=self.settings.metadata()):
                kind = msg.WhichOneof("msg")
                if kind == "chunk":
                    parts.append(msg.chunk)
                    continue
                if cur is not None:
                    out[cur] = b"".join(parts)
                    cur = None
                if kind == "header":
                    cur = (msg.header.segment.ref.round, msg.header.segment.ref.segment)
                    parts = []
                elif kind == "batch":
                    for item in msg.batch.segments:
                        ref = item.header.segment.ref
                        out[(ref.round, ref.segment)] = item.payload
        except grpc.RpcError as e:
            raise _error("GetSegments", e) from None
        if cur is not None:
            out[cur] = b"".join(parts)
        return out

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "StoreClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
