"""Tiny random-weight causal LMs with the engine's byte-level tokenizer, built in memory (nothing is downloaded).

Each architecture is one the engine must serve: GQA (Llama), MHA (Qwen2) and a sliding-window hybrid
(Gemma 3: five sliding layers, then one global). `make_tiny_model` saves weights and tokenizer into a
directory, so the engine loads them through its real `--model PATH` route (`engine.model.load.load_model`).
The engine's tests get one per architecture from the `tiny_model_path` fixture (tests/engine/conftest.py).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from engine.text.byte_tokens import byte_tokenizer

ARCHS = ("llama_gqa", "qwen2_mha", "gemma3_hybrid")
SEED = 0
MAX_POSITIONS = 4096
# Saap scaled to tiny documents: its default classifier (256 buckets, hidden 128) would outweigh the K/V of a few
# hundred tokens (its weights count in every step's read), and layer 0 of these two-layer models is half the model.
SMALL_SAAP = {"saap": {"buckets": 8, "hidden": 8, "dense_first_layer": False}}
# Training for what the tests check of a learned method's mechanics, not what it learns: a few steps on short
# prompts (the defaults took ~25 s each on a tiny model).
QUICK_TRAINING = {"duo": {"train_steps": 3, "train_min_tokens": 120, "train_max_tokens": 200, "train_passkeys": 2,
                          "train_words": 3, "train_sink": 4, "train_recent": 16},
                  "saap": {"train_prompts": 2, "train_tokens": 256, "train_queries": 32, "train_kmeans_iters": 3,
                           "train_steps": 6, "train_batch": 32, "train_lr": 0.01}}
GEMMA_SLIDING_WINDOW = 32  # tokens; the test document is several windows long, so the window matters


def _config(arch: str, tokenizer: PreTrainedTokenizerFast):
    """The random-weight config of `arch`, with the tokenizer's vocabulary and special ids."""
    common = dict(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        head_dim=16,
        vocab_size=len(tokenizer),
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    if arch == "llama_gqa":
        return LlamaForCausalLM, LlamaConfig(num_hidden_layers=2, num_key_value_heads=2, **common)
    if arch == "qwen2_mha":
        return Qwen2ForCausalLM, Qwen2Config(num_hidden_layers=2, num_key_value_heads=4, **common)
    if arch == "gemma3_hybrid":
        layer_types = ["sliding_attention"] * 5 + ["full_attention"]
        return Gemma3ForCausalLM, Gemma3TextConfig(
            num_hidden_layers=len(layer_types),
            layer_types=layer_types,
            sliding_window=GEMMA_SLIDING_WINDOW,
            num_key_value_heads=1,
            **common,
        )
    raise ValueError(f"unknown tiny arch {arch!r}; choose one of {', '.join(ARCHS)}")


def gates_for(lm, methods) -> dict:
    """Untrained model-level artifacts for `methods` (Method.stand_in: DuoAttention's gates spread over [0, 1]): what
    a test of the mechanics gives a method that learns per model (tests/engine/test_duo.py trains them)."""
    from engine.methods import stand_ins

    return stand_ins(methods, lm.global_layers, lm.num_kv_heads, lm.head_dim)


# A Gemma-style chat template (the byte tokenizer spells its turn markers out byte by byte).
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>"
                 "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
                 "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def make_tiny_model(tmp_path: Path, arch: str, chat_template: str | None = None) -> Path:
    """Build a seeded random-weight `arch` model and save it with `byte_tokenizer()` (and `chat_template`, when
    given) under tmp_path/arch."""
    tokenizer = byte_tokenizer()
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    model_cls, config = _config(arch, tokenizer)
    torch.manual_seed(SEED)
    model = model_cls(config).eval()
    path = Path(tmp_path) / arch
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
