"""Build the tiny Llama used by the vLLM tests and benchmark (run with the
vLLM environment's python): LlamaConfig hidden 256, intermediate 512, 4
layers, 4 heads, 2 KV heads, float32 weights from a fixed seed, and an
offline WordLevel tokenizer saved as PreTrainedTokenizerFast. Nothing is
downloaded.

    .venv-vllm/bin/python tests/vllm/tiny_model.py OUT_DIR [SEED]

SEED (default 0) draws the weights: another seed, same architecture and
config (the weights update of tests/vllm/test_vllm_identity.py).
"""

from __future__ import annotations

import os
import sys

VOCAB = 1024


def build(out: str, seed: int = 0) -> str:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if os.path.exists(os.path.join(out, "config.json")) and os.path.exists(os.path.join(out, "tokenizer.json")):
        return out
    os.makedirs(out, exist_ok=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                      torch_dtype="float32")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
        # random init is nearly uniform; a wider spread gives token choices that depend on context
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.normal_(0.0, 0.08)
    model.to(torch.float32).save_pretrained(out, safe_serialization=True)
    return out


if __name__ == "__main__":
    print(build(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0))
