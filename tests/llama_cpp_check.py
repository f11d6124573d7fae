#!/usr/bin/env python3
"""kvtier's forward pass and tokenizer against llama.cpp on the same model file.

Runs llama.cpp (llama-cpp-python, pinned settings: 2 threads, n_batch and
n_ubatch 512, F16 KV cache, flash attention off, every position's logits) and
`kvtier model logits` (float32 weights and cache) teacher-forced on the same
token ids: the first conversations of a replay file until --positions are
covered. Fails unless
  - every position where the two greedy tokens differ is a near-tie in
    llama.cpp's logits (top-2 gap < --tie),
  - top-1 agreement is >= --agree over all positions and >= --agree_answers
    over answer positions (those predicting an assistant token),
and prints the largest logit difference. The tokenizer check: kvtier's ids for
every round's text equal llama.cpp's (and the file's), and kvtier's text of
every answer equals llama.cpp's.

Two checks against the `gguf` package: kvtier's dequantization of the first
rows of one tensor of every type in the file equals the package's, and a
float64 forward pass written here in numpy over the package's dequantized
weights (gemma3 only) gives kvtier's logits within --reference_tolerance at
positions on both sides of the sliding window.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import gguf
import llama_cpp


def kvtier_lines(kvtier, model, sub, items, extra=()):
    """Runs `kvtier model SUB MODEL --jsonl=F` over JSON lines; its output lines."""
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        for it in items:
            f.write(json.dumps(it) + "\n")
        path = f.name
    try:
        out = subprocess.run([kvtier, "model", sub, model, "--jsonl=" + path, *extra],
                             check=True, capture_output=True, text=True).stdout
    finally:
        os.unlink(path)
    return out.split("\n")[: len(items)]


def check_dequant(kvtier, model, reader):
    """kvtier's rows of one tensor of each type against the gguf package's."""
    seen, bad = {}, []
    for t in reader.tensors:
        if t.tensor_type.name in seen or len(t.shape) < 2:
            continue
        rows = 64
        want = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        want = want.reshape(-1, int(t.shape[0]))[:rows]
        with tempfile.NamedTemporaryFile(suffix=".f32", delete=False) as f:
            path = f.name
        try:
            subprocess.run([kvtier, "model", "dequant", model, t.name, "--out=" + path,
                            f"--rows={rows}"], check=True)
            got = np.fromfile(path, dtype=np.float32).reshape(want.shape)
        finally:
            os.unlink(path)
        err = float(np.abs(got - want).max())
        seen[t.tensor_type.name] = (t.name, err)
        if err > 1e-6 * float(np.abs(want).max()):
            bad.append(t.name)
    print("dequantization vs the gguf package: " +
          ", ".join(f"{k} ({v[0]}) max diff {v[1]:.2g}" for k, v in sorted(seen.items())))
    return bad


def reference_logits(reader, ids, positions):
    """Gemma 3 in float64 numpy from the gguf package's weights: the logits
    at `positions` of the teacher-forced pass over `ids`."""
    tensors = {t.name: t for t in reader.tensors}

    def w(name):
        t = tensors[name]
        a = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float64)
        return a.reshape([int(x) for x in reversed(t.shape)])

    def meta(key):
        return reader.fields[key].contents()

    dim = meta("gemma3.embedding_length")
    heads, kv_heads = meta("gemma3.attention.head_count"), meta("gemma3.attention.head_count_kv")
    hd = meta("gemma3.attention.key_length")
    eps = meta("gemma3.attention.layer_norm_rms_epsilon")
    window, base = meta("gemma3.attention.sliding_window"), meta("gemma3.rope.freq_base")
    n = len(ids)
    pos = np.arange(n)

    def rms(v, g):
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + eps) * g

    def rope(v, b):  # [n, heads, hd], half-split pairs
        f = b ** (-2.0 * np.arange(hd // 2) / hd)
        ang = pos[:, None] * f[None, :]
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        x0, x1 = v[..., : hd // 2], v[..., hd // 2:]
        return np.concatenate([x0 * c - x1 * s, x0 * s + x1 * c], -1)

    def gelu(z):
        return 0.5 * z * (1 + np.tanh(0.7978845608028654 * (z + 0.044715 * z ** 3)))

    emb = w("token_embd.weight")
    x = emb[ids] * np.sqrt(dim)
    for layer in range(meta("gemma3.block_count")):
        g = lambda s: w(f"blk.{layer}.{s}.weight")  # noqa: E731
        is_global = (layer + 1) % 6 == 0
        xn = rms(x, g("attn_norm"))
        q = rms((xn @ g("attn_q").T).reshape(n, heads, hd), g("attn_q_norm"))
        k = rms((xn @ g("attn_k").T).reshape(n, kv_heads, hd), g("attn_k_norm"))
        v = (xn @ g("attn_v").T).reshape(n, kv_heads, hd)
        b = base if is_global else 10000.0
        q, k = rope(q, b), rope(k, b)
        rep = heads // kv_heads
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        sc = np.einsum("nhd,mhd->hnm", q, k) / np.sqrt(hd)
        masked = pos[None, :] > pos[:, None]
        if not is_global:
            masked |= pos[:, None] - pos[None, :] >= window
        sc = np.where(masked[None], -np.inf, sc)
        p = np.exp(sc - sc.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        o = np.einsum("hnm,mhd->nhd", p, v).reshape(n, heads * hd)
        x = x + rms(o @ g("attn_output").T, g("post_attention_norm"))
        xn = rms(x, g("ffn_norm"))
        f = (gelu(xn @ g("ffn_gate").T) * (xn @ g("ffn_up").T)) @ g("ffn_down").T
        x = x + rms(f, g("post_ffw_norm"))
    return rms(x[positions], w("output_norm.weight")) @ emb.T


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kvtier", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--conversations", required=True)
    ap.add_argument("--positions", type=int, default=1500)
    ap.add_argument("--tie", type=float, default=0.5)
    ap.add_argument("--agree", type=float, default=0.98)
    ap.add_argument("--agree_answers", type=float, default=0.99)
    ap.add_argument("--reference_positions", type=int, default=600)
    ap.add_argument("--reference_tolerance", type=float, default=0.05)
    a = ap.parse_args()
    reader = gguf.GGUFReader(a.model)
    bad_dequant = check_dequant(a.kvtier, a.model, reader)

    convs = [json.loads(l) for l in open(a.conversations, encoding="utf-8") if l.strip()]
    llm = llama_cpp.Llama(model_path=a.model, n_ctx=4096, n_batch=512, n_ubatch=512,
                          n_threads=2, logits_all=True, flash_attn=False, verbose=False,
                          type_k=llama_cpp.GGML_TYPE_F16, type_v=llama_cpp.GGML_TYPE_F16)
    vocab = llm.n_vocab()

    # Tokenizer: every round's text of every conversation.
    texts, want, answers = [], [], []
    for c in convs:
        for i, r in enumerate(c["rounds"]):
            texts.append({"text": r["user_text"], "bos": i == 0})
            ids = llm.tokenize(r["user_text"].encode(), add_bos=i == 0, special=False)
            if ids != r["user"]:
                sys.exit(f"{c['id']} round {i}: the file's ids are not llama.cpp's for its text")
            want.append(ids)
            answers.append((r["assistant"], llm.detokenize(r["assistant"]).decode("utf-8")))
    got = kvtier_lines(a.kvtier, a.model, "tokenize", texts)
    bad = [i for i, (g, w) in enumerate(zip(got, want)) if [int(x) for x in g.split()] != w]
    detok = kvtier_lines(a.kvtier, a.model, "detokenize", [x[0] for x in answers])
    bad_text = [i for i, (g, (_, w)) in enumerate(zip(detok, answers)) if json.loads(g) != w]
    print(f"tokenizer: {len(texts) - len(bad)}/{len(texts)} texts give llama.cpp's ids; "
          f"{len(answers) - len(bad_text)}/{len(answers)} answers give llama.cpp's text")
    for i in bad[:3]:
        print(f"  text {json.dumps(texts[i]['text'])}\n    llama.cpp {want[i]}\n    kvtier    {got[i]}")

    # Logits, conversation by conversation.
    n_all = agree_all = n_ans = agree_ans = 0
    worst_diff, worst_gap = 0.0, 0.0
    failures = []
    t_llama = t_kvtier = 0.0
    first = None
    for c in convs:
        if n_all >= a.positions:
            break
        ids, is_answer = [], []
        for r in c["rounds"]:
            ids += r["user"]
            is_answer += [False] * len(r["user"])
            ids += r["assistant"]
            is_answer += [True] * len(r["assistant"])
        n = len(ids)
        # Position p predicts token p + 1: an answer position when that token
        # is the assistant's.
        answer_pos = np.array(is_answer[1:] + [False])
        t0 = time.time()
        llm.reset()
        llm.eval(ids)
        ref = np.array(llm.scores[:n], dtype=np.float32)
        t_llama += time.time() - t0
        with tempfile.NamedTemporaryFile("w", suffix=".ids", delete=False) as f:
            f.write(" ".join(map(str, ids)))
            ids_path = f.name
        t0 = time.time()
        try:
            raw = subprocess.run([a.kvtier, "model", "logits", a.model, "--tokens=" + ids_path],
                                 check=True, capture_output=True).stdout
        finally:
            os.unlink(ids_path)
        t_kvtier += time.time() - t0
        ours = np.frombuffer(raw, dtype=np.float32).reshape(n, vocab)
        if first is None:
            first = (ids, ours, ref)
        top_ref, top_ours = ref.argmax(1), ours.argmax(1)
        srt = np.sort(ref, axis=1)
        gap = srt[:, -1] - srt[:, -2]
        same = top_ref == top_ours
        diff = np.abs(ref - ours).max(1)
        worst_diff = max(worst_diff, float(diff.max()))
        n_all += n
        agree_all += int(same.sum())
        n_ans += int(answer_pos.sum())
        agree_ans += int(same[answer_pos].sum())
        for p in np.nonzero(~same)[0]:
            worst_gap = max(worst_gap, float(gap[p]))
            if gap[p] >= a.tie:
                failures.append(f"{c['id']} position {p}: llama.cpp {top_ref[p]} by {gap[p]:.3f} "
                                f"over its second; kvtier {top_ours[p]}")
        print(f"{c['id']}: {n} positions, top-1 agreement {same.mean():.4f}, "
              f"largest logit difference {diff.max():.3f}", flush=True)

    print(f"positions {n_all} (answers {n_ans}): top-1 agreement {agree_all / n_all:.4f} "
          f"(answers {agree_ans / max(n_ans, 1):.4f}); largest logit difference {worst_diff:.3f}; "
          f"widest llama.cpp top-2 gap where they differ {worst_gap:.3f}; "
          f"llama.cpp {t_llama:.1f} s, kvtier {t_kvtier:.1f} s")
    ok = True
    arch = reader.fields["general.architecture"].contents()
    if arch == "gemma3" and first is not None:
        ids, ours, ref = first
        m = min(a.reference_positions, len(ids))
        diff = np.abs(ours[:m] - ref[:m]).max(1)
        after_window = [int(p) for p in np.linspace(513, m - 1, 3)] if m > 514 else []
        picks = sorted(set([0, m // 4, m // 2, m - 1, int(np.argmax(diff))] + after_window))
        t0 = time.time()
        want = reference_logits(reader, np.array(ids[:m]), picks)
        err_k = np.abs(want - ours[picks]).max(1)
        err_l = np.abs(want - ref[picks]).max(1)
        print(f"float64 reference at positions {picks}: kvtier within {err_k.max():.2g}, "
              f"llama.cpp within {err_l.max():.3g} ({time.time() - t0:.0f} s)")
        if err_k.max() > a.reference_tolerance:
            print(f"FAIL: kvtier's logits differ from the float64 reference by {err_k.max():.3g}")
            ok = False
    if bad_dequant:
        print(f"FAIL: dequantization differs from the gguf package's in {bad_dequant}")
        ok = False
    if bad or bad_text:
        print(f"FAIL: {len(bad)} texts tokenized differently, {len(bad_text)} answers detokenized "
              "differently")
        ok = False
    if n_all < a.positions:
        print(f"FAIL: the file has only {n_all} positions; the check needs {a.positions}")
        ok = False
    if failures:
        print(f"FAIL: {len(failures)} disagreements are not near-ties:")
        for f in failures[:10]:
            print("  " + f)
        ok = False
    if agree_all / n_all < a.agree or agree_ans / max(n_ans, 1) < a.agree_answers:
        print(f"FAIL: agreement below {a.agree} overall or {a.agree_answers} on answers")
        ok = False
    print("PASS" if ok else "FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
