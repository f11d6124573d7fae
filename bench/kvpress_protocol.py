"""kvpress's protocol on the conversations of traces/gemma3_chats.jsonl, shared
by bench/gemma_suite.py (kvtier's side, through kvtier-store and
kvtier-worker) and bench/kvpress_gemma.py (kvpress's side, in transformers).

kvpress compresses only while prefilling a context. For each question about
an earlier round (a round with "expect"), the conversation before that round
is the context and is compressed once; the round's user turn (the question)
and the first ANSWER_TOKENS tokens of its assistant turn are appended
uncompressed and teacher-forced. Both sides score the same positions:

  - right: the greedy tokens over the round's scored span (its "score"
    entries, the opening of the answer) contain the stated value,
    case-insensitively, as the replay counts (docs/replay.md);
  - top-1 and KL(full || compressed) over the ANSWER_TOKENS answer
    positions, each against its own engine's full cache.

For kvtier the question becomes a conversation of two rounds: round 0 is
the context (every earlier round's tokens, the last earlier assistant turn
as its answer, so the tokens and positions are the original ones) and round
1 the question. Eviction runs when round 0 ends, with the budget B tokens per
KV head at each global layer (a sliding layer keeps its window); kvpress gets,
per question, the compression ratio 1 - B / (context tokens), so both keep
the same B tokens of the context at the same layers: equal kept bytes.

Pure Python (no numpy), so both venvs and the system Python import it.
"""

import json

ANSWER_TOKENS = 16


def questions(path, count):
    """The questions of the first `count` conversations: dicts with
    conversation, round, context (token ids), context_user / context_answer
    (the context split as round 0 of the derived conversation), question,
    answer (the first ANSWER_TOKENS assistant ids), score (spans within
    answer) and expect."""
    out = []
    with open(path) as f:
        for i, line in enumerate(f):
            if i >= count:
                break
            c = json.loads(line)
            rounds = c["rounds"]
            for n, r in enumerate(rounds):
                if not r.get("expect") or n == 0:
                    continue
                spans = r.get("score") or [[0, len(r["assistant"])]]
                answer = r["assistant"][:max(ANSWER_TOKENS, max(e for _, e in spans))]
                before = [t for x in rounds[:n - 1] for t in x["user"] + x["assistant"]]
                out.append({
                    "conversation": c["id"],
                    "round": n,
                    "context": before + rounds[n - 1]["user"] + rounds[n - 1]["assistant"],
                    "context_user": before + rounds[n - 1]["user"],
                    "context_answer": rounds[n - 1]["assistant"],
                    "question": r["user"],
                    "answer": answer,
                    "score": spans,
                    "expect": r["expect"],
                })
    return out


def write_conversations(qs, path):
    """The questions as kvtier conversations (docs/replay.md's JSON Lines):
    one conversation of two rounds per question, in order."""
    with open(path, "w") as f:
        for q in qs:
            c = {"id": f"{q['conversation']}-q{q['round']}",
                 "rounds": [{"user": q["context_user"], "assistant": q["context_answer"]},
                            {"user": q["question"], "assistant": q["answer"],
                             "score": q["score"], "expect": q["expect"]}]}
            f.write(json.dumps(c) + "\n")


def bootstrap(per_conv, draws=2000, seed=7):
    """95% interval of sum(right) / sum(asked) over conversations resampled
    with replacement; per_conv is a list of (right, asked)."""
    import random
    rng = random.Random(seed)
    n = len(per_conv)
    stats = []
    for _ in range(draws):
        pick = [per_conv[rng.randrange(n)] for _ in range(n)]
        asked = sum(p[1] for p in pick)
        stats.append(sum(p[0] for p in pick) / asked if asked else 0.0)
    stats.sort()
    return stats[int(0.025 * draws)], stats[int(0.975 * draws) - 1]


def by_conversation(rows):
    """(right, asked) per original conversation, from per-question rows that
    carry "conversation" and "right"."""
    acc = {}
    for r in rows:
        a = acc.setdefault(r["conversation"], [0, 0])
        a[0] += 1 if r["right"] else 0
        a[1] += 1
    return [tuple(v) for v in acc.values()]
