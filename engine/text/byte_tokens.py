"""A byte-level tokenizer built in memory: one token per UTF-8 byte, for models that come without one (random-weight
shapes in the benchmarks, the tests' tiny models): their text goes through the engine's real paths (ingest, prompts,
answers) with nothing downloaded."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

BOS, EOS = "<bos>", "<eos>"
SIZE = 258  # 256 bytes, then <bos> and <eos>


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE with no merges: one token per UTF-8 byte, plus <bos> and <eos> (ids 256 and 257).

    unk and pad are <eos> (as in Qwen's own tokenizers; every byte has a token, so unk never occurs):
    transformers 5 loads a saved qwen2 tokenizer as Qwen2Tokenizer, which would otherwise add an
    "<|endoftext|>" token (id 258) past the model's vocabulary.
    """
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # the 256 printable stand-ins for the bytes
    vocab = {symbol: i for i, symbol in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BOS, EOS])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, unk_token=EOS, pad_token=EOS)
