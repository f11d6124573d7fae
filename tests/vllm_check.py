"""kvtier inside real vLLM: Gemma 3 270M served by vLLM's CPU build with
kvtier.vllm.KvtierConnector and a real kvtier-store (tests/vllm_test.sh runs
this in the vLLM venv; docs/vllm.md).

Multi-turn chats that share a system prompt; each turn's prompt extends the
previous one in token ids. Every phase is a fresh vLLM process:
  baseline  vLLM alone, its own prefix cache on: the reference answers, with
            each position's top-2 logprobs.
  raw       the connector, raw codec, vLLM's prefix cache off (every reuse
            goes through kvtier): every turn's greedy answer equals the
            baseline's, or differs first at a near-tie of the baseline;
            conversation 1's first turn reuses conversation 0's system
            prompt; turns after the first load their history.
  second    another instance serves each conversation's last turn from the
            blocks the first one stored (no recompute of the stored prefix,
            by the connector's counters); one conversation lost a middle
            block and is recomputed from there, another has a block of the
            wrong layout under its name, refused at load and recomputed;
            the answers stay the baseline's.
  kivi8     the connector with KIVI-8 blocks: teacher-forced top-1
            agreement with the baseline's answers >= 0.99.
And across tenants: another tenant's token finds none of these blocks, and
its deletions remove nothing of them.

Exit status 0 when every check holds; the report is printed.
"""

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

BLOCK = 128  # vLLM's CPU block size
ANSWER = 32  # tokens per answer
FORCED = 12  # teacher-forced positions per answer (KIVI-8)
# A differing greedy token is a near-tie when the baseline's top-2 logprob gap
# is at most this. vLLM's logits are bf16: at magnitudes 16-32 one step is
# 0.125, so two runs whose sums differ only in order can swap tokens up to a
# couple of steps apart.
NEAR_TIE = 0.26

SYSTEM = (
    "You are a patient assistant for a community garden. The garden has forty raised "
    "beds, a tool shed with shared tools, two compost bins, a rain barrel system and a "
    "small greenhouse. Members sign up for a bed each spring, water their own plot, and "
    "share the weeding of the paths on Saturday mornings. Tools go back to the shed "
    "clean and dry. The compost bins take fruit and vegetable scraps, coffee grounds, "
    "leaves and straw, but never meat, dairy, oil or diseased plants. The greenhouse "
    "opens from March to May for seedlings; each member may use one shelf. Water from "
    "the rain barrels is for the beds only. Answer questions about the garden briefly "
    "and kindly, suggest what grows well in a small raised bed in a temperate climate, "
    "and when you do not know something, say so and suggest asking the garden committee, "
    "which meets on the first Monday of every month in the library's back room. ") * 2
# Each chat's turns repeat who is asking, so that every chat owns several
# blocks beyond the shared system prompt.
ABOUT = [
    "I have bed 7 by the east fence, where the morning sun is strong and the soil is sandy. ",
    "I share bed 12 with my neighbour near the greenhouse door; we both work late on weekdays. ",
    "I just moved to town, I have never grown vegetables, and my daughter wants to help me. ",
]
CHATS = [
    [ABOUT[0] * 3 + q for q in (
        "What should I plant first in my bed this spring?",
        "How often should I water the seedlings?",
        "Can I put orange peels in the compost?",
        "What do I do with my tools after weeding?")],
    [ABOUT[1] * 3 + q for q in (
        "When does the greenhouse open?",
        "How many shelves can I use there?",
        "Is rain barrel water fine for my tomatoes?",
        "Who decides on new rules for the garden?")],
    [ABOUT[2] * 3 + q for q in (
        "How do I get a bed?",
        "What grows well in a small raised bed?",
        "Can I compost leftover pizza?",
        "When does the committee meet?")],
]


def turn_text(question):
    return f"<start_of_turn>user\n{question}<end_of_turn>\n<start_of_turn>model\n"


# ---- the phases (each in its own process) ----

def make_llm(model, connector):
    from vllm import LLM
    from vllm.config import KVTransferConfig
    kw = dict(model=model, dtype="bfloat16", max_model_len=2048, enforce_eager=True,
              kv_cache_memory_bytes=256 << 20, seed=0)
    if connector is None:
        return LLM(enable_prefix_caching=True, **kw)
    kt = KVTransferConfig(kv_connector="KvtierConnector", kv_connector_module_path="kvtier.vllm",
                          kv_role="kv_both", kv_load_failure_policy="recompute",
                          kv_connector_extra_config=connector)
    return LLM(enable_prefix_caching=False, kv_transfer_config=kt, **kw)


def generate(llm, prompts, max_tokens, logprobs=None):
    from vllm import SamplingParams, TokensPrompt
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=logprobs,
                        ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp,
                        use_tqdm=False)
    result = []
    for o in outs:
        c = o.outputs[0]
        gaps = []
        for pos in (c.logprobs or []):
            lps = sorted((lp.logprob for lp in pos.values()), reverse=True)
            gaps.append(lps[0] - lps[1] if len(lps) > 1 else 99.0)
        result.append({"tokens": list(c.token_ids), "gaps": gaps})
    return result


def wait_stored(plan, chains, timeout=60.0):
    """Waits until the store holds every full block of `chains` (token lists)
    under the plan's namespace: the connector saves in the background."""
    from kvtier.blocks import BlockStore, block_name, chain_keys
    store = BlockStore(plan["store"], plan["token"])
    try:
        root = root_of(plan, plan["codec"])
        deadline = time.time() + timeout
        for tokens in chains:
            names = [block_name(k) for k in chain_keys(root, tokens)]
            while store.lookup(names) < len(names):
                if time.time() > deadline:
                    raise RuntimeError(f"the store holds {store.lookup(names)} of "
                                       f"{len(names)} blocks after {timeout} s")
                time.sleep(0.05)
    finally:
        store.close()


def root_of(plan, codec):
    from kvtier.blocks import BlockLayout, ChainRoot
    layout = BlockLayout(num_layers=18, num_kv_heads=1, head_dim=256, block_tokens=BLOCK,
                         dtype="bf16", codec=codec)
    return ChainRoot(namespace=plan["namespace"], model_digest=plan["digest"], layout=layout)


def connector_config(plan, codec, stats):
    return {"store": plan["store"], "token_file": plan["token_file"], "codec": codec,
            "namespace": plan["namespace"], "stats_file": stats}


def read_stats(stats):
    out = {}
    for side in ("scheduler", "worker"):
        path = f"{stats}.{side}.json"
        if os.path.exists(path):
            with open(path) as f:
                out.update(json.load(f))
    return out


def phase_chat(plan, name, codec):
    """Runs the chats turn by turn (histories are the baseline's answers, or
    this run's own for the baseline) and returns each turn's answers."""
    stats = os.path.join(plan["work"], f"stats-{name}")
    llm = make_llm(plan["model"], None if codec is None else connector_config(plan, codec, stats))
    prompts = [plan["system"] + plan["turns"][c][0] for c in range(len(CHATS))]
    answers = []  # [turn][conversation]
    ttft = []
    for t in range(len(CHATS[0])):
        if t > 0:
            prev = plan["baseline"][t - 1] if codec is not None else answers[t - 1]
            prompts = [prompts[c] + prev[c]["tokens"] + plan["turns"][c][t]
                       for c in range(len(CHATS))]
        if t == 0:
            # Conversation 0 alone first, so the others can reuse its system
            # prompt's blocks.
            first = generate(llm, prompts[:1], ANSWER, logprobs=2)
            if codec is not None:
                wait_stored(dict(plan, codec=codec), [prompts[0] + first[0]["tokens"][:-1]])
            rest = generate(llm, prompts[1:], ANSWER, logprobs=2)
            outs = first + rest
        else:
            start = time.perf_counter()
            outs = generate(llm, prompts, ANSWER, logprobs=2)
            ttft.append(time.perf_counter() - start)
        if codec is not None:
            wait_stored(dict(plan, codec=codec),
                        [prompts[c] + outs[c]["tokens"][:-1] for c in range(len(CHATS))])
        answers.append(outs)
    return {"answers": answers, "prompts": prompts, "stats": read_stats(stats)}


def phase_second(plan, codec):
    """A fresh instance serves each conversation's last turn."""
    stats = os.path.join(plan["work"], "stats-second")
    llm = make_llm(plan["model"], connector_config(plan, codec, stats))
    outs = generate(llm, plan["last_prompts"], ANSWER, logprobs=2)
    return {"answers": outs, "stats": read_stats(stats)}


def phase_forced(plan, codec):
    """Teacher-forced top-1: for every answer position after the first turn,
    the prompt plus the baseline's answer so far, one greedy token."""
    stats = os.path.join(plan["work"], f"stats-forced-{codec}")
    llm = make_llm(plan["model"], connector_config(plan, codec, stats))
    prompts, want = [], []
    for item in plan["forced"]:
        for i in range(len(item["answer"])):
            prompts.append(item["prompt"] + item["answer"][:i])
            want.append(item["answer"][i])
    got = [o["tokens"][0] for o in generate(llm, prompts, 1)]
    agree = sum(g == w for g, w in zip(got, want)) / len(want)
    return {"agreement": agree, "positions": len(want), "stats": read_stats(stats)}


def run_phase(argv):
    with open(argv.plan) as f:
        plan = json.load(f)
    if argv.phase == "baseline":
        out = phase_chat(plan, "baseline", None)
    elif argv.phase.startswith("chat-"):
        out = phase_chat(plan, argv.phase, argv.phase[len("chat-"):])
    elif argv.phase == "second":
        out = phase_second(plan, "raw")
    else:
        out = phase_forced(plan, argv.phase[len("forced-"):])
    with open(argv.out, "w") as f:
        json.dump(out, f)
    # vLLM's engine process is not always gone at interpreter exit.
    os._exit(0)


# ---- the driver ----

def spawn_phase(phase, plan_path, work, env, script=__file__, timeout=900):
    """Runs `script --phase PHASE --plan PLAN --out OUT` in a fresh process
    (a fresh vLLM) and returns the JSON it wrote; its log on failure."""
    out = os.path.join(work, f"{phase}.json")
    log = os.path.join(work, f"{phase}.log")
    start = time.time()
    with open(log, "w") as f:
        rc = subprocess.call([sys.executable, os.path.abspath(script), "--phase", phase,
                              "--plan", plan_path, "--out", out], stdout=f,
                             stderr=subprocess.STDOUT, env=env, timeout=timeout)
    if rc != 0 or not os.path.exists(out):
        with open(log) as f:
            tail = f.read()[-4000:]
        raise RuntimeError(f"phase {phase} failed (exit {rc}):\n{tail}")
    print(f"  phase {phase}: {time.time() - start:.0f} s", flush=True)
    with open(out) as f:
        return json.load(f)


def base_plan(model, store, work):
    """What every phase reads (the model, the store as tenant alice, the
    weights digest, the system prompt's tokens), and the tokenizer's ids()."""
    from transformers import AutoTokenizer
    from kvtier.vllm import model_digest
    tok = AutoTokenizer.from_pretrained(model)

    def ids(text):
        return tok(text, add_special_tokens=False).input_ids

    token_file = os.path.join(work, "alice.token")
    with open(token_file, "w") as f:
        f.write("alice-token-0001\n")
    plan = {"model": model, "store": store.address, "token_file": token_file,
            "token": "alice-token-0001", "namespace": "alice", "digest": model_digest(model),
            "work": work, "system": [tok.bos_token_id] + ids(SYSTEM)}
    return plan, ids


def compare(base, got):
    """(identical turns, near-tie turns, real differences as text)."""
    same = tie = 0
    bad = []
    for i, (b, g) in enumerate(zip(base, got)):
        if b["tokens"] == g["tokens"]:
            same += 1
            continue
        first = next(j for j, (x, y) in enumerate(zip(b["tokens"], g["tokens"])) if x != y)
        if b["gaps"][first] < NEAR_TIE:
            tie += 1
        else:
            bad.append(f"answer {i} differs at {first} (baseline's top-2 gap "
                       f"{b['gaps'][first]:.3f})")
    return same, tie, bad


class Store:
    def __init__(self, binary, work):
        self.tenants = os.path.join(work, "tenants")
        with open(self.tenants, "w") as f:
            f.write("alice-token-0001 alice readwrite\nbob-token-00001 bob readwrite\n")
        port_file = os.path.join(work, "store.port")
        self.log = open(os.path.join(work, "store.log"), "w")
        self.proc = subprocess.Popen(
            [binary, f"--data_dir={work}/db", "--listen=127.0.0.1:0",
             "--metrics_listen=127.0.0.1:0", f"--tenants_file={self.tenants}",
             f"--port_file={port_file}"], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 30
        while not (os.path.exists(port_file) and os.path.getsize(port_file)):
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError("kvtier-store did not start: see " + self.log.name)
            time.sleep(0.05)
        with open(port_file) as f:
            self.address = "127.0.0.1:" + f.read().strip()

    def stop(self):
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


def arguments(doc):
    """The flags of this check and of bench/vllm_bench.py: --store_binary and
    --model for a run, --phase, --plan and --out for one of its phases."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    for flag in ("--phase", "--plan", "--out", "--store_binary", "--model"):
        ap.add_argument(flag)
    return ap.parse_args()


def main():
    argv = arguments(__doc__)
    if argv.phase:
        return run_phase(argv)

    from kvtier.blocks import BlockStore, block_name, chain_keys, decode_block, encode_block

    work = tempfile.mkdtemp(prefix="kvtier-vllm-")
    store = Store(argv.store_binary, work)
    failures = []
    try:
        plan, ids = base_plan(argv.model, store, work)
        plan["turns"] = [[ids(turn_text(q)) for q in chat] for chat in CHATS]
        plan_path = os.path.join(work, "plan.json")

        def save_plan():
            with open(plan_path, "w") as f:
                json.dump(plan, f)

        save_plan()
        env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING", TOKENIZERS_PARALLELISM="false")
        print(f"system prompt {len(plan['system'])} tokens; {len(CHATS)} chats of "
              f"{len(CHATS[0])} turns, {ANSWER}-token answers", flush=True)

        base = spawn_phase("baseline", plan_path, work, env)
        plan["baseline"] = base["answers"]
        save_plan()

        raw = spawn_phase("chat-raw", plan_path, work, env)
        flat_base = [a for turn in base["answers"] for a in turn]
        flat_raw = [a for turn in raw["answers"] for a in turn]
        same, tie, bad = compare(flat_base, flat_raw)
        s = raw["stats"]
        print(f"raw codec, one instance: {same} of {len(flat_base)} answers identical, "
              f"{tie} differ first at a near-tie; hit {s.get('hit_tokens', 0):.0f} of "
              f"{s.get('prompt_tokens', 0):.0f} prompt tokens; loaded "
              f"{s.get('loaded_blocks', 0):.0f} blocks, saved {s.get('saved_blocks', 0):.0f}")
        failures += [f"raw: {b}" for b in bad]
        # The first turn of chats 1 and 2 reuses chat 0's system prompt (the
        # full blocks of it, less vLLM's own last token), and every later
        # turn its history.
        system_blocks = len(plan["system"]) // BLOCK
        if s.get("hit_tokens", 0) < 2 * system_blocks * BLOCK:
            failures.append(f"raw: {s.get('hit_tokens', 0)} hit tokens: the system prompt "
                            f"was not shared")
        if s.get("load_failures_missing", 0) or s.get("save_failures", 0):
            failures.append(f"raw: failures in {s}")

        # The second instance: each chat's last turn, after a middle block of
        # chat 2's chain is deleted.
        last = [raw["prompts"][c] for c in range(len(CHATS))]
        plan["last_prompts"] = last
        save_plan()
        alice = BlockStore(store.address, "alice-token-0001")
        bob = BlockStore(store.address, "bob-token-00001")
        root = root_of(plan, "raw")
        chains = [[block_name(k) for k in chain_keys(root, p)] for p in last]
        stored = [alice.lookup(c) for c in chains]
        print(f"stored blocks of the last turns' chains: {stored} of "
              f"{[len(c) for c in chains]}", flush=True)
        # Another tenant sees none of Alice's blocks, by her names or by its own.
        bob_root = dataclasses.replace(root, namespace="bob")
        if bob.lookup(chains[0]) or bob.lookup([block_name(k) for k in
                                                chain_keys(bob_root, last[0])]):
            failures.append("tenant bob found alice's blocks")
        if bob.delete(chains[0]) != 0 or alice.lookup(chains[0]) != stored[0]:
            failures.append("tenant bob's deletion reached alice's blocks")
        # The chats share their first system_blocks blocks; the damage goes
        # to blocks of one chat only.
        if min(len(c) for c in chains) <= system_blocks + 1:
            raise RuntimeError(f"chains of {[len(c) for c in chains]} blocks: too short")
        hole = max(system_blocks, len(chains[2]) // 2)
        alice.delete([chains[2][hole]])
        # Chat 1's first own block is replaced by one of another layout
        # (KIVI-8 bytes under the raw chain's name): found by the lookup,
        # refused by the load, recomputed by vLLM.
        own = chains[1][system_blocks]
        k, v = decode_block(alice.get([own])[0], root.layout)
        alice.delete([own])
        alice.put([(own, encode_block(k, v, root_of(plan, "kivi8").layout))],
                  root.layout.num_layers)
        alice.close()
        bob.close()

        second = spawn_phase("second", plan_path, work, env)
        same, tie, bad = compare(base["answers"][-1], second["answers"])
        s = second["stats"]
        full = sum(min(len(c), (len(p) - 1) // BLOCK) for c, p in zip(chains, last))
        expect = (full - (len(chains[2]) - hole)) * BLOCK
        print(f"second instance, last turns: {same} of {len(last)} answers identical, "
              f"{tie} near-ties; {s.get('load_failures_corrupt', 0):.0f} foreign block "
              f"refused and recomputed; hit {s.get('hit_tokens', 0):.0f} of "
              f"{s.get('prompt_tokens', 0):.0f} prompt tokens (stored prefix "
              f"{expect}); loaded {s.get('loaded_blocks', 0):.0f} blocks in "
              f"{s.get('load_seconds', 0) * 1e3:.0f} ms")
        failures += [f"second: {b}" for b in bad]
        if s.get("hit_tokens", 0) != expect:
            failures.append(f"second: {s.get('hit_tokens', 0)} hit tokens, expected {expect}")
        if s.get("load_failures_corrupt", 0) != 1:
            failures.append(f"second: the foreign block was not refused ({s})")

        # KIVI-8: store the chats' blocks, then score teacher-forced.
        spawn_phase("chat-kivi8", plan_path, work, env)
        forced = []
        prompts = [plan["system"] + plan["turns"][c][0] for c in range(len(CHATS))]
        for t in range(1, len(CHATS[0])):
            prompts = [prompts[c] + base["answers"][t - 1][c]["tokens"] + plan["turns"][c][t]
                       for c in range(len(CHATS))]
            for c in range(len(CHATS)):
                forced.append({"prompt": prompts[c],
                               "answer": base["answers"][t][c]["tokens"][:FORCED]})
        plan["forced"] = forced
        save_plan()
        k8 = spawn_phase("forced-kivi8", plan_path, work, env)
        s = k8["stats"]
        print(f"kivi8: teacher-forced top-1 agreement {k8['agreement']:.4f} over "
              f"{k8['positions']} positions; hit {s.get('hit_tokens', 0):.0f} of "
              f"{s.get('prompt_tokens', 0):.0f} prompt tokens; "
              f"{s.get('loaded_bytes', 0) / max(1, s.get('loaded_blocks', 1)) / 1e6:.2f} MB "
              f"a block")
        if k8["agreement"] < 0.99:
            failures.append(f"kivi8: agreement {k8['agreement']:.4f} < 0.99")
        if not s.get("loaded_blocks"):
            failures.append("kivi8: no block was loaded")
    finally:
        store.stop()
        if not failures:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"kept {work} for inspection")
    for f in failures:
        print("FAIL:", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
