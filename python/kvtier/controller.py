"""A typed client of kvtier-controller (kvtier.v1.Controller): where a
session lives (Route), the cluster's nodes, and per-model policies.

    c = ControllerClient("ctl-a:7072,ctl-b:7072")   # any replica serves any call
    r = c.route("chat-1", ModelSpec(...))
    w = WorkerClient(r.worker_address)
    s = w.open_session("chat-1", ModelSpec(...), store_addresses=list(r.store_addresses))

A worker that does not answer: route(..., avoid_worker_node_id=r.worker_node_id)
moves the session to the next live worker, where it resumes from the store
(open_session(..., resume=True)); docs/cluster.md. A decode worker that does not
answer while it holds the session: route(..., avoid_worker_node_id=
r.decode_worker_node_id) keeps the session's worker and names another decode
worker (or none); resume the session on r.worker_address.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import grpc

from kvtier._common import CallSettings, KvtierError, channel
from kvtier.v1 import controller_pb2, controller_pb2_grpc
from kvtier.worker import ModelSpec, Policy

__all__ = ["ControllerClient"]


class ControllerClient:
    """kvtier-controller at `addresses`: one "host:port", or several
    comma-separated replicas, tried in order when one is UNAVAILABLE."""

    def __init__(self, addresses: str, token: Optional[str] = None, timeout: float = 10.0,
                 retries: int = 3, tls_root_cert: Optional[bytes] = None,
                 tls_cert_chain: Optional[bytes] = None,
                 tls_private_key: Optional[bytes] = None):
        self.addresses = [a for a in addresses.split(",") if a]
        if not self.addresses:
            raise ValueError("no controller address")
        self.settings = CallSettings(token, timeout, retries)
        self._channels = [channel(a, tls_root_cert, tls_cert_chain, tls_private_key)
                          for a in self.addresses]
        self._stubs = [controller_pb2_grpc.ControllerStub(c) for c in self._channels]
        self._next = 0

    def _call(self, method: str, request, session: Optional[str] = None):
        last: Optional[KvtierError] = None
        for i in range(len(self._stubs)):
            stub = self._stubs[(self._next + i) % len(self._stubs)]
            try:
                out = self.settings.unary(method, getattr(stub, method), request, session=session)
                self._next = (self._next + i) % len(self._stubs)
                return out
            except KvtierError as e:
                if e.code != grpc.StatusCode.UNAVAILABLE:
                    raise
                last = e
        raise last

    def route(self, session_id: str, model: ModelSpec, need_bytes: int = 0,
              avoid_worker_node_id: str = "") -> controller_pb2.RouteResponse:
        """The session's worker and store replicas (placing it on first use)."""
        return self._call("Route", controller_pb2.RouteRequest(
            session_id=session_id, model=model.proto(), need_bytes=need_bytes,
            avoid_worker_node_id=avoid_worker_node_id), session=session_id)

    def list_nodes(self) -> controller_pb2.ListNodesResponse:
        return self._call("ListNodes", controller_pb2.ListNodesRequest())

    def set_policy(self, model_name: str, policy: Policy,
                   layer_budgets: Sequence[int] = (), profile_name: str = "") -> bool:
        """Registers the policy of a model's sessions; True when it replaced one."""
        return self._call("SetPolicy", controller_pb2.SetPolicyRequest(
            model_name=model_name, policy=policy.proto(), layer_budgets=list(layer_budgets),
            profile_name=profile_name)).replaced

    def get_policy(self, model_name: str, session_id: str,
                   idle_ms: int = 0) -> controller_pb2.GetPolicyResponse:
        """The policy `session_id`, a session of the model, gets now (memory
        pressure and idleness included). NOT_FOUND: no policy registered."""
        m = controller_pb2.GetPolicyRequest(session_id=session_id, idle_ms=idle_ms)
        m.model.name = model_name
        return self._call("GetPolicy", m, session=session_id)

    def close(self) -> None:
        for c in self._channels:
            c.close()

    def __enter__(self) -> "ControllerClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
