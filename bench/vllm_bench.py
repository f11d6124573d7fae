"""kvtier's vLLM connector measured on Gemma 3 270M (vLLM's CPU build), each
figure beside its baseline from the same run (docs/vllm.md):

  ttft     time to first token of turns 2..8 of one long chat: vLLM
           recomputing the prefix (no cache), vLLM's own prefix cache holding
           it, and kvtier (raw, KIVI-8, KIVI-4 blocks; vLLM's cache off, so
           the prefix comes from kvtier-store)
  bytes    store bytes for the chat per codec
  shared   store bytes for 100 chats that share one system prompt, against
           100 times one chat stored alone
  load     blocks a second into vLLM's paged-buffer layout (fetch, decode,
           copy) against a plain copy of the same bytes

    make bench-vllm
    # or: scripts/vllm_python.sh bench/vllm_bench.py \
    #       --store_binary build/services/store/kvtier-store --model $(scripts/kvtier.sh vllm-model)
"""

import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import vllm_check as harness  # noqa: E402  (the test's store launcher and vLLM helpers)

TURNS = 8
ANSWER = 48
USER = ("Tell me more about the garden's rules for the shared tools, the compost and the "
        "greenhouse shelves, and what a new member should know in the first month. ") * 3
CODECS = ["raw", "kivi8", "kivi4"]
PAUSE = 1.0  # seconds before each timed request
SHARED_CHATS = 100


def phase_ttft(plan, mode):
    """mode: recompute, prefix-cache, or a codec. Returns each turn's TTFT (s)
    and answers. Histories hold the recompute run's answers when it has run."""
    stats = os.path.join(plan["work"], f"stats-ttft-{mode}")
    if mode == "recompute":
        from vllm import LLM
        llm = LLM(model=plan["model"], dtype="bfloat16", max_model_len=2048, enforce_eager=True,
                  kv_cache_memory_bytes=256 << 20, seed=0, enable_prefix_caching=False)
    elif mode == "prefix-cache":
        llm = harness.make_llm(plan["model"], None)
    else:
        llm = harness.make_llm(plan["model"], harness.connector_config(plan, mode, stats))
    history = plan.get("answers")
    ttft, answers, lengths = [], [], []
    prompt = list(plan["system"]) + plan["user"]
    for t in range(TURNS):
        if t:
            prompt = prompt + (history or answers)[t - 1] + plan["user"]
        # One request for the first token, which finds the prefix where the
        # mode keeps it (nowhere, vLLM's cache, kvtier); a repeat would find
        # its own tail cached too. Every mode pauses first, as kvtier's waits
        # for its saves: the engine's threads spin a while after a request.
        time.sleep(PAUSE)
        start = time.perf_counter()
        harness.generate(llm, [prompt], 1)
        ttft.append(time.perf_counter() - start)
        out = harness.generate(llm, [prompt], ANSWER)[0]["tokens"]
        answers.append(out)
        if mode not in ("recompute", "prefix-cache"):
            harness.wait_stored(dict(plan, codec=mode), [prompt + out[:-1]])
        lengths.append(len(prompt))
    return {"ttft": ttft, "answers": answers, "prompt_tokens": lengths,
            "stats": harness.read_stats(stats)}


def phase_shared(plan):
    """SHARED_CHATS first turns that share the system prompt, raw blocks."""
    stats = os.path.join(plan["work"], "stats-shared")
    llm = harness.make_llm(plan["model"], harness.connector_config(plan, "raw", stats))
    prompts = [plan["system"] + plan["questions"][i] for i in range(SHARED_CHATS)]
    harness.generate(llm, prompts[:1], 1)
    harness.wait_stored(dict(plan, codec="raw"), [prompts[0]])
    harness.generate(llm, prompts[1:], 1)
    harness.wait_stored(dict(plan, codec="raw"), prompts)
    return {"stats": harness.read_stats(stats)}


def run_phase(argv):
    with open(argv.plan) as f:
        plan = json.load(f)
    if argv.phase == "shared":
        out = phase_shared(plan)
    else:
        out = phase_ttft(plan, argv.phase[len("ttft-"):])
    with open(argv.out, "w") as f:
        json.dump(out, f)
    os._exit(0)


def spawn(phase, plan, work, env):
    path = os.path.join(work, "plan.json")
    with open(path, "w") as f:
        json.dump(plan, f)
    return harness.spawn_phase(phase, path, work, env, script=__file__, timeout=1800)


def tenant_bytes(address, token):
    from kvtier.blocks import BlockStore
    from kvtier.v1 import store_pb2
    s = BlockStore(address, token)
    try:
        return s.settings.unary("Stats", s._stub.Stats, store_pb2.StatsRequest()).tenant_bytes
    finally:
        s.close()


def load_throughput(plan, address, token):
    """Blocks a second through fetch + decode + copy, decode + copy, and a
    plain copy of the same bytes into a cache shaped like vLLM's CPU one."""
    import numpy as np
    import torch
    from kvtier.blocks import BlockStore, block_name, chain_keys, decode_block
    rows = []
    store = BlockStore(address, token)
    try:
        for codec in CODECS:
            root = harness.root_of(plan, codec)
            names = [block_name(k) for k in chain_keys(root, plan["longest"])]
            names = names[:store.lookup(names)]
            L, H, n, D = 18, 1, harness.BLOCK, 256
            cache = [torch.zeros(len(names), H, 2, n, D, dtype=torch.bfloat16) for _ in range(L)]
            reps = 5
            t_fetch, t_decode, payloads = [], [], None
            for _ in range(reps):
                start = time.perf_counter()
                payloads = store.get(names)
                t_fetch.append(time.perf_counter() - start)
                start = time.perf_counter()
                for b, p in enumerate(payloads):
                    k, v = decode_block(p, root.layout)
                    kt = torch.from_numpy(np.require(k, requirements="W").view(np.int16))
                    vt = torch.from_numpy(np.require(v, requirements="W").view(np.int16))
                    kt, vt = kt.view(torch.bfloat16), vt.view(torch.bfloat16)
                    for layer in range(L):
                        cache[layer][b, :, 0].copy_(kt[layer])
                        cache[layer][b, :, 1].copy_(vt[layer])
                t_decode.append(time.perf_counter() - start)
            src = [torch.randn(len(names), H, 2, n, D).to(torch.bfloat16) for _ in range(L)]
            t_copy = []
            for _ in range(reps):
                start = time.perf_counter()
                for layer in range(L):
                    cache[layer].copy_(src[layer])
                t_copy.append(time.perf_counter() - start)
            f, d, c = (statistics.median(x) for x in (t_fetch, t_decode, t_copy))
            nb = len(names)
            rows.append((codec, nb, sum(len(p) for p in payloads) / nb, nb / (f + d), nb / d,
                         nb / c))
    finally:
        store.close()
    return rows


def main():
    argv = harness.arguments(__doc__)
    if argv.phase:
        return run_phase(argv)

    import torch
    print(f"vllm_bench: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"torch {torch.__version__}, ISA {torch.backends.cpu.get_cpu_capability()}",
          flush=True)
    work = tempfile.mkdtemp(prefix="kvtier-vllm-bench-")
    store = harness.Store(argv.store_binary, work)
    try:
        plan, ids = harness.base_plan(argv.model, store, work)
        plan["user"] = ids(harness.turn_text(USER))
        plan["questions"] = [ids(harness.turn_text(f"Question {i}: what should bed {i} grow?"))
                             for i in range(SHARED_CHATS)]
        env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING", TOKENIZERS_PARALLELISM="false")
        results = {}
        for mode in ["recompute", "prefix-cache"] + CODECS:
            before = tenant_bytes(store.address, plan["token"])
            results[mode] = spawn(f"ttft-{mode}", plan, work, env)
            results[mode]["bytes"] = tenant_bytes(store.address, plan["token"]) - before
            if mode == "recompute":
                plan["answers"] = results[mode]["answers"]
        plan["longest"] = list(plan["system"])
        for t in range(TURNS):
            plan["longest"] += plan["user"] + plan["answers"][t]

        print(f"\nTTFT of turn N (s; one chat, {ANSWER}-token answers)")
        print("| turn | prompt | recompute | vLLM prefix cache | " +
              " | ".join(f"kvtier {c}" for c in CODECS) + " |")
        print("|---|---|---|---|" + "---|" * len(CODECS))
        prompt_len = results["recompute"]["prompt_tokens"]
        for t in range(1, TURNS):
            row = [results[m]["ttft"][t] for m in ["recompute", "prefix-cache"] + CODECS]
            print(f"| {t + 1} | {prompt_len[t]} | " + " | ".join(f"{x:.3f}" for x in row) + " |")
        rec = sum(results["recompute"]["ttft"][1:])
        for m in ["prefix-cache"] + CODECS:
            print(f"turns 2..{TURNS}: {m} {rec / sum(results[m]['ttft'][1:]):.2f}x faster "
                  f"than recompute")
        print("\nstore bytes for the chat")
        for c in CODECS:
            s = results[c]["stats"]
            print(f"  {c}: {results[c]['bytes'] / 1e6:.1f} MB "
                  f"({results['raw']['bytes'] / max(1, results[c]['bytes']):.2f}x smaller "
                  f"than raw); hit {s.get('hit_tokens', 0):.0f} of "
                  f"{s.get('prompt_tokens', 0):.0f} prompt tokens")

        # 100 chats sharing the system prompt, in a namespace of their own.
        plan["namespace"] = "shared-bench"
        before = tenant_bytes(store.address, plan["token"])
        spawn("shared", dict(plan), work, env)
        shared = tenant_bytes(store.address, plan["token"]) - before
        plan["namespace"] = "alice"
        block_bytes = results["raw"]["bytes"] / max(1, results["raw"]["stats"].get(
            "saved_blocks", 1))
        alone = sum(len(plan["system"] + q) // harness.BLOCK for q in plan["questions"])
        print(f"\n{SHARED_CHATS} chats sharing a {len(plan['system'])}-token system prompt "
              f"(raw): {shared / 1e6:.1f} MB stored, against {alone * block_bytes / 1e6:.1f} MB "
              f"for {SHARED_CHATS} x one chat alone ({alone * block_bytes / max(1, shared):.1f}x)")

        print("\nload path into vLLM's CPU cache layout (blocks/s; median of 5)")
        print("| codec | blocks | bytes/block | fetch+decode+copy | decode+copy | plain copy | "
              "load / copy |")
        print("|---|---|---|---|---|---|---|")
        for codec, nb, bpb, full, dec, copy in load_throughput(plan, store.address,
                                                                plan["token"]):
            print(f"| {codec} | {nb} | {bpb / 1e6:.2f} MB | {full:.0f} | {dec:.0f} | {copy:.0f} | "
                  f"{full / copy:.3f}x |")
    finally:
        store.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
