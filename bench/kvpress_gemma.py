#!/usr/bin/env python3
"""NVIDIA's kvpress on Gemma 3 270M: the peer beside bench/gemma_suite.py.

kvpress compresses only while prefilling, so its protocol, used here: for
each question about an earlier round in traces/gemma3_chats.jsonl, the
conversation up to that round is the context (compressed by the press), and
the round's user turn plus the assistant's opening up to the scored span is
appended uncompressed; then 8 greedy tokens, right when they contain the
stated value (case-insensitive), as bench/gemma_suite.py counts. The model is
the same GGUF file, dequantized by transformers (`gguf_file=`), and the token
ids are the file's own, so both sides read the same tokens.

Run it with the venv `scripts/kvtier.sh kvpress-venv` prints:

  $(scripts/kvtier.sh kvpress-venv)/bin/python bench/kvpress_gemma.py \\
      --model "$(scripts/kvtier.sh model)" [--count 8] [--presses none,snapkv:0.5,...]

A press with ratio 0 must answer exactly as no press: the script checks it
and stops when it does not. kvpress spares Gemma 3's sliding layers only for
Gemma3ForConditionalGeneration; this file loads as Gemma3ForCausalLM, so by
default every layer is compressed (`--sliding=spare` widens kvpress's check
to this class, as kvtier spares them; see its help for what then fails).
"""

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(model_path):
    import torch
    from transformers import AutoModelForCausalLM
    d, f = os.path.split(os.path.abspath(model_path))
    m = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, torch_dtype=torch.float32)
    m.eval()
    return m


def questions(path, count):
    out = []
    with open(path) as f:
        for i, line in enumerate(f):
            if i >= count:
                break
            c = json.loads(line)
            context = []
            for r in c["rounds"]:
                if r.get("expect"):
                    spans = r.get("score") or [[0, len(r["assistant"])]]
                    opening = r["assistant"][:spans[0][0]]
                    out.append({"conversation": c["id"], "context": list(context),
                                "question": r["user"] + opening, "expect": r["expect"]})
                context += r["user"] + r["assistant"]
    return out


def spare_sliding_layers():
    """kvpress skips Gemma 3's sliding layers only for
    Gemma3ForConditionalGeneration; this GGUF loads as Gemma3ForCausalLM, whose
    sliding layers it would compress too (kvtier never does: a sliding layer
    keeps its window). Its check is widened to the causal-LM class, so both
    sides compress the 3 global layers only."""
    from kvpress.presses import base_press
    from transformers.models.gemma3.modeling_gemma3 import (Gemma3ForCausalLM,
                                                            Gemma3ForConditionalGeneration)
    base_press.Gemma3ForConditionalGeneration = (Gemma3ForConditionalGeneration, Gemma3ForCausalLM)


def make_press(spec):
    import kvpress
    if spec == "none":
        return None
    name, ratio = spec.split(":")
    cls = {"snapkv": kvpress.SnapKVPress, "knorm": kvpress.KnormPress,
           "streaming": kvpress.StreamingLLMPress, "pyramidkv": kvpress.PyramidKVPress}
    if name == "adakv":
        return kvpress.AdaKVPress(kvpress.SnapKVPress(compression_ratio=float(ratio)))
    return cls[name](compression_ratio=float(ratio))


def answer(model, tok_decode, q, press, new_tokens=8):
    import torch
    from transformers import DynamicCache
    cache = DynamicCache()
    ctx = torch.tensor([q["context"]])
    with torch.no_grad():
        if press is not None:
            with press(model):
                model(ctx, past_key_values=cache, use_cache=True)
        else:
            model(ctx, past_key_values=cache, use_cache=True)
        ids = torch.tensor([q["question"]])
        out = []
        for _ in range(new_tokens):
            logits = model(ids, past_key_values=cache, use_cache=True).logits[0, -1]
            nxt = int(torch.argmax(logits))
            out.append(nxt)
            ids = torch.tensor([[nxt]])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--conversations", default=os.path.join(ROOT, "traces", "gemma3_chats.jsonl"))
    ap.add_argument("--count", type=int, default=8)
    ap.add_argument("--presses", default="none,snapkv:0.0,snapkv:0.5,knorm:0.5,adakv:0.5")
    ap.add_argument("--sliding", choices=["spare", "compress"], default="compress",
                    help="compress Gemma 3's sliding layers too (kvpress's own behaviour for "
                    "Gemma3ForCausalLM) or spare them as kvtier does (with kvpress 0.5.5 and "
                    "transformers 5.2.0 the question's forward then fails: the mask is built "
                    "for the sliding layers' length, docs/fidelity.md)")
    a = ap.parse_args()
    if a.sliding == "spare":
        spare_sliding_layers()
    import torch
    from gguf import GGUFReader  # noqa: F401  (transformers needs it for gguf_file=)
    from transformers import AutoTokenizer
    torch.manual_seed(0)
    d, f = os.path.split(os.path.abspath(a.model))
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = load(a.model)
    qs = questions(a.conversations, a.count)
    print(f"{len(qs)} questions from {a.count} conversations; presses {a.presses}",
          file=sys.stderr)
    results = {}
    for spec in a.presses.split(","):
        t0 = time.time()
        press = make_press(spec)
        got = []
        for q in qs:
            text = tok.decode(answer(model, tok.decode, q, press))
            got.append({"text": text, "right": q["expect"].lower() in text.lower()})
        results[spec] = got
        right = sum(g["right"] for g in got)
        print(f"{spec:14s} {right}/{len(got)} right ({time.time() - t0:.0f} s)", flush=True)
        if spec.endswith(":0.0") and "none" in results:
            same = all(x["text"] == y["text"] for x, y in zip(results["none"], got))
            print(f"  ratio 0 reproduces no press: {same}", flush=True)
            if not same:
                return 1
    os.makedirs(os.path.join(ROOT, "build"), exist_ok=True)
    json.dump(results, open(os.path.join(ROOT, "build", f"kvpress-gemma-{a.sliding}.json"), "w"),
              indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
