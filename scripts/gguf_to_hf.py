"""Writes Gemma 3 270M's GGUF file as a Hugging Face folder (bf16
safetensors, config, tokenizer) for vLLM, which does not load this GGUF.
Run by `scripts/kvtier.sh vllm-model` in the vLLM venv:

    python scripts/gguf_to_hf.py GGUF_FILE OUT_DIR

transformers dequantizes the Q4_K_M weights on load; the GGUF quantization
config is then dropped (save_pretrained refuses a quantized model it cannot
re-quantize), so the folder holds the dequantized weights in bf16: the same
numbers llama.cpp multiplies with, rounded to bf16. The tokenizer adds <bos>
as llama.cpp does.
"""

import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    gguf, out = sys.argv[1], sys.argv[2]
    folder, name = os.path.dirname(os.path.abspath(gguf)), os.path.basename(gguf)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    for holder in (model, model.config):
        if hasattr(holder, "quantization_config"):
            delattr(holder, "quantization_config")
    model.hf_quantizer = None
    # Gemma expects <bos> first, as llama.cpp adds it; the tokenizer that
    # transformers builds from the GGUF file does not, and without it the
    # model's answers degrade.
    tokenizer.add_bos_token = True
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
