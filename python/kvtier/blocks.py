"""Content-addressed KV blocks: a prefix's K/V kept once in kvtier-store and
found again by any request that starts with the same tokens (docs/vllm.md).

A block holds `block_tokens` tokens of every layer. Its key is a SHA-256 hash
chain: the chain's root digests everything that decides whether two blocks'
K/V are interchangeable (the namespace, the request's cache salt, the model's
weights digest, the KV layout with its codec, the attention policy the K/V
were computed under), and each block's key digests the previous key and its
own token ids. Equal keys therefore mean equal K/V; any difference in those
inputs gives disjoint chains. The store keeps each block as a session named
`blk.<key hex>` of the caller's tenant (one round, one segment holding a K
and a V EncodedTensor of shape [layers, kv_heads, tokens, head_dim]), so
tenants never see each other's blocks, and `Store.LookupChain` answers how
many leading blocks of a chain are stored in one call.

Codecs: "raw" (bit-exact) and "kiviB[:g=G]" (B in 2, 4, 8; K per channel in
groups of G tokens, V per token in groups of G channels, fp16 scale and zero
per group, no residual), written in tensor.proto's byte layout
(kernels/codec.h), so kvtier's own decoders read them too.

Thread safety: BlockStore's methods may be called from several threads.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import crc32c as _crc32c
import grpc
import numpy as np

from kvtier._common import CHUNK_BYTES, CallSettings, KvtierError, _error, channel
from kvtier.store import read_segments
from kvtier.v1 import store_pb2, store_pb2_grpc, tensor_pb2

__all__ = ["BlockLayout", "ChainRoot", "chain_keys", "block_name", "encode_block",
           "decode_block", "BlockStore", "parse_codec"]

BLOCK_PREFIX = "blk."
_CODEC = re.compile(r"^(raw|kivi([248])(?::g=([0-9]+))?)$")
_DTYPES = {"bf16": tensor_pb2.DTYPE_BF16, "fp16": tensor_pb2.DTYPE_FP16,
           "fp32": tensor_pb2.DTYPE_FP32}


def parse_codec(spec: str) -> Tuple[str, int, int]:
    """("raw", 0, 0) or ("kivi", bits, group). ValueError names the spec."""
    m = _CODEC.match(spec)
    if m is None:
        raise ValueError(f"block codec {spec!r}: expected raw or kiviB[:g=G] with B in 2, 4, 8")
    if m.group(1) == "raw":
        return "raw", 0, 0
    group = int(m.group(3)) if m.group(3) else 32
    if group < 1:
        raise ValueError(f"block codec {spec!r}: the group size must be at least 1")
    return "kivi", int(m.group(2)), group


@dataclasses.dataclass(frozen=True)
class BlockLayout:
    """What a block's bytes look like: part of every key, so K/V of another
    layout, codec or tensor-parallel shard is never served."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_tokens: int
    dtype: str = "bf16"  # of the K/V as the engine holds them: bf16, fp16, fp32
    codec: str = "raw"
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self):
        parse_codec(self.codec)
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype {self.dtype!r}: expected one of {sorted(_DTYPES)}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_tokens", "tp_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"BlockLayout.{name} must be at least 1")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} outside [0, {self.tp_size})")

    def describe(self) -> str:
        return (f"layers={self.num_layers};kv_heads={self.num_kv_heads};"
                f"head_dim={self.head_dim};block={self.block_tokens};dtype={self.dtype};"
                f"codec={self.codec};tp={self.tp_rank}/{self.tp_size}")


@dataclasses.dataclass(frozen=True)
class ChainRoot:
    """Everything but the tokens that a block's K/V depend on.

    namespace: the tenant's (or an operator-declared shared) namespace.
    cache_salt: the request's salt ("" for none): requests with different
      salts never share a block.
    model_digest: a digest of the model's weights, never of its config alone.
    attention: the policy the K/V were computed under; only "full" K/V is a
      function of the prefix, so only it is shareable across requests.
    """
    namespace: str
    model_digest: str
    layout: BlockLayout
    cache_salt: str = ""
    attention: str = "full"

    def digest(self) -> bytes:
        h = hashlib.sha256(b"kvtier.blocks.v1")
        for part in (self.namespace, self.cache_salt, self.model_digest, self.layout.describe(),
                     self.attention):
            raw = part.encode()
            h.update(len(raw).to_bytes(8, "little"))
            h.update(raw)
        return h.digest()


def chain_keys(root: ChainRoot, token_ids: Sequence[int], limit: Optional[int] = None
               ) -> List[bytes]:
    """The keys of the full blocks of `token_ids` (at most `limit` of them), in
    order; a partial last block has none."""
    n = root.layout.block_tokens
    count = len(token_ids) // n
    if limit is not None:
        count = min(count, limit)
    tokens = np.asarray(token_ids[:count * n], dtype=np.int64)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 1 << 32):
        raise ValueError("token ids must lie in [0, 2^32)")
    words = tokens.astype("<u4")
    keys: List[bytes] = []
    prev = root.digest()
    for i in range(count):
        prev = hashlib.sha256(prev + words[i * n:(i + 1) * n].tobytes()).digest()
        keys.append(prev)
    return keys


def block_name(key: bytes) -> str:
    return BLOCK_PREFIX + key.hex()


# ---- the codec ----

def _bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round to nearest even, as torch does; NaN stays NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        rounded[nan] = 0x7FC0
    return rounded


def _to_f32(raw: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bf16":
        return _bf16_to_f32(raw.view(np.uint16))
    if dtype == "fp16":
        return raw.view(np.float16).astype(np.float32)
    return raw.view(np.float32)


def _from_f32(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bf16":
        return _f32_to_bf16(x)
    if dtype == "fp16":
        return x.astype(np.float16).view(np.uint16)
    return x.astype(np.float32)


def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """[slabs, n] codes -> [slabs, ceil(n*bits/32)] little-endian words."""
    per = 32 // bits
    slabs, n = codes.shape
    words = -(-n // per)
    padded = np.zeros((slabs, words * per), dtype=np.uint32)
    padded[:, :n] = codes
    padded = padded.reshape(slabs, words, per)
    out = np.zeros((slabs, words), dtype=np.uint32)
    for j in range(per):
        out |= padded[:, :, j] << np.uint32(j * bits)
    return out


def _unpack(words: np.ndarray, bits: int, n: int) -> np.ndarray:
    per = 32 // bits
    mask = np.uint32((1 << bits) - 1)
    parts = [(words >> np.uint32(j * bits)) & mask for j in range(per)]
    return np.stack(parts, axis=-1).reshape(words.shape[0], -1)[:, :n]


def _quantize(x: np.ndarray, bits: int, group: int, axis: int):
    """x: [slabs, T, D] float32. Groups run along `axis` (1: tokens, K; 2:
    channels, V). Returns codes [slabs, T, D], scales and zeros (fp16) of
    shape [slabs, ceil(T/G), D] (axis 1) or [slabs, T, ceil(D/G)] (axis 2)."""
    if not np.isfinite(x).all() or np.abs(x).max(initial=0.0) > 65504.0:
        raise ValueError("KIVI needs finite K/V within fp16 range")
    length = x.shape[axis]
    groups = -(-length // group)
    pad = groups * group - length
    if axis == 1:
        edge = np.concatenate([x, np.repeat(x[:, -1:, :], pad, axis=1)], axis=1) if pad else x
        g = edge.reshape(x.shape[0], groups, group, x.shape[2])
        lo, hi = g.min(axis=2), g.max(axis=2)
    else:
        edge = np.concatenate([x, np.repeat(x[:, :, -1:], pad, axis=2)], axis=2) if pad else x
        g = edge.reshape(x.shape[0], x.shape[1], groups, group)
        lo, hi = g.min(axis=3), g.max(axis=3)
    levels = (1 << bits) - 1
    scale = ((hi - lo) / levels).astype(np.float16)
    zero = lo.astype(np.float16)
    s_full = _per_element(scale, group, axis, length)
    z_full = _per_element(zero, group, axis, length)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(s_full > 0, np.rint((x - z_full) / s_full), 0.0)
    codes = np.clip(q, 0, levels).astype(np.uint32)
    return codes, scale, zero


def _dequantize(codes: np.ndarray, scale: np.ndarray, zero: np.ndarray, group: int,
                axis: int) -> np.ndarray:
    length = codes.shape[axis]
    return (codes.astype(np.float32) * _per_element(scale, group, axis, length)
            + _per_element(zero, group, axis, length))


def _per_element(per_group: np.ndarray, group: int, axis: int, length: int) -> np.ndarray:
    """A group's fp16 value (scale or zero), as float32, at each element of
    its group along `axis` (which has `length` elements)."""
    full = np.repeat(per_group.astype(np.float32), group, axis=axis)
    return full[:, :length, :] if axis == 1 else full[:, :, :length]


def _tensor(raw: np.ndarray, layout: BlockLayout, role: int) -> tensor_pb2.EncodedTensor:
    """raw: [L, H, T, D] in the layout's dtype (uint16 bits for bf16/fp16)."""
    kind, bits, group = parse_codec(layout.codec)
    t = tensor_pb2.EncodedTensor(format_version=1, role=role, dtype=_DTYPES[layout.dtype],
                                 shape=list(raw.shape), layer_begin=0)
    if kind == "raw":
        t.codec = tensor_pb2.CODEC_RAW
        t.buffers.add(kind=tensor_pb2.BUFFER_RAW, data=np.ascontiguousarray(raw).tobytes())
    else:
        t.codec = tensor_pb2.CODEC_KIVI
        t.params.bits, t.params.group_size = bits, group
        L, H, T, D = raw.shape
        x = _to_f32(np.ascontiguousarray(raw), layout.dtype).reshape(L * H, T, D)
        axis = 1 if role == tensor_pb2.TENSOR_ROLE_KEY else 2
        codes, scale, zero = _quantize(x, bits, group, axis)
        t.buffers.add(kind=tensor_pb2.BUFFER_CODES,
                      data=_pack(codes.reshape(L * H, T * D), bits).astype("<u4").tobytes())
        t.buffers.add(kind=tensor_pb2.BUFFER_SCALES, data=scale.astype("<f2").tobytes())
        t.buffers.add(kind=tensor_pb2.BUFFER_ZEROS, data=zero.astype("<f2").tobytes())
    t.crc32c = _crc(b.data for b in t.buffers)
    return t


def _crc(parts: Iterable[bytes]) -> int:
    c = 0
    for p in parts:
        c = _crc32c.crc32c(p, c)
    return c


def encode_block(k: np.ndarray, v: np.ndarray, layout: BlockLayout) -> bytes:
    """A serialized SegmentPayload of one block. k, v: [layers, kv_heads,
    block_tokens, head_dim] in the layout's dtype (bf16 and fp16 as their
    uint16 bits, fp32 as float32)."""
    want = (layout.num_layers, layout.num_kv_heads, layout.block_tokens, layout.head_dim)
    for name, a in (("k", k), ("v", v)):
        if tuple(a.shape) != want:
            raise ValueError(f"{name} has shape {tuple(a.shape)}, the layout says {want}")
    payload = tensor_pb2.SegmentPayload()
    payload.tensors.append(_tensor(k, layout, tensor_pb2.TENSOR_ROLE_KEY))
    payload.tensors.append(_tensor(v, layout, tensor_pb2.TENSOR_ROLE_VALUE))
    return payload.SerializeToString()


class BlockError(ValueError):
    """A stored block that cannot be served: wrong layout, bad checksum."""


def decode_block(payload: bytes, layout: BlockLayout) -> Tuple[np.ndarray, np.ndarray]:
    """(k, v) in the layout's dtype, as encode_block takes them. BlockError
    when the bytes fail their checksum or do not match the layout."""
    msg = tensor_pb2.SegmentPayload()
    try:
        msg.ParseFromString(payload)
    except Exception as e:  # protobuf's DecodeError
        raise BlockError(f"block payload does not parse: {e}") from None
    if len(msg.tensors) != 2:
        raise BlockError(f"a block holds 2 tensors, this one {len(msg.tensors)}")
    want = [layout.num_layers, layout.num_kv_heads, layout.block_tokens, layout.head_dim]
    kind, bits, group = parse_codec(layout.codec)
    out = []
    for t, role in zip(msg.tensors, (tensor_pb2.TENSOR_ROLE_KEY, tensor_pb2.TENSOR_ROLE_VALUE)):
        if list(t.shape) != want or t.role != role or t.dtype != _DTYPES[layout.dtype]:
            raise BlockError(f"block tensor {list(t.shape)} role {t.role} dtype {t.dtype} "
                             f"does not match the layout {layout.describe()}")
        if _crc(b.data for b in t.buffers) != t.crc32c:
            raise BlockError("block tensor failed its CRC-32C")
        L, H, T, D = want
        if kind == "raw":
            if t.codec != tensor_pb2.CODEC_RAW or len(t.buffers) != 1:
                raise BlockError("expected a raw tensor")
            np_dtype = np.float32 if layout.dtype == "fp32" else np.uint16
            raw = np.frombuffer(t.buffers[0].data, dtype=np_dtype)
            if raw.size != L * H * T * D:
                raise BlockError("raw buffer has the wrong size")
            out.append(raw.reshape(want))
            continue
        if (t.codec != tensor_pb2.CODEC_KIVI or t.params.bits != bits
                or t.params.group_size != group or len(t.buffers) != 3):
            raise BlockError("expected a KIVI tensor of the layout's bits and group")
        axis = 1 if role == tensor_pb2.TENSOR_ROLE_KEY else 2
        groups = -(-(T if axis == 1 else D) // group)
        sshape = (L * H, groups, D) if axis == 1 else (L * H, T, groups)
        words = -(-(T * D * bits) // 32)
        codes_b, scales_b, zeros_b = (b.data for b in t.buffers)
        if (len(codes_b) != L * H * words * 4 or len(scales_b) != 2 * np.prod(sshape)
                or len(zeros_b) != len(scales_b)):
            raise BlockError("KIVI buffers have the wrong sizes")
        codes = _unpack(np.frombuffer(codes_b, dtype="<u4").reshape(L * H, words), bits, T * D)
        scale = np.frombuffer(scales_b, dtype="<f2").reshape(sshape)
        zero = np.frombuffer(zeros_b, dtype="<f2").reshape(sshape)
        x = _dequantize(codes.reshape(L * H, T, D), scale, zero, group, axis)
        out.append(_from_f32(x, layout.dtype).reshape(want))
    return out[0], out[1]


# ---- the store ----

class BlockStore:
    """Blocks in kvtier-store, as the caller's tenant (its bearer token).

    lookup: how many leading blocks of a chain are stored (one call).
    put: many blocks in one PutSegments stream; a block already stored
      (ALREADY_EXISTS, another request saved it first) counts as stored.
    get: payloads of many blocks in one call; a missing block is None, never
      an exception, so the caller recomputes it.
    """

    def __init__(self, address: str, token: Optional[str] = None, timeout: float = 30.0,
                 ttl_seconds: Optional[int] = None, tls_root_cert: Optional[bytes] = None):
        self.settings = CallSettings(token, timeout, 1)
        self._channel = channel(address, tls_root_cert)
        self._stub = store_pb2_grpc.StoreStub(self._channel)
        self._ttl = ttl_seconds

    def tenant(self) -> str:
        """The tenant the store knows this client as (its token's)."""
        return self.settings.unary("Stats", self._stub.Stats, store_pb2.StatsRequest()).tenant

    def lookup(self, names: Sequence[str]) -> int:
        found = 0
        for start in range(0, len(names), 4096):
            part = list(names[start:start + 4096])
            r = self.settings.unary("LookupChain", self._stub.LookupChain,
                                    store_pb2.LookupChainRequest(session_ids=part))
            found += r.found
            if r.found < len(part):
                break
        return found

    def put(self, blocks: Sequence[Tuple[str, bytes]], num_layers: int) -> Dict[str, int]:
        """Stores (name, payload) pairs; returns {name: grpc code value} for
        each block not stored (ALREADY_EXISTS is success)."""
        if not blocks:
            return {}

        def messages() -> Iterator[store_pb2.PutSegmentRequest]:
            for name, payload in blocks:
                h = store_pb2.PutSegmentHeader(session_id=name, layer_begin=0,
                                               layer_end=num_layers,
                                               payload_bytes=len(payload),
                                               payload_crc32c=_crc32c.crc32c(payload))
                h.ref.round, h.ref.segment = 0, 0
                if self._ttl is not None:
                    h.session_ttl_seconds = self._ttl
                yield store_pb2.PutSegmentRequest(header=h)
                for off in range(0, len(payload), CHUNK_BYTES):
                    yield store_pb2.PutSegmentRequest(chunk=payload[off:off + CHUNK_BYTES])

        try:
            resp = self._stub.PutSegments(messages(), timeout=self.settings.timeout,
                                          metadata=self.settings.metadata())
        except grpc.RpcError as e:
            raise _error("PutSegments", e) from None
        failed = {}
        for (name, _), r in zip(blocks, resp.results):
            if r.code not in (grpc.StatusCode.OK.value[0], grpc.StatusCode.ALREADY_EXISTS.value[0]):
                failed[name] = r.code
        return failed

    def get(self, names: Sequence[str]) -> List[Optional[bytes]]:
        """The blocks' payloads in order, None for each one not stored: one
        GetSegments call per 4096 blocks (GetSegmentsRequest.ref_sessions)."""
        out: List[Optional[bytes]] = []
        for start in range(0, len(names), 4096):
            out += self._get_batch(names[start:start + 4096])
        return out

    def _get_batch(self, names: Sequence[str]) -> List[Optional[bytes]]:
        req = store_pb2.GetSegmentsRequest(accept_batches=True, missing_ok=True,
                                           ref_sessions=list(names))
        for _ in names:
            req.refs.add(round=0, segment=0)
        try:
            out = [payload for _, payload in read_segments(self._stub.GetSegments(
                req, timeout=self.settings.timeout, metadata=self.settings.metadata()))]
        except grpc.RpcError as e:
            raise _error("GetSegments", e) from None
        if len(out) != len(names):
            raise KvtierError("GetSegments", grpc.StatusCode.INTERNAL,
                              f"{len(out)} segments for {len(names)} refs")
        return out

    def delete(self, names: Sequence[str]) -> int:
        """Deletes blocks of the caller's tenant; returns how many existed."""
        n = 0
        for name in names:
            try:
                self.settings.unary("DeleteSession", self._stub.DeleteSession,
                                    store_pb2.DeleteSessionRequest(session_id=name))
                n += 1
            except Exception as e:  # KvtierError NOT_FOUND: not stored
                if getattr(e, "code", None) != grpc.StatusCode.NOT_FOUND:
                    raise
        return n

    def close(self) -> None:
        self._channel.close()
