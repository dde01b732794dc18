"""Real keys for the kernel benchmark: the global layers' keys, values and queries of a model reading a document.

The benchmark's shapes (8 or 32 KV heads of dimension 128, up to 512K tokens) are built from these by
`engine.bench.extend`; capturing needs the model (run it where the model is, e.g. on the CPU), extending does not.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.model.load import LoadedModel
from engine.model.prefill import prefill
from kernels.backend import REFERENCE


def rope_theta(lm: LoadedModel) -> float:
    """The RoPE base of the model's global-attention layers (Gemma 3: its `full_attention` parameters)."""
    params = getattr(lm.config, "rope_parameters", None) or {}
    if "full_attention" in params:
        params = params["full_attention"]
    if params.get("rope_type", "default") != "default":
        raise ValueError(f"capture supports plain RoPE only, the model uses {params.get('rope_type')!r}")
    return float(params.get("rope_theta", getattr(lm.config, "rope_theta", 10000.0)))


def capture(lm: LoadedModel, text: str, tokens: int, queries: int) -> dict[str, torch.Tensor]:
    """Prefill the first `tokens` tokens of `text`; keep the global layers' K/V and the last `queries` queries.

    Returns keys, values [S, tokens, D] and queries [S, Hq, queries, D] (S = global layers x KV heads, float16;
    query head h of source s belongs to it when Hkv == 1, as on Gemma 3), plus `meta` = [rope_theta, tokens].
    """
    ids = lm.tokenizer(text, return_tensors="pt").input_ids[0][:tokens]
    if ids.numel() < tokens:
        raise ValueError(f"the document has {ids.numel()} tokens; {tokens} were asked for")
    if queries >= tokens:
        raise ValueError(f"queries ({queries}) must be fewer than tokens ({tokens})")
    cache, cap = prefill(lm, ids, queries, REFERENCE)
    keys, values, qs = [], [], []
    for layer_idx in lm.global_layers:
        layer = cache.layers[layer_idx]
        q = torch.cat(cap.queries[layer_idx], dim=1)  # [Hq, queries, D]
        group = q.shape[0] // layer.fixed_keys.shape[0]
        for h in range(layer.fixed_keys.shape[0]):
            keys.append(layer.fixed_keys[h])
            values.append(layer.fixed_values[h])
            qs.append(q[h * group : (h + 1) * group])
    return {
        "keys": torch.stack(keys).half().contiguous(),
        "values": torch.stack(values).half().contiguous(),
        "queries": torch.stack(qs).half().contiguous(),
        "meta": torch.tensor([rope_theta(lm), float(tokens)], dtype=torch.float64),
    }


def capture_to_file(lm: LoadedModel, document: Path, out: Path, tokens: int, queries: int) -> dict:
    from storage.documents import load_document

    tensors = capture(lm, load_document(document).text, tokens, queries)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out))
    return {"out": str(out), **{k: list(v.shape) for k, v in tensors.items()}}


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json

    from engine.model.load import load_model

    parser = argparse.ArgumentParser(prog="squeeze bench capture", description=__doc__.split("\n\n")[0])
    parser.add_argument("document", type=Path, help="a PDF, text or Markdown file (a real document)")
    parser.add_argument("--out", type=Path, required=True, help="safetensors file to write")
    parser.add_argument("--tokens", type=int, default=8192, help="context tokens to prefill")
    parser.add_argument("--queries", type=int, default=2048, help="last tokens whose queries are kept")
    parser.add_argument("--model", default=None, help="model id or path (default: the embedded Gemma 3 270M)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    lm = load_model(args.model, args.device)
    print(json.dumps(capture_to_file(lm, args.document, args.out, args.tokens, args.queries)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
