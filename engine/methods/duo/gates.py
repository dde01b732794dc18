"""DuoAttention's gates (Xiao et al., 2024, section 2.2): one gate per global layer and KV head, learned with the
model frozen, that says how much the model's output needs the head to read every key.

Each training step builds a synthetic passkey sequence (engine.methods.duo.data: real text with passkeys of words at
several depths, then a question and the answer for each). The text before the questions is the fixed context: it
is run once with full attention into a KV cache, as an ingest does. The questions and answers (the new tokens) are
then run as a batch of two over that cache: row 0 with full attention (the reference), row 1 with every global
layer's heads mixing alpha * full + (1 - alpha) * streaming attention, where a streaming head reads only the
context's first `sink` tokens, its last `recent` tokens and the new tokens (what the engine's streaming heads read;
the paper prunes its context's prefill too, which an engine that ingests with full attention never does). The loss
is the paper's: the mean squared difference of the last hidden states over the new tokens, plus `reg` times the
mean |alpha| (L1); AdamW at the paper's schedule (lr warming up from a tenth over the first fifth of the steps and
back down over the last fifth), the gates clamped to [0, 1] before every step.

Resumable: `train_gates` hands its state to `save` every `checkpoint_every` steps and continues from a state it is
given; each step's sequence is a function of (seed, step), so a resumed run ends where an uninterrupted one does.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from engine.methods.duo.data import GateData, training_sequence

GATE_ATTN = "duo_gates"  # the attention implementation of a training step (registered by `register`)
CHECKPOINT = ("gates", "exp_avg", "exp_avg_sq", "step")  # a training state's tensors


@dataclass(frozen=True)
class GateTraining:
    """How gates are trained. steps: optimizer steps (the paper: 2,000 on 8 GPUs); lr: peak learning rate (0.02);
    reg: the L1 weight lambda (0.05); sink, recent: what a streaming head reads of the context while training
    (the paper: 128 and 256); data: the synthetic sequences; seed: the sequences' and nothing else's."""

    steps: int = 150
    lr: float = 0.02
    reg: float = 0.05
    sink: int = 128
    recent: int = 256
    data: GateData = GateData()
    seed: int = 0

    def __post_init__(self) -> None:
        if self.steps < 1 or self.lr <= 0 or self.reg < 0 or self.sink < 0 or self.recent < 0:
            raise ValueError(f"gate training needs steps >= 1, lr > 0, reg >= 0, sink, recent >= 0; got {self}")

    def lr_at(self, step: int) -> float:
        """The official schedule: min(1, max((s + 1) / (N / 5), 0.1), max((N - s) / (N / 5), 0.1)) x lr."""
        ramp = max(1, self.steps // 5)
        return self.lr * min(1.0, max((step + 1) / ramp, 0.1), max((self.steps - step) / ramp, 0.1))


@dataclass
class GateMix:
    """The per-call state of the training attention (passed to the model as `duo_mix=`).

    gates: [G, Hkv] float32, G = global layers (row 1 of the batch mixes with them; row 0 is full attention)
    rows: model layer -> its row of `gates` (the global layers; the others attend as the model does)
    sink, recent: what a streaming head reads of the context (its first and last tokens)
    context_len: tokens before the new ones (the cache's length when the new tokens are run)
    """

    gates: torch.Tensor
    rows: dict[int, int]
    sink: int
    recent: int
    context_len: int


def mixed_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                    duo_mix: GateMix | None = None, **kwargs):
    """query [B, Hq, Lq, D], key/value [B, Hkv, S, D] -> ([B, Lq, Hq, D], None). Outside a global layer, or without
    `duo_mix` (the context's prefill), the model's own SDPA attention; in a global layer, batch row 0 full
    attention and row 1 each head's alpha-mix of full and streaming attention over the last Lq positions."""
    if duo_mix is None or module.layer_idx not in duo_mix.rows:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if query.shape[0] != 2:
        raise ValueError(f"a mixed step runs a batch of two (full, mixed), got {query.shape[0]}")
    lq, s = query.shape[2], key.shape[2]
    group = query.shape[1] // key.shape[1]
    # every context key precedes the new tokens: full attention is causal aligned at the bottom right; a streaming
    # head reads the gathered sink, recent and new keys (a few hundred), causal the same way. SDPA's fused kernels
    # take both (no [Lq, S] mask) and the KV heads unrepeated (enable_gqa): a 32K-token context fits an 8B model.
    full = F.scaled_dot_product_attention(query, key, value, attn_mask=causal_lower_right(lq, s), scale=scaling,
                                          enable_gqa=True)
    pos = torch.arange(s, device=query.device)
    kept = torch.nonzero((pos < duo_mix.sink) | (pos >= duo_mix.context_len - duo_mix.recent)).squeeze(1)
    stream = F.scaled_dot_product_attention(query, key[:, :, kept], value[:, :, kept],
                                            attn_mask=causal_lower_right(lq, kept.numel()), scale=scaling,
                                            enable_gqa=True)
    alpha = duo_mix.gates[duo_mix.rows[module.layer_idx]].repeat_interleave(group)  # [Hq]
    # [2, Hq, 1, 1] on the layer's device (with device_map="auto" the gates live on the first GPU, a layer maybe not)
    alpha = torch.stack([torch.ones_like(alpha), alpha])[:, :, None, None].to(query.device, query.dtype)
    out = alpha * full + (1 - alpha) * stream
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Register the training attention and its mask function (SDPA's: the model's own masks). Idempotent."""
    AttentionInterface.register(GATE_ATTN, mixed_attention)
    AttentionMaskInterface.register(GATE_ATTN, sdpa_mask)
    return GATE_ATTN


@dataclass
class StepResult:
    step: int
    loss: float
    distill: float
    gates: torch.Tensor  # [G, Hkv] after the step, on the CPU


def train_gates(lm, training: GateTraining, corpus: list[int], state: dict[str, torch.Tensor] | None = None,
                save: Callable[[dict[str, torch.Tensor]], None] | None = None, checkpoint_every: int = 10,
                progress: Callable[[StepResult], None] | None = None) -> torch.Tensor:
    """Train the gates of lm's global layers. corpus: token ids of real text (engine.text.corpus.corpus_ids) that the
    haystacks are cut from; state: a checkpoint to continue from (the tensors of CHECKPOINT, as `save` got them);
    save: gets the state every `checkpoint_every` steps and at the end; progress: after every step.
    Returns the gates [G, Hkv] float32 on the CPU, clamped to [0, 1]."""
    model = lm.model
    layers = list(lm.global_layers)
    rows = {layer: i for i, layer in enumerate(layers)}
    device = lm.device
    gates = torch.ones(len(layers), lm.num_kv_heads, device=device, dtype=torch.float32, requires_grad=True)
    optimizer = torch.optim.AdamW([gates], lr=training.lr, weight_decay=0.0)
    start = 0
    if state:
        with torch.no_grad():
            gates.copy_(state["gates"].to(device))
        optimizer.state[gates] = {"step": state["step"].float().cpu().reshape(()),
                                  "exp_avg": state["exp_avg"].to(device).clone(),
                                  "exp_avg_sq": state["exp_avg_sq"].to(device).clone()}
        start = int(state["step"])
    decoder = model.get_decoder()
    previous_attn = model.config._attn_implementation
    grads = [p.requires_grad for p in model.parameters()]
    for p in model.parameters():
        p.requires_grad_(False)
    model.set_attn_implementation(register())
    try:
        with torch.inference_mode(False), torch.enable_grad():
            for step in range(start, training.steps):
                with torch.no_grad():
                    gates.clamp_(0.0, 1.0)
                seq = training_sequence(lm.tokenizer, corpus, training.data, training.seed, step, lm.max_context)
                loss, distill = _loss(decoder, seq, gates, rows, training, device)
                for group in optimizer.param_groups:
                    group["lr"] = training.lr_at(step)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                done = step + 1
                if progress is not None:
                    progress(StepResult(done, float(loss.detach()), float(distill), gates.detach().clamp(0, 1).cpu()))
                if save is not None and (done % checkpoint_every == 0 or done == training.steps):
                    save(_state(gates, optimizer, done))
    finally:
        model.set_attn_implementation(previous_attn)
        for p, g in zip(model.parameters(), grads):
            p.requires_grad_(g)
    return gates.detach().clamp(0.0, 1.0).cpu()


def _loss(decoder, seq, gates: torch.Tensor, rows: dict[int, int], training: GateTraining,
          device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's loss (distillation + reg x mean |gate|) and its distillation term."""
    context = torch.tensor([seq.context], device=device)
    new = torch.tensor([seq.new, seq.new], device=device)
    cache = DynamicCache(config=decoder.config)
    with torch.no_grad():
        decoder(input_ids=context, past_key_values=cache, use_cache=True)
    cache.batch_repeat_interleave(2)
    n = context.shape[1]
    mix = GateMix(gates=gates, rows=rows, sink=training.sink, recent=training.recent, context_len=n)
    positions = torch.arange(n, n + new.shape[1], device=device)[None].expand(2, -1)
    hidden = decoder(input_ids=new, past_key_values=cache, use_cache=True, position_ids=positions,
                     duo_mix=mix).last_hidden_state.float()  # [2, Lnew, hidden]
    distill = (hidden[1] - hidden[0].detach()).pow(2).mean(dim=-1).mean()
    return distill + training.reg * gates.abs().mean(), distill.detach()


def _state(gates: torch.Tensor, optimizer: torch.optim.Optimizer, step: int) -> dict[str, torch.Tensor]:
    st = optimizer.state[gates]
    return {"gates": gates.detach().cpu().clone(), "exp_avg": st["exp_avg"].detach().cpu().clone(),
            "exp_avg_sq": st["exp_avg_sq"].detach().cpu().clone(), "step": torch.tensor(step, dtype=torch.int64)}


def rank_heads(gates: torch.Tensor) -> torch.Tensor:
    """gates [G, Hkv] -> [G, Hkv] int64: each head's place when all heads are sorted by gate, highest first (ties by
    layer, then head: a stable order, so that a budget always takes the same heads)."""
    flat = gates.flatten().double()
    order = torch.sort(-flat, stable=True).indices
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel())
    return rank.view(gates.shape)


def timed(progress: Callable[[int, int, str], None], steps: int) -> Callable[[StepResult], None]:
    """A `progress` for train_gates that reports (done, total, a line with the loss and the elapsed time)."""
    start = time.monotonic()

    def report(r: StepResult) -> None:
        progress(r.step, steps, f"step {r.step}/{steps}: loss {r.loss:.4f} (distill {r.distill:.4f}), "
                                f"mean gate {float(r.gates.mean()):.3f}, {time.monotonic() - start:.0f} s")
    return report
