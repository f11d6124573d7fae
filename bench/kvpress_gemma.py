#!/usr/bin/env python3
"""NVIDIA's kvpress on Gemma 3 270M: the peer beside bench/gemma_suite.py.

Uses kvpress's protocol (bench/kvpress_protocol.py): for each question about
an earlier round in traces/gemma3_chats.jsonl, the conversation before it is
the context, compressed by the press while prefilled; the question and the
first 16 answer tokens are appended uncompressed and teacher-forced. A press
named with a budget B ("snapkv:128") gets, per question, the compression ratio
1 - B / (context tokens), so it keeps B context tokens at each compressed
layer, as kvtier's `EVICT=snapkv:128` does under the same protocol
(`bench/gemma_suite.py --protocol kvpress`). "snapkv:all" is ratio 0.

The model is the same GGUF file, dequantized by transformers (`gguf_file=`),
and the token ids are the file's own. The cache is a DynamicCache built from
the model's config, so Gemma 3's sliding layers keep their window and the
attention masks are sized from the right layers; the appended tokens are fed
one at a time, so every mask is exact whatever the global layers keep.

Run it with the venv `scripts/kvtier.sh kvpress-venv` prints:

  $(scripts/kvtier.sh kvpress-venv)/bin/python bench/kvpress_gemma.py \\
      --model "$(scripts/kvtier.sh model)" [--count 8] [--presses none,snapkv:128,...]

A press at ratio 0 must answer exactly as no press: the script checks it
and stops when it does not. kvpress spares Gemma 3's sliding layers only for
Gemma3ForConditionalGeneration; this file loads as Gemma3ForCausalLM, so by
default (`--sliding=spare`) its check is widened to that class, as kvtier
spares them; `--sliding=compress` keeps kvpress's own behaviour.
"""

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import kvpress_protocol  # noqa: E402


def load(model_path):
    import torch
    from transformers import AutoModelForCausalLM
    d, f = os.path.split(os.path.abspath(model_path))
    m = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, torch_dtype=torch.float32)
    m.eval()
    return m


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


def make_press(spec, context_tokens):
    """The press for `spec` ("none", "snapkv:all", "snapkv:B", ...) on a
    context of `context_tokens`: ratio 1 - B / tokens (0 when B covers it)."""
    import kvpress
    if spec == "none":
        return None
    name, budget = spec.split(":")
    ratio = 0.0 if budget == "all" else max(0.0, 1.0 - int(budget) / context_tokens)
    cls = {"snapkv": kvpress.SnapKVPress, "knorm": kvpress.KnormPress,
           "streaming": kvpress.StreamingLLMPress, "pyramidkv": kvpress.PyramidKVPress}
    if name == "adakv":
        return kvpress.AdaKVPress(kvpress.SnapKVPress(compression_ratio=ratio))
    return cls[name](compression_ratio=ratio)


def logits_over_answer(model, q, press):
    """Prefills the context under `press`, then feeds the question and the
    answer one token at a time; returns the logits that predict each answer
    token [answer tokens, vocab] and the context tokens the first global
    layer keeps."""
    import torch
    from transformers import DynamicCache
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        ctx = torch.tensor([q["context"]])
        if press is not None:
            with press(model):
                model.model(input_ids=ctx, past_key_values=cache)
        else:
            model.model(input_ids=ctx, past_key_values=cache)
        glob = [i for i, l in enumerate(cache.layers) if not l.is_sliding]
        kept = cache.layers[glob[0]].keys.shape[-2] if glob else -1
        feed = q["question"] + q["answer"][:-1]
        out = []
        for i, t in enumerate(feed):
            logits = model(torch.tensor([[t]]), past_key_values=cache, use_cache=True).logits[0, -1]
            if i >= len(q["question"]) - 1:
                out.append(logits.float())
    return torch.stack(out), kept


def score(tok, q, logits, ref):
    import torch
    greedy = torch.argmax(logits, dim=-1)
    span = [int(greedy[i]) for b, e in q["score"] for i in range(b, e)]
    text = tok.decode(span)
    row = {"conversation": q["conversation"], "round": q["round"], "text": text,
           "right": q["expect"].lower() in text.lower(), "positions": len(greedy)}
    if ref is not None:
        lp = torch.log_softmax(logits, dim=-1)
        lr = torch.log_softmax(ref, dim=-1)
        row["kl"] = float((lr.exp() * (lr - lp)).sum(dim=-1).mean())
        row["top1"] = float((greedy == torch.argmax(ref, dim=-1)).float().mean())
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--conversations", default=os.path.join(ROOT, "traces", "gemma3_chats.jsonl"))
    ap.add_argument("--count", type=int, default=8)
    ap.add_argument("--presses",
                    default="none,snapkv:all,snapkv:256,snapkv:512,adakv:256,adakv:512,knorm:256,"
                    "knorm:512,pyramidkv:256")
    ap.add_argument("--sliding", choices=["spare", "compress"], default="spare",
                    help="spare Gemma 3's sliding layers as kvtier does (default) or compress "
                    "them too, kvpress's own behaviour for Gemma3ForCausalLM")
    ap.add_argument("--out", default=os.path.join(ROOT, "build", "kvpress-gemma"))
    a = ap.parse_args()
    specs = a.presses.split(",")
    if specs[0] != "none":
        ap.error("--presses must start with none (the reference for KL and top-1)")
    if a.sliding == "spare":
        spare_sliding_layers()
    import logging
    # kvpress warns on every press that Gemma3ForCausalLM is not among its
    # tested classes; said once here instead.
    print("kvpress 0.5.5 has not tested Gemma3ForCausalLM; ratio 0 is checked against no press",
          file=sys.stderr)
    logging.getLogger("kvpress").setLevel(logging.ERROR)
    import torch
    from gguf import GGUFReader  # noqa: F401  (transformers needs it for gguf_file=)
    from transformers import AutoTokenizer
    torch.manual_seed(0)
    d, f = os.path.split(os.path.abspath(a.model))
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = load(a.model)
    qs = kvpress_protocol.questions(a.conversations, a.count)
    print(f"{len(qs)} questions from {a.count} conversations; presses {a.presses}; "
          f"sliding layers: {a.sliding}", file=sys.stderr)
    results = {s: [] for s in specs}
    secs = {s: 0.0 for s in specs}
    t_all = time.time()
    for n, q in enumerate(qs):
        ref = None
        for spec in specs:
            t0 = time.time()
            logits, kept = logits_over_answer(model, q, make_press(spec, len(q["context"])))
            if spec == "none":
                ref = logits
            row = score(tok, q, logits, ref)
            row["kept"] = kept
            row["context"] = len(q["context"])
            results[spec].append(row)
            secs[spec] += time.time() - t0
            if spec == "snapkv:all" and (row["text"] != results["none"][-1]["text"] or
                                         row["kl"] > 1e-6):
                print(f"ratio 0 differs from no press on {q['conversation']} round "
                      f"{q['round']}: {row}", file=sys.stderr)
                return 1
        print(f"[{time.time() - t_all:6.0f} s] {n + 1}/{len(qs)} {q['conversation']} round "
              f"{q['round']} ({len(q['context'])} context tokens): " +
              ", ".join(f"{s} {'right' if results[s][-1]['right'] else 'wrong'}" for s in specs),
              file=sys.stderr, flush=True)
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"results-{a.sliding}.json")
    with open(path, "w") as fo:
        json.dump({"count": a.count, "sliding": a.sliding, "presses": results,
                   "seconds": secs}, fo, indent=1)
    for s in specs:
        rows = results[s]
        right = sum(r["right"] for r in rows)
        lo, hi = kvpress_protocol.bootstrap(kvpress_protocol.by_conversation(rows))
        kl = sum(r.get("kl", 0.0) for r in rows) / len(rows)
        top1 = sum(r.get("top1", 1.0) for r in rows) / len(rows)
        print(f"{s:14s} {right}/{len(rows)} right ({lo:.2f}-{hi:.2f}), top-1 {top1:.3f}, "
              f"KL {kl:.4f}, {secs[s]:.0f} s", flush=True)
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
