#!/usr/bin/env python3
"""Export a K/V dump from a Hugging Face causal LM for `kvtier eval codecs --import`.

Needs torch and transformers (not needed by kvtier itself). Writes a .safetensors
file with
  k: [layers, kv_heads, tokens, head_dim]   post-RoPE keys of the prompt
  v: [layers, kv_heads, tokens, head_dim]
  q: [layers, q_heads, queries, head_dim]   post-RoPE queries of the next
                                            `--queries` tokens (real decode queries)
all float32. Works for Llama-family models (q_proj and rotary embeddings as in
transformers' modeling_llama); other architectures need their own hook.

  python3 scripts/export_kv_dump.py --model meta-llama/Llama-3.2-1B \
      --text-file prompt.txt --queries 16 --out dump.safetensors
  kvtier eval codecs --import dump.safetensors --csv out.csv
"""
import argparse

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="Hugging Face model id or local path")
    ap.add_argument("--text-file", required=True, help="prompt text; its tokens form the cache")
    ap.add_argument("--queries", type=int, default=16, help="decode queries captured after the cache")
    ap.add_argument("--max-tokens", type=int, default=4096, help="truncate the prompt to this many tokens")
    ap.add_argument("--out", required=True, help="output .safetensors path")
    args = ap.parse_args()

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
    model.eval()
    ids = tok(open(args.text_file).read(), return_tensors="pt").input_ids[:, : args.max_tokens + args.queries]
    if ids.shape[1] <= args.queries:
        raise SystemExit("prompt too short for the requested number of queries")
    cache_ids, query_ids = ids[:, : -args.queries], ids[:, -args.queries :]

    layers = model.model.layers
    captured = {}

    def hook(idx):
        def pre_hook(module, args_, kwargs):
            hidden = kwargs.get("hidden_states", args_[0] if args_ else None)
            cos, sin = kwargs["position_embeddings"]
            b, t, _ = hidden.shape
            hd = module.head_dim
            q = module.q_proj(hidden).view(b, t, -1, hd).transpose(1, 2)
            k = module.k_proj(hidden).view(b, t, -1, hd).transpose(1, 2)
            q, _ = apply_rotary_pos_emb(q, k, cos, sin)
            captured[idx] = q[0].detach()
        return pre_hook

    with torch.no_grad():
        out = model(cache_ids, use_cache=True)
        past = out.past_key_values
        handles = [l.self_attn.register_forward_pre_hook(hook(i), with_kwargs=True) for i, l in enumerate(layers)]
        model(query_ids, past_key_values=past, use_cache=True)
        for h in handles:
            h.remove()

    def layer_kv(i):
        if hasattr(past, "layers"):  # transformers >= 4.56
            return past.layers[i].keys, past.layers[i].values
        if hasattr(past, "key_cache"):
            return past.key_cache[i], past.value_cache[i]
        return past[i]

    n = cache_ids.shape[1]
    ks, vs = zip(*(layer_kv(i) for i in range(len(layers))))
    k = torch.stack([x[0, :, :n] for x in ks]).float().contiguous()
    v = torch.stack([x[0, :, :n] for x in vs]).float().contiguous()
    q = torch.stack([captured[i] for i in range(len(layers))]).float().contiguous()
    save_file({"k": k, "v": v, "q": q}, args.out)
    print(f"wrote {args.out}: k/v {tuple(k.shape)}, q {tuple(q.shape)}")


if __name__ == "__main__":
    main()
