"""kvtier as a vLLM KV connector: prompts' K/V kept in kvtier-store as
content-addressed blocks (kvtier.blocks), found again by any later request
that starts with the same tokens, on this vLLM instance or another.

    from vllm import LLM
    from vllm.config import KVTransferConfig
    llm = LLM(model=..., kv_transfer_config=KVTransferConfig(
        kv_connector="KvtierConnector", kv_connector_module_path="kvtier.vllm",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"store": "127.0.0.1:7070", "token_file": "...",
                                   "codec": "raw"}))

Tested with vLLM 0.32.0's CPU build (scripts/requirements-vllm-wheel.txt);
docs/vllm.md says what is shared and what is isolated.

Scheduler side: get_num_new_matched_tokens asks the store how many of the
prompt's full blocks it holds (one LookupChain call) and reports them as
external hits; build_connector_meta names the blocks each request loads and
the full blocks each step completes (prompt and generated tokens).
Worker side: start_load_kv fetches the named blocks, decodes them and writes
them into vLLM's paged buffers before the forward pass reads them;
save_kv_layer copies the completed blocks out of each layer's buffer (so
vLLM may reuse its blocks at once), and wait_for_save hands them to a
background thread that encodes and stores them. A block that cannot be
loaded (store down, missing, failing its checksum) is reported through
get_block_ids_with_load_errors, and vLLM recomputes it
(kv_load_failure_policy="recompute"): wrong K/V is never served.

extra config (kv_connector_extra_config):
  store         kvtier-store's address, host:port (required)
  token, token_file  the deployment's bearer token (its tenant)
  namespace     what chains are keyed under; default the tenant's name
  codec         raw (default) or kiviB[:g=G], B in 2, 4, 8
  model_digest  the model's identity; default the SHA-256 of its
                *.safetensors files
  ttl_seconds   blocks' idle lifetime in the store (default: the store's)
  stats_file    where each side writes its counters as JSON (PATH.scheduler
                .json, PATH.worker.json) after every change
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import logging
import os
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Set, Tuple

import numpy as np
import torch

from kvtier.blocks import (BlockError, BlockLayout, BlockStore, ChainRoot, block_name,
                           chain_keys, decode_block, encode_block)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                               KVConnectorMetadata,
                                                               KVConnectorRole)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

__all__ = ["KvtierConnector", "model_digest"]

TESTED_VLLM = "0.32.0"
log = logging.getLogger("kvtier.vllm")

_TORCH_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")


def model_digest(model_dir: str) -> str:
    """SHA-256 over the model's *.safetensors files, in name order: the
    weights, not the config (a base and an instruction-tuned model share a
    config)."""
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors in {model_dir!r}: set kv_connector_extra_config"
                         f"['model_digest'] to name the model's weights")
    h = hashlib.sha256()
    for path in files:
        h.update(os.path.basename(path).encode() + b"\0")
        with open(path, "rb") as f:
            while chunk := f.read(8 << 20):
                h.update(chunk)
    return h.hexdigest()


@dataclasses.dataclass
class _Transfer:
    """Blocks of one request to move this step: store names and the vLLM
    block ids they occupy, in order."""
    req_id: str
    names: List[str]
    block_ids: List[int]


@dataclasses.dataclass
class KvtierMetadata(KVConnectorMetadata):
    loads: List[_Transfer] = dataclasses.field(default_factory=list)
    saves: List[_Transfer] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Tracked:
    """Scheduler-side state of a running request."""
    request: "Request"
    block_ids: List[int] = dataclasses.field(default_factory=list)
    saved_blocks: int = 0  # Blocks [0, saved_blocks) are stored or scheduled to be.


class _Stats:
    """Counters of one side, written to stats_file as JSON on change."""

    def __init__(self, path: Optional[str]):
        self._path = path
        self._lock = threading.Lock()
        self.values: Dict[str, float] = {}

    def add(self, **deltas: float) -> None:
        with self._lock:
            for k, v in deltas.items():
                self.values[k] = self.values.get(k, 0) + v
            if self._path:
                tmp = self._path + ".tmp"
                with open(tmp, "w") as f:
                    json.dump(self.values, f, indent=1, sort_keys=True)
                os.replace(tmp, self._path)


class KvtierConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = self._kv_transfer_config
        address = cfg.get_from_extra_config("store", None)
        if not address:
            raise ValueError("KvtierConnector needs kv_connector_extra_config['store'] "
                             "(kvtier-store's host:port)")
        token = cfg.get_from_extra_config("token", None)
        token_file = cfg.get_from_extra_config("token_file", None)
        if token_file:
            with open(token_file) as f:
                token = f.read().strip()
        ttl = cfg.get_from_extra_config("ttl_seconds", None)
        self._store = BlockStore(address, token, ttl_seconds=None if ttl is None else int(ttl))

        model = vllm_config.model_config
        text = model.hf_text_config
        cache_dtype = vllm_config.cache_config.cache_dtype
        dtype = model.dtype if cache_dtype in ("auto", None) else cache_dtype
        if dtype not in _TORCH_DTYPES:
            raise ValueError(f"KvtierConnector stores bf16, fp16 or fp32 K/V, not {dtype}")
        tp = vllm_config.parallel_config.tensor_parallel_size
        tp_rank = 0
        if role == KVConnectorRole.WORKER and tp > 1:
            from vllm.distributed import get_tensor_model_parallel_rank
            tp_rank = get_tensor_model_parallel_rank()
        kv_heads = model.get_num_kv_heads(vllm_config.parallel_config)
        self._layout = BlockLayout(
            num_layers=text.num_hidden_layers, num_kv_heads=kv_heads,
            head_dim=model.get_head_size(), block_tokens=vllm_config.cache_config.block_size,
            dtype=_TORCH_DTYPES[dtype], codec=cfg.get_from_extra_config("codec", "raw"),
            tp_rank=tp_rank, tp_size=tp)
        namespace = cfg.get_from_extra_config("namespace", None)
        if namespace is None:
            namespace = self._store.tenant()
        digest = cfg.get_from_extra_config("model_digest", None) or model_digest(model.model)
        self._root = ChainRoot(namespace=namespace, model_digest=digest, layout=self._layout)
        stats_file = cfg.get_from_extra_config("stats_file", None)
        side = "scheduler" if role == KVConnectorRole.SCHEDULER else "worker"
        self._stats = _Stats(f"{stats_file}.{side}.json" if stats_file else None)
        log.info("kvtier connector (%s): store %s, namespace %r, %s", side, address, namespace,
                 self._layout.describe())

        # Scheduler side.
        self._requests: Dict[str, "Request"] = {}
        self._tracked: Dict[str, _Tracked] = {}
        self._matched: Dict[str, Tuple[int, int]] = {}  # req -> (local tokens, kvtier blocks)
        self._pending_loads: Dict[str, Tuple[int, int]] = {}  # req -> (first block, count)
        # Worker side.
        self._caches: List[torch.Tensor] = []
        self._layer_of: Dict[str, int] = {}
        self._staged: Dict[int, List[torch.Tensor]] = {}  # layer -> one gather per save
        self._load_errors: Set[int] = set()
        self._saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-save")
        self._saving: List[Future] = []

    # ---- scheduler side ----

    def _root_for(self, request: "Request") -> ChainRoot:
        salt = getattr(request, "cache_salt", None) or ""
        return dataclasses.replace(self._root, cache_salt=salt)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int
                                   ) -> Tuple[Optional[int], bool]:
        self._requests[request.request_id] = request
        prompt = list(request.prompt_token_ids or [])
        n = self._layout.block_tokens
        # vLLM computes at least the prompt's last token itself.
        limit = (len(prompt) - 1) // n
        first = num_computed_tokens // n
        if limit <= first:
            self._matched[request.request_id] = (num_computed_tokens, first)
            return 0, False
        names = [block_name(k) for k in chain_keys(self._root_for(request), prompt, limit)]
        start = time.perf_counter()
        try:
            found = self._store.lookup(names)
        except Exception as e:  # The store is down: recompute, never fail the request.
            log.warning("kvtier lookup failed (%s); the prompt is computed", e)
            self._stats.add(lookup_failures=1)
            found = 0
        self._stats.add(lookups=1, lookup_seconds=time.perf_counter() - start,
                        prompt_tokens=len(prompt))
        self._matched[request.request_id] = (num_computed_tokens, max(found, first))
        hit = max(0, found * n - num_computed_tokens)
        return hit, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int):
        local = self._matched.get(request.request_id, (0, 0))[0]
        n = self._layout.block_tokens
        if num_external_tokens > 0:
            first = local // n
            self._pending_loads[request.request_id] = (first, num_external_tokens // n)
            self._stats.add(hit_tokens=num_external_tokens)

    def _track(self, req_id: str, request: "Request", block_ids: List[int]) -> _Tracked:
        t = self._tracked.get(req_id)
        if t is None:
            t = self._tracked[req_id] = _Tracked(request)
            t.saved_blocks = self._matched.get(req_id, (0, 0))[1]
        t.block_ids = list(block_ids)
        return t

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = KvtierMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            request = self._request_of(new.req_id)
            if request is None:
                continue
            t = self._track(new.req_id, request, new.block_ids[0])
            self._plan_load(meta, new.req_id, t)
            done = new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id]
            self._plan_save(meta, new.req_id, t, done)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            t = self._tracked.get(req_id)
            if t is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                t.block_ids = list(new_ids[0]) if new_ids is not None else []
                self._plan_load(meta, req_id, t)
            elif new_ids is not None:
                t.block_ids.extend(new_ids[0])
            done = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens[req_id]
            self._plan_save(meta, req_id, t, done)
        return meta

    def _request_of(self, req_id: str) -> Optional["Request"]:
        # The scheduler passes the Request to get_num_new_matched_tokens,
        # which remembers it.
        return self._requests.get(req_id)

    def _plan_load(self, meta: KvtierMetadata, req_id: str, t: _Tracked) -> None:
        plan = self._pending_loads.pop(req_id, None)
        if plan is None:
            return
        first, count = plan
        prompt = list(t.request.prompt_token_ids or [])
        keys = chain_keys(self._root_for(t.request), prompt, first + count)[first:]
        meta.loads.append(_Transfer(req_id, [block_name(k) for k in keys],
                                    t.block_ids[first:first + count]))

    def _plan_save(self, meta: KvtierMetadata, req_id: str, t: _Tracked, done_tokens: int
                   ) -> None:
        n = self._layout.block_tokens
        tokens = list(t.request.all_token_ids)
        full = min(done_tokens, len(tokens)) // n
        full = min(full, len(t.block_ids))
        if full <= t.saved_blocks:
            return
        keys = chain_keys(self._root_for(t.request), tokens, full)
        meta.saves.append(_Transfer(req_id, [block_name(k) for k in keys[t.saved_blocks:]],
                                    t.block_ids[t.saved_blocks:full]))
        t.saved_blocks = full

    def request_finished(self, request: "Request", block_ids: List[int]
                         ) -> Tuple[bool, Optional[Dict[str, Any]]]:
        # Saves copy the blocks out during the step that computed them, so
        # vLLM may free them at once.
        for d in (self._tracked, self._matched, self._pending_loads, self._requests):
            d.pop(request.request_id, None)
        return False, None

    # ---- worker side ----

    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]):
        L, H, n, D = (self._layout.num_layers, self._layout.num_kv_heads,
                      self._layout.block_tokens, self._layout.head_dim)
        by_index: Dict[int, Tuple[str, torch.Tensor]] = {}
        for name, t in kv_caches.items():
            m = _LAYER_INDEX.search(name)
            if m is None:
                raise ValueError(f"KvtierConnector: no layer index in the KV cache name {name!r}")
            # vLLM's CPU layout: [blocks, kv_heads, block_size, 2 * head_dim],
            # each block's head holding its K rows, then its V rows.
            if t.dim() != 4 or tuple(t.shape[1:]) != (H, n, 2 * D):
                raise ValueError(f"KvtierConnector supports vLLM's CPU KV layout [blocks, {H}, "
                                 f"{n}, {2 * D}]; {name} is {tuple(t.shape)}")
            by_index[int(m.group(1))] = (name, t)
        if sorted(by_index) != list(range(L)):
            raise ValueError(f"KvtierConnector: KV caches for layers {sorted(by_index)}, "
                             f"expected 0..{L - 1}")
        self._caches = [by_index[i][1].view(-1, H, 2, n, D) for i in range(L)]
        self._layer_of = {by_index[i][0]: i for i in range(L)}

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvtierMetadata)
        for load in meta.loads:
            self._load(load)

    def _load(self, load: _Transfer) -> None:
        start = time.perf_counter()
        try:
            payloads = self._store.get(load.names)
        except Exception as e:
            log.warning("kvtier fetch of %d blocks failed (%s); they are recomputed",
                        len(load.names), e)
            self._stats.add(load_failures_store=1)
            self._load_errors.update(load.block_ids)
            return
        loaded = 0
        nbytes = 0
        for i, (payload, block_id) in enumerate(zip(payloads, load.block_ids)):
            if payload is None:
                self._stats.add(load_failures_missing=1)
                self._load_errors.update(load.block_ids[i:])
                break
            try:
                k, v = decode_block(payload, self._layout)
            except BlockError as e:
                log.warning("kvtier block %s: %s; it is recomputed", load.names[i], e)
                self._stats.add(load_failures_corrupt=1)
                self._load_errors.update(load.block_ids[i:])
                break
            kt, vt = self._as_torch(k), self._as_torch(v)
            for layer, cache in enumerate(self._caches):
                cache[block_id, :, 0].copy_(kt[layer])
                cache[block_id, :, 1].copy_(vt[layer])
            loaded += 1
            nbytes += len(payload)
        self._stats.add(loaded_blocks=loaded, loaded_bytes=nbytes,
                        load_seconds=time.perf_counter() - start)

    def _as_torch(self, a: np.ndarray) -> torch.Tensor:
        # Raw blocks decode to views of the received bytes, which are read-only.
        a = np.require(a, requirements=["C", "W"])
        if self._layout.dtype == "fp32":
            return torch.from_numpy(a)
        dtype = torch.bfloat16 if self._layout.dtype == "bf16" else torch.float16
        return torch.from_numpy(a.view(np.int16)).view(dtype)

    def _as_numpy(self, t: torch.Tensor) -> np.ndarray:
        if t.dtype == torch.float32:
            return t.contiguous().numpy()
        return t.contiguous().view(torch.int16).numpy().view(np.uint16)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv loads every layer before the forward pass.

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvtierMetadata)
        if not meta.saves:
            return
        layer = self._layer_of[layer_name]
        cache = self._caches[layer]
        # Copied now: vLLM may hand these blocks to another request once the
        # step ends.
        self._staged[layer] = [cache[torch.tensor(s.block_ids)].clone() for s in meta.saves]

    def wait_for_save(self):
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvtierMetadata)
        if not meta.saves:
            return
        if len(self._staged) != self._layout.num_layers:
            log.warning("kvtier: %d of %d layers staged for saving; skipped",
                        len(self._staged), self._layout.num_layers)
            self._staged.clear()
            return
        staged = [self._staged[layer] for layer in range(self._layout.num_layers)]
        self._staged = {}
        names = [s.names for s in meta.saves]
        self._saving = [f for f in self._saving if not f.done()]
        self._saving.append(self._saver.submit(self._save, names, staged))

    def _save(self, names: List[List[str]], staged: List[List[torch.Tensor]]) -> None:
        start = time.perf_counter()
        blocks = []
        try:
            for j, request_names in enumerate(names):
                # [layers, blocks, heads, 2, tokens, head_dim]
                x = torch.stack([staged[layer][j] for layer in range(len(staged))])
                for b, name in enumerate(request_names):
                    k = self._as_numpy(x[:, b, :, 0])
                    v = self._as_numpy(x[:, b, :, 1])
                    blocks.append((name, encode_block(k, v, self._layout)))
            failed = self._store.put(blocks, self._layout.num_layers)
        except Exception as e:
            log.warning("kvtier save of %d blocks failed: %s", len(blocks), e)
            self._stats.add(save_failures=len(blocks) or 1)
            return
        self._stats.add(saved_blocks=len(blocks) - len(failed), save_failures=len(failed),
                        saved_bytes=sum(len(p) for n, p in blocks if n not in failed),
                        save_seconds=time.perf_counter() - start)

    def get_block_ids_with_load_errors(self) -> Set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self):
        for f in self._saving:
            f.result()
        self._saver.shutdown(wait=True)
        self._store.close()
