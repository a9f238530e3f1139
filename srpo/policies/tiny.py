"""Tiny randomly initialised models with a locally built byte-level tokenizer, for tests.

The tokenizer maps every byte to one token (plus a few specials) so any text round-trips and no
vocabulary file is needed; it carries a ChatML chat template like SmolLM2's, so the same prompt
code runs on tiny and real models.
"""

from __future__ import annotations

import torch

SPECIALS = ["<|pad|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<|pad|>", eos_token="<|im_end|>", bos_token="<|im_start|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tok.chat_template = CHATML
    tok.padding_side = "left"
    return tok


def build_tiny_model(name: str, *, seed: int = 0):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    tok = byte_tokenizer()
    common = dict(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
    )
    if name == "tiny-llama":
        config = LlamaConfig(**common, tie_word_embeddings=True)
    elif name == "tiny-qwen2":
        config = Qwen2Config(**common, tie_word_embeddings=False)
    else:
        raise ValueError(f"unknown tiny model {name!r}; valid: tiny-llama, tiny-qwen2")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    return model, tok
