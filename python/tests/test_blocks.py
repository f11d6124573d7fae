"""kvtier.blocks: chain keys, the block codec against a float64 reference,
and blocks in a real kvtier-store with two tenants."""

import dataclasses
import os
import shutil
import tempfile

import numpy as np
import pytest

from conftest import BUILD, Server
from kvtier.blocks import (BlockError, BlockLayout, BlockStore, ChainRoot, block_name,
                           chain_keys, decode_block, encode_block, parse_codec)

LAYOUT = BlockLayout(num_layers=3, num_kv_heads=2, head_dim=32, block_tokens=16)
ROOT = ChainRoot(namespace="alice", model_digest="ab" * 32, layout=LAYOUT)


def bf16_bits(x):
    u = np.asarray(x, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_value(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def test_chain_keys_extend_with_the_prefix_and_skip_a_partial_block():
    tokens = list(range(100, 150))  # 3 full blocks and 2 tokens
    keys = chain_keys(ROOT, tokens)
    assert len(keys) == 3 and len(set(keys)) == 3
    assert chain_keys(ROOT, tokens[:40]) == keys[:2]
    assert chain_keys(ROOT, tokens, limit=1) == keys[:1]
    changed = tokens[:20] + [7] + tokens[21:]  # a token of block 1
    other = chain_keys(ROOT, changed)
    assert other[0] == keys[0] and other[1] != keys[1] and other[2] != keys[2]
    name = block_name(keys[0])
    assert name.startswith("blk.") and len(name) == 68


@pytest.mark.parametrize("change", [
    dict(namespace="bob"), dict(cache_salt="s1"), dict(model_digest="cd" * 32),
    dict(attention="mass:0.95"), dict(layout=dataclasses.replace(LAYOUT, codec="kivi8")),
    dict(layout=dataclasses.replace(LAYOUT, tp_rank=1, tp_size=2)),
    dict(layout=dataclasses.replace(LAYOUT, dtype="fp16")),
    dict(layout=dataclasses.replace(LAYOUT, block_tokens=8)),
])
def test_every_input_of_the_root_separates_chains(change):
    tokens = list(range(64))
    other = dataclasses.replace(ROOT, **change)
    assert set(chain_keys(other, tokens)).isdisjoint(chain_keys(ROOT, tokens))


def test_layout_and_codec_errors_are_precise():
    with pytest.raises(ValueError, match="kivi3"):
        parse_codec("kivi3")
    with pytest.raises(ValueError, match="group size"):
        parse_codec("kivi4:g=0")
    assert parse_codec("kivi4") == ("kivi", 4, 32)
    assert parse_codec("kivi2:g=16") == ("kivi", 2, 16)
    with pytest.raises(ValueError, match="tp_rank"):
        BlockLayout(1, 1, 8, 16, tp_rank=2, tp_size=2)
    with pytest.raises(ValueError, match="shape"):
        encode_block(np.zeros((1, 2, 3, 4), np.uint16), np.zeros((1, 2, 3, 4), np.uint16), LAYOUT)


def kv(seed):
    rng = np.random.default_rng(seed)
    shape = (LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.block_tokens, LAYOUT.head_dim)
    k = rng.normal(size=shape) * np.linspace(0.5, 4, LAYOUT.head_dim)  # channel outliers
    v = rng.normal(size=shape)
    return bf16_bits(k), bf16_bits(v)


def test_raw_blocks_round_trip_bit_for_bit():
    k, v = kv(1)
    k2, v2 = decode_block(encode_block(k, v, LAYOUT), LAYOUT)
    assert np.array_equal(k, k2) and np.array_equal(v, v2)


def reference_kivi(x, bits, group, axis):
    """float64 KIVI of [slabs, T, D]: groups along `axis`, fp16 scale and zero."""
    out = np.empty_like(x)
    length = x.shape[axis]
    for g0 in range(0, length, group):
        sl = [slice(None)] * 3
        sl[axis] = slice(g0, min(length, g0 + group))
        part = x[tuple(sl)]
        lo = part.min(axis=axis, keepdims=True)
        hi = part.max(axis=axis, keepdims=True)
        scale = ((hi - lo) / (2 ** bits - 1)).astype(np.float16).astype(np.float64)
        zero = lo.astype(np.float16).astype(np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.where(scale > 0, np.rint((part - zero) / scale), 0)
        out[tuple(sl)] = np.clip(q, 0, 2 ** bits - 1) * scale + zero
    return out


@pytest.mark.parametrize("bits,group", [(8, 32), (4, 32), (2, 16), (4, 5)])
def test_kivi_blocks_match_the_float64_reference(bits, group):
    layout = dataclasses.replace(LAYOUT, codec=f"kivi{bits}:g={group}")
    k, v = kv(2)
    payload = encode_block(k, v, layout)
    assert len(payload) < encode_block(k, v, LAYOUT).__len__()
    k2, v2 = decode_block(payload, layout)
    L, H, T, D = k.shape
    for got, x, axis in ((k2, k, 1), (v2, v, 2)):
        exact = bf16_value(x).reshape(L * H, T, D)
        ref = reference_kivi(exact, bits, group, axis)
        got64 = bf16_value(got).reshape(L * H, T, D)
        # The decoder computes in fp32 and rounds to bf16: half a bf16 step.
        err = np.abs(got64 - ref)
        assert np.all(err <= np.abs(ref) * 2.0 ** -8 + 1e-6), err.max()
        # And the codec's own error is what its bits allow: half a step
        # (a step is a group's range over 2^bits - 1), plus that rounding.
        bound = (np.ptp(exact) / (2 ** bits - 1)) * 0.5 + np.abs(exact).max() * 2.0 ** -7
        assert np.abs(got64 - exact).max() <= bound


def test_kivi_codes_are_packed_as_the_byte_layout_says():
    from kvtier.v1 import tensor_pb2
    layout = BlockLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_tokens=2,
                         codec="kivi4:g=2")
    # K: per channel over both tokens; channel c's tokens are 0 and c + 1.
    k = bf16_bits(np.array([[[[0, 0, 0, 0], [1, 2, 3, 4]]]], dtype=np.float32))
    v = bf16_bits(np.zeros((1, 1, 2, 4), dtype=np.float32))
    msg = tensor_pb2.SegmentPayload()
    msg.ParseFromString(encode_block(k, v, layout))
    codes = np.frombuffer(msg.tensors[0].buffers[0].data, dtype="<u4")
    # Element i of [T, D] at bits [4 (i % 8), ...): token 0 all 0, token 1 all 15.
    assert codes.tolist() == [0xFFFF0000]


def test_corrupt_or_foreign_blocks_are_refused():
    k, v = kv(3)
    payload = bytearray(encode_block(k, v, LAYOUT))
    payload[-40] ^= 1
    with pytest.raises(BlockError):
        decode_block(bytes(payload), LAYOUT)
    with pytest.raises(BlockError, match="layout"):
        decode_block(encode_block(k, v, LAYOUT), dataclasses.replace(LAYOUT, dtype="fp16"))
    with pytest.raises(BlockError, match="KIVI"):
        decode_block(encode_block(k, v, LAYOUT), dataclasses.replace(LAYOUT, codec="kivi8"))


@pytest.fixture(scope="module")
def store():
    work = tempfile.mkdtemp(prefix="kvtier-blocks-")
    with open(os.path.join(work, "tenants"), "w") as f:
        f.write("alice-token-1 alice readwrite\nbob-token-01 bob readwrite\n")
    server = Server(os.path.join(BUILD, "services/store/kvtier-store"),
                    [f"--data_dir={work}/db", "--listen=127.0.0.1:0",
                     "--metrics_listen=127.0.0.1:0", f"--tenants_file={work}/tenants"],
                    work, "store")
    try:
        yield server.address
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


def test_blocks_in_the_store_are_found_by_prefix_and_kept_per_tenant(store):
    alice = BlockStore(store, "alice-token-1")
    bob = BlockStore(store, "bob-token-01")
    try:
        assert alice.tenant() == "alice" and bob.tenant() == "bob"
        tokens = list(range(5000, 5064))  # 4 blocks
        names = [block_name(key) for key in chain_keys(ROOT, tokens)]
        k, v = kv(4)
        payload = encode_block(k, v, LAYOUT)
        assert alice.put([(n, payload) for n in names[:3]], LAYOUT.num_layers) == {}
        # Stored twice (another request saved it first): still stored.
        assert alice.put([(names[0], payload)], LAYOUT.num_layers) == {}
        assert alice.lookup(names) == 3
        got = alice.get(names)
        assert got[:3] == [payload] * 3 and got[3] is None
        # Bob asks for the same names: none are his.
        assert bob.lookup(names) == 0
        assert bob.get(names[:1]) == [None]
        assert bob.put([(names[0], payload)], LAYOUT.num_layers) == {}
        # Bob deleting his copy leaves Alice's.
        assert bob.delete(names[:1]) == 1
        assert alice.lookup(names) == 3
        # A hole ends the chain: the blocks behind it are not reported.
        assert alice.delete(names[1:2]) == 1
        assert alice.lookup(names) == 1
    finally:
        alice.close()
        bob.close()


def test_one_call_fetches_blocks_of_many_sessions_in_order(store):
    import grpc
    from kvtier.v1 import store_pb2
    alice = BlockStore(store, "alice-token-1")
    try:
        big = BlockLayout(num_layers=4, num_kv_heads=2, head_dim=128, block_tokens=1024)
        rng = np.random.default_rng(5)
        shape = (4, 2, 1024, 128)
        large = encode_block(bf16_bits(rng.normal(size=shape)), bf16_bits(rng.normal(size=shape)),
                             big)
        assert len(large) > 3 << 20  # comes as a header and chunks, not in a batch
        k, v = kv(6)
        small = encode_block(k, v, LAYOUT)
        assert alice.put([("blk.many-small", small)], LAYOUT.num_layers) == {}
        assert alice.put([("blk.many-large", large)], big.num_layers) == {}
        got = alice.get(["blk.many-none", "blk.many-large", "blk.many-small", "blk.many-gone"])
        assert got == [None, large, small, None]
        # ref_sessions is one session per ref, and session_id stays empty.
        for req in (store_pb2.GetSegmentsRequest(session_id="blk.many-small",
                                                 ref_sessions=["blk.many-small"]),
                    store_pb2.GetSegmentsRequest(ref_sessions=["blk.many-small"] * 2)):
            req.refs.add(round=0, segment=0)
            with pytest.raises(grpc.RpcError) as e:
                list(alice._stub.GetSegments(req, metadata=alice.settings.metadata()))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # Without missing_ok an unknown session fails the call.
        req = store_pb2.GetSegmentsRequest(ref_sessions=["blk.many-small", "blk.many-none"])
        req.refs.add(round=0, segment=0)
        req.refs.add(round=0, segment=0)
        with pytest.raises(grpc.RpcError) as e:
            list(alice._stub.GetSegments(req, metadata=alice.settings.metadata()))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        alice.close()
