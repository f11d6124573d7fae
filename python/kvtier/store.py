"""A typed client of kvtier-store (kvtier.v1.Store) for inspection and
housekeeping: the rounds a session holds, their segments' bytes, usage, and
deletion. (Workers write and recall rounds; an engine rarely needs more.)"""

from __future__ import annotations

from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import grpc

from kvtier._common import CallSettings, _error, channel
from kvtier.v1 import store_pb2, store_pb2_grpc

__all__ = ["StoreClient", "read_segments"]


def read_segments(responses: Iterable[store_pb2.GetSegmentsResponse]
                  ) -> Iterator[Tuple[store_pb2.GetSegmentsHeader, Optional[bytes]]]:
    """(header, payload) per segment of a GetSegments stream, in request
    order, whether it came as a header and chunks or in a batch; the payload
    is None for a segment flagged missing (missing_ok)."""
    header: Optional[store_pb2.GetSegmentsHeader] = None
    parts: List[bytes] = []
    for msg in responses:
        kind = msg.WhichOneof("msg")
        if kind == "chunk":
            parts.append(msg.chunk)
            continue
        if header is not None:
            yield header, b"".join(parts)
            header = None
        if kind == "header":
            if msg.header.missing:
                yield msg.header, None
            else:
                header, parts = msg.header, []
        elif kind == "batch":
            for item in msg.batch.segments:
                yield item.header, None if item.header.missing else item.payload
    if header is not None:
        yield header, b"".join(parts)


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
        try:
            for header, payload in read_segments(self._stub.GetSegments(
                    req, timeout=self.settings.timeout, metadata=self.settings.metadata())):
                out[(header.segment.ref.round, header.segment.ref.segment)] = payload
        except grpc.RpcError as e:
            raise _error("GetSegments", e) from None
        return out

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "StoreClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
