#!/usr/bin/env python3
"""Writes multi-round conversations for Gemma 3 270M (traces/gemma3_chats.jsonl).

Each conversation states four personal facts in its early rounds, talks about
other things for a while, then asks about each fact; the model's greedy answers
with the full cache (llama.cpp, F16 cache, pinned settings) are the reference.
The file is the replay format of docs/replay.md: token ids per round, the
rounds' text, and for each question about a fact the span of the answer to
score and the value the answer must contain ("expect").

The model is the pretrained (base) one, without a chat template: rounds are a
plain transcript, "User: ...\\nAssistant:", and a question about a fact opens
the answer with its first words ("Your sister Alice moved to"), which the base
model needs to answer at all.

Run with the evaluation venv (scripts/kvtier.sh venv):
  $(scripts/kvtier.sh venv)/bin/python scripts/make_gemma_conversations.py \\
      --model "$(scripts/kvtier.sh model)" --out traces/gemma3_chats.jsonl
Deterministic for a given llama.cpp build and machine: greedy decoding, seeded
choices.
"""
import argparse
import json
import random
import sys

import numpy as np
import llama_cpp

# (statement, question, answer opening, values)
FACTS = [
    ("My sister Alice moved to {} last spring.", "Where did my sister Alice move?",
     "Your sister Alice moved to",
     ["Lisbon", "Oslo", "Nairobi", "Montreal", "Kyoto", "Valencia", "Krakow", "Santiago"]),
    ("We adopted a puppy last week and named him {}.", "What is the name of our new puppy?",
     "Your new puppy is named",
     ["Biscuit", "Pepper", "Mango", "Ziggy", "Waffles", "Bruno", "Noodle", "Captain"]),
    ("I work as a {} at a small company downtown.", "What do I do for a living?",
     "You work as a",
     ["pharmacist", "carpenter", "translator", "librarian", "pilot", "dentist", "chef",
      "plumber"]),
    ("My favorite color has always been {}.", "What is my favorite color?",
     "Your favorite color is",
     ["turquoise", "orange", "purple", "crimson", "yellow", "teal", "maroon", "silver"]),
    ("I drive an old {} that I bought from my uncle.", "What car do I drive?",
     "You drive an old",
     ["Volvo", "Toyota", "Peugeot", "Subaru", "Fiat", "Honda", "Jeep", "Mazda"]),
    ("I was born in {}, but I grew up somewhere else.", "Where was I born?",
     "You were born in",
     ["Dublin", "Cairo", "Manila", "Chicago", "Hamburg", "Lima", "Seoul", "Athens"]),
    ("My brother Tom plays the {} in a band.", "What instrument does my brother Tom play?",
     "Your brother Tom plays the",
     ["trumpet", "cello", "drums", "saxophone", "violin", "banjo", "flute", "harmonica"]),
    ("My dentist appointment is on {} morning.", "When is my dentist appointment?",
     "Your dentist appointment is on",
     ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"]),
    ("My daughter is learning to speak {} at school.", "Which language is my daughter learning?",
     "Your daughter is learning",
     ["Spanish", "Japanese", "German", "Italian", "Portuguese", "Swedish", "Korean", "Greek"]),
    ("The name of my cat is {}.", "What is my cat's name?", "Your cat's name is",
     ["Whiskers", "Luna", "Oscar", "Mittens", "Shadow", "Ginger", "Simba", "Pumpkin"]),
]

ASKS = ["What do you think about that?", "Any thoughts?", "Can you tell me something about it?",
        "What would you suggest?", "Is that interesting to you?"]

FILLER = [
    "a lighthouse keeper and a storm", "a lost kite", "a baker who overslept",
    "a robot learning to paint", "two friends crossing a desert", "a dragon afraid of heights",
    "a village without clocks", "a fisherman and a golden fish", "a girl who collected maps",
    "a train that never stopped", "an old tree in the park", "a detective and a missing hat",
    "a boy who talked to birds", "a city under the sea", "a clockmaker's apprentice",
    "a snowman in summer", "a knight who hated armor", "a library at midnight",
    "a mountain goat who wanted to fly", "a music box", "a garden on the roof",
    "a sailor and a message in a bottle", "a shy giant", "a bakery for animals",
    "a comet passing by", "a grandmother's secret recipe", "an astronaut's first day",
    "a fox and a crow", "a bridge built by ants", "a market in the rain",
]

# F: a fact stated; x: a story about something else; Q: a question about a
# fact. Stories are long enough that most facts have left a 512-token
# sliding window by the time they are asked about.
ROUND_PLAN = ["F0", "x", "F1", "x", "F2", "x", "F3", "x", "x", "Q0", "x", "Q1", "x", "Q2", "Q3"]


class Session:
    """One conversation in llama.cpp's context, greedy."""

    def __init__(self, llm):
        self.llm = llm
        llm.reset()
        self.first = True

    def feed(self, text):
        ids = self.llm.tokenize(text.encode(), add_bos=self.first, special=False)
        self.first = False
        self.llm.eval(ids)
        return ids

    def next_token(self):
        """The greedy token after everything fed so far."""
        p = llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(p, shape=(self.llm.n_vocab(),))))

    def answer(self, max_tokens, one_line):
        """Greedy tokens up to max_tokens, the end of the line (one_line), or
        the model starting the user's next turn; the stop is not kept."""
        out = []
        for _ in range(max_tokens):
            tok = self.next_token()
            if tok == self.llm.token_eos():
                break
            piece = self.llm.detokenize([tok]).decode("utf-8", "replace")
            if one_line and "\n" in piece:
                break
            text = self.llm.detokenize(out + [tok]).decode("utf-8", "replace")
            if "User" in text[-len(piece) - 5:]:
                break
            out.append(tok)
            self.llm.eval([tok])
        # A turn ends with the round's "\n\n", not with newlines of its own:
        # they leave the answer and llama.cpp's context (its next eval
        # drops the cache past n_tokens).
        while out and self.llm.detokenize([out[-1]]).strip() == b"":
            out.pop()
            self.llm.n_tokens -= 1
        return out


def conversation(llm, rng, index):
    facts = rng.sample(range(len(FACTS)), 4)
    values = [rng.choice(FACTS[f][3]) for f in facts]
    fillers = rng.sample(FILLER, ROUND_PLAN.count("x"))
    s = Session(llm)
    rounds = []
    end = llm.tokenize(b"\n\n", add_bos=False, special=False)
    for step in ROUND_PLAN:
        expect, opening = "", ""
        if step.startswith("F"):
            k = int(step[1])
            user = FACTS[facts[k]][0].format(values[k]) + " " + rng.choice(ASKS)
        elif step.startswith("Q"):
            k = int(step[1])
            user = FACTS[facts[k]][1]
            opening = " " + FACTS[facts[k]][2]
            expect = values[k]
        else:
            user = "Tell me a story about " + fillers.pop()
            opening = " Once upon a time"
        user_text = "User: " + user + "\nAssistant:" + opening
        user_ids = s.feed(user_text)
        answer = s.answer({"F": 48, "Q": 24, "x": 128}[step[0]], one_line=step[0] != "x")
        if not answer:  # Never an empty round: the model's own next token.
            answer = [s.next_token()]
            llm.eval(answer)
        llm.eval(end)
        r = {"user": user_ids, "assistant": answer + end, "user_text": user_text,
             "assistant_text": llm.detokenize(answer).decode("utf-8", "replace") + "\n\n"}
        if expect:
            r["score"] = [[0, min(6, len(answer))]]
            r["expect"] = expect
        rounds.append(r)
    return {"id": f"gemma3-chat-{index:02d}", "rounds": rounds}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="gemma-3-270m-q4_k_m.gguf")
    ap.add_argument("--out", required=True)
    ap.add_argument("--count", type=int, default=20)
    ap.add_argument("--seed", type=int, default=55)
    a = ap.parse_args()
    llm = llama_cpp.Llama(model_path=a.model, n_ctx=4096, n_batch=512, n_ubatch=512, n_threads=2,
                          flash_attn=False, verbose=False, seed=a.seed)
    rng = random.Random(a.seed)
    right = asked = 0
    with open(a.out + ".partial", "w") as f:
        for i in range(a.count):
            c = conversation(llm, rng, i)
            f.write(json.dumps(c, ensure_ascii=False) + "\n")
            n = sum(len(r["user"]) + len(r["assistant"]) for r in c["rounds"])
            ok = [r["expect"].lower() in r["assistant_text"].lower()
                  for r in c["rounds"] if "expect" in r]
            right += sum(ok)
            asked += len(ok)
            print(f"{c['id']}: {len(c['rounds'])} rounds, {n} tokens, "
                  f"{sum(ok)}/{len(ok)} facts recalled", file=sys.stderr, flush=True)
    import os
    os.replace(a.out + ".partial", a.out)
    print(f"{a.count} conversations; the full cache recalls {right}/{asked} facts",
          file=sys.stderr)


if __name__ == "__main__":
    main()
