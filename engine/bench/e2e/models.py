"""The models the end-to-end benchmark times: random-weight shapes (SHAPES) or a real model, on one GPU or split over
several (accelerate's hooks, equal runs of layers), and their GPU memory."""

from __future__ import annotations

from dataclasses import fields

import torch

from engine.model.fused import fuse_projections
from engine.model.gemv import use_token_products
from engine.model.load import LoadedModel, layer_devices, load_model
from engine.model.token_layer import use_token_layers
from kernels.dispatch import backend_for

GiB = 1 << 30

SEED = 0

def _gemma3_layer_types(layers: int, every: int = 6) -> list[str]:
    """Gemma 3's pattern: every `every`-th layer attends globally, the others to a sliding window."""
    return ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(layers)]

# Random-weight shapes: transformers model_type + config fields. Positions reach 1M (the benchmark's contexts may
# exceed a released model's window; random weights do not care) and no token is special.
SHAPES: dict[str, dict] = {
    "llama3-8b": dict(model_type="llama", num_hidden_layers=32, hidden_size=4096, intermediate_size=14336,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                      rope_theta=500000.0, tie_word_embeddings=False),
    "qwen2.5-7b": dict(model_type="qwen2", num_hidden_layers=28, hidden_size=3584, intermediate_size=18944,
                       num_attention_heads=28, num_key_value_heads=4, head_dim=128, vocab_size=152064,
                       rope_theta=1e6, tie_word_embeddings=False),
    "gemma3-270m": dict(model_type="gemma3_text", num_hidden_layers=18, hidden_size=640, intermediate_size=2048,
                        num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=262144,
                        sliding_window=512, layer_types=_gemma3_layer_types(18), query_pre_attn_scalar=256,
                        rope_theta=1e6, tie_word_embeddings=True),
    "tiny": dict(model_type="llama", num_hidden_layers=2, hidden_size=256, intermediate_size=512,
                 num_attention_heads=8, num_key_value_heads=2, head_dim=32, vocab_size=1024, rope_theta=500000.0,
                 tie_word_embeddings=False),
}

_SHAPE_COMMON = dict(max_position_embeddings=1 << 20, bos_token_id=None, eos_token_id=None, pad_token_id=None)

class BenchModel(LoadedModel):
    """A LoadedModel whose turns never end early: a benchmark times a fixed number of steps, whatever is generated."""

    def eos_ids(self) -> set[int]:
        return set()

def model_gpus(lm: LoadedModel) -> list[torch.device]:
    """The CUDA devices holding the model's embeddings or layers, in index order."""
    devices = {torch.device(d) for d in [lm.device, *lm.layer_devices]}
    return sorted((d for d in devices if d.type == "cuda"), key=lambda d: d.index or 0)

def reset_peaks(lm: LoadedModel) -> None:
    for device in model_gpus(lm):
        torch.cuda.reset_peak_memory_stats(device)

def peak_gib(lm: LoadedModel) -> float | None:
    """Peak allocated GPU memory since reset_peaks, summed over the model's GPUs (None on the CPU)."""
    gpus = model_gpus(lm)
    return gib(sum(torch.cuda.max_memory_allocated(d) for d in gpus)) if gpus else None

def layers_per_device(lm: LoadedModel) -> dict[str, int]:
    out: dict[str, int] = {}
    for device in lm.layer_devices:
        out[str(device)] = out.get(str(device), 0) + 1
    return out

def gib(n_bytes: float) -> float:
    return round(n_bytes / GiB, 3)

def even_device_map(model: torch.nn.Module, gpus: int) -> dict[str, int]:
    """accelerate's device_map that runs the decoder layers in `gpus` equal runs, in order, on cuda:0 .. gpus-1:
    the input embeddings (and an output head tied to them) on cuda:0; the decoder's other modules (final norm,
    rotary embedding) and the output head on the last GPU."""
    decoder = model.get_decoder()
    prefix = next(name for name, module in model.named_modules() if module is decoder)
    layers = len(decoder.layers)
    if not 2 <= gpus <= layers:
        raise ValueError(f"cannot split {layers} decoder layers over {gpus} GPUs")
    last = gpus - 1
    out = {f"{prefix}.layers.{i}": i * gpus // layers for i in range(layers)}
    embedding = model.get_input_embeddings()
    for name, child in decoder.named_children():
        if name != "layers":
            out[f"{prefix}.{name}"] = 0 if child is embedding else last
    parts = prefix.split(".")  # the decoder's siblings along its path (the output head)
    for depth in range(len(parts)):
        parent = ".".join(parts[:depth])
        for name, child in model.get_submodule(parent).named_children():
            full = f"{parent}.{name}" if parent else name
            if full != ".".join(parts[: depth + 1]):
                tied = getattr(child, "weight", None) is embedding.weight
                out[full] = 0 if tied else last
    return out

def spread(model: torch.nn.Module, gpus: int) -> None:
    """Dispatch a model built on cuda:0 over cuda:0 .. cuda:gpus-1 with accelerate's hooks (as `load_model(device=
    "auto")` places a real one, but in equal runs of layers: even_device_map); each layer's inputs move to its GPU."""
    from accelerate import dispatch_model

    dispatch_model(model, even_device_map(model, gpus))

def build_shape(name: str, device: str, gpus: int = 1, token_layers: bool = True) -> BenchModel:
    """The random-weight model of SHAPES[name], built on `device` (bf16 on CUDA, fp32 on the CPU), seed SEED,
    with the engine's attention; with gpus > 1 spread over that many GPUs (spread). On one GPU its one-token
    products go to the GEMV kernel and, with token_layers, its layers end in the gated down product
    (engine.model.token_layer), as engine.model.load.load_model does. No tokenizer: its ids are random."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.attention.function import register

    fields_ = dict(SHAPES[name])
    cfg = AutoConfig.for_model(fields_.pop("model_type"), **fields_, **_SHAPE_COMMON)
    cfg._attn_implementation = register()
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(SEED)
    with torch.device(device if gpus == 1 else "cuda:0"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    fuse_projections(model)
    if gpus > 1:
        spread(model, gpus)
    elif device == "cuda":  # as engine.model.load.load_model does on one GPU
        use_token_products(model, backend_for(torch.device(device)))
        if token_layers:
            use_token_layers(model, backend_for(torch.device(device)))
    return BenchModel(model=model, tokenizer=None, model_id=f"random-{name}",
                      device=model.get_input_embeddings().weight.device, dtype=dtype,
                      layer_devices=layer_devices(model))

def open_model(shape: str | None, model: str | None, device: str, gpus: int = 1,
               token_layers: bool = True) -> BenchModel:
    """The named random-weight shape or the real model `model`, on one device or split over `gpus` GPUs; without
    token_layers, a shape's layers keep their own MLP (engine.model.token_layer; a real model's are swapped by the load
    wherever it routes the products)."""
    if model is None:
        return build_shape(shape, device, gpus, token_layers)
    lm = load_model(model, device)
    if gpus > 1:
        spread(lm.model, gpus)
        lm.layer_devices = layer_devices(lm.model)
    return BenchModel(**{f.name: getattr(lm, f.name) for f in fields(lm)})

def training_corpus(lm: LoadedModel, tokens: int) -> list[int]:
    """`tokens` ids of training text: the corpus (engine.text.corpus) through the model's tokenizer, or random ids (seed
    0) for a random-weight shape, which has none (what its training learns means nothing; its time is measured)."""
    if lm.tokenizer is None:
        g = torch.Generator().manual_seed(0)
        return torch.randint(2, lm.model.config.vocab_size, (tokens,), generator=g).tolist()
    from engine.text.corpus import corpus_ids

    return corpus_ids(lm.tokenizer, tokens)

def device_name(device: torch.device) -> str:
    """The GPU's name, or "cpu"."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
