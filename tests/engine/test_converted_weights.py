"""The embedded model's dequantized weights, checked at every load against the sha256 recorded when they were
written (engine.model.load.weights_intact): damaged or unchecked ones are converted again (CPU; the conversion is a
stand-in that saves a tiny model where the real one would save the embedded model)."""

from __future__ import annotations

import shutil

import torch

import engine.model.load as load
from tests.support.tiny_models import make_tiny_model


def test_damaged_converted_weights_are_converted_again(tmp_path, monkeypatch):
    """The dequantized embedded model's weights are checked against the sha256 recorded with them at each load: a
    flipped byte (or a conversion without a checksum) is converted again instead of loading as a model that
    answers nothing. The conversion is a stand-in here (a tiny model saved as it would save the real one)."""
    tiny = make_tiny_model(tmp_path / "tiny", "llama_gqa")
    conversions = []

    def convert(gguf, target, step):
        conversions.append(target)
        shutil.copytree(tiny, target)
        load.record_weights_checksum(target)

    monkeypatch.setattr(load, "_convert_embedded", convert)
    monkeypatch.setattr(load, "check_embedded_tokenizer", lambda tokenizer: None)
    models = tmp_path / "models"
    lm = load.load_model(None, "cpu", convert_dir=models)
    assert len(conversions) == 1 and load.weights_intact(conversions[0])
    load.load_model(None, "cpu", convert_dir=models)
    assert len(conversions) == 1  # intact: loaded as it is
    weights = conversions[0] / load.WEIGHTS_FILE
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x10
    weights.write_bytes(bytes(data))
    again = load.load_model(None, "cpu", convert_dir=models)
    assert len(conversions) == 2 and load.weights_intact(conversions[1])
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        lm.model.set_attn_implementation("sdpa")
        again.model.set_attn_implementation("sdpa")
        torch.testing.assert_close(again.model(ids).logits, lm.model(ids).logits)
    (conversions[1] / load.CHECKSUM_FILE).unlink()  # a conversion that recorded none
    load.load_model(None, "cpu", convert_dir=models)
    assert len(conversions) == 3
