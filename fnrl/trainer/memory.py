"""What the trainer process will hold, in bytes, from the model and run config alone.

Pure arithmetic over shapes (the parameter count comes from `jax.eval_shape` of the
model): no files, no devices. `fnrl.backends.memory` adds the relays and the vLLM
servers and checks the sum against the machine before any role starts.

The figures estimate a train step's peak by phase, the way XLA's buffer plan of the
step lays it out (`fnrl.trainer.peak.compiled_memory` prints that plan):
  resident   params (param_dtype), Adam's two moments (param_dtype), the frozen KL
             reference (compute_dtype) when the objective has KL, the process;
  backward   gradients (and their accumulator with micro-batches), a tied embedding's
             second gradient, the weights cast to compute_dtype when it differs, the
             activations kept for the backward pass, and the vocabulary logits;
  update     gradients and the AdamW temporaries;
  save       after a step: the Orbax copy of the state when a checkpoint is due and the
             weights converted for the relay (serving dtype).
The backward pass and the update follow each other: the step's peak is resident + the
larger. The save comes on top of that peak, not instead of it: its host copies do not
reuse what the step freed (the allocator keeps the step's buffers), as measured below.

Activations per token and layer, without remat: the norms' inputs and outputs and the
residual (4 E), q/k/v before and after RoPE (RoPE in float32), the attention output
(H·D), the MLP's I-wide tensors (`MLP_COPIES`), and, for sequences of at most one attention block
(`fnrl.models.decoder.ATTENTION_BLOCK` positions), the attention matrix: float32 scores
and softmax over all T keys. Longer sequences are attended block by block, each block
recomputed in its backward pass: no layer keeps its scores, and the scores of one block
(block × T per row and head, `ATTENTION_BLOCK_COPIES` float32 copies) exist at a time.
With remat the layers run as one scan: each layer's input is kept (E per token and
layer), one layer is recomputed at a time, and the scan holds the layers' parameters
and their gradients stacked (two copies of the layers' parameters). Logits: float32
logits and their cotangent, for every token at once or for `logprob_chunk` tokens.

Checked on the Qwen2.5-0.5B-shaped step at 8 × 1,024 tokens with chunked log-probs and
remat (fnrl.trainer.peak): XLA's buffer plan is 13.8 GB for float32 and bfloat16
compute alike (its temporaries, 7.9 GB, are the update phase's four parameter-sized
arrays); the process's measured peak (compile included) 16.6 GB for both. At the
real run's shape (4 x 1,152 tokens, bfloat16 parameters and compute, log-prob chunks of
512): XLA's plan 6.92 GB, the process's peak over two steps 9.71 GB, this plan's step
9.97 GB. The trainer role of that run (lab/benchmarks/real_model.py: step, Orbax save every
version, weights converted and handed to the relay) peaked at 12.89 GiB RSS, 0.92 GiB of
it the relay's inbox slot mapped in (shared memory the relay's plan holds): step peak +
save, where a plan of step peak or save alone would say 9.3 GiB (this plan: 13.15).
With 12 layers the role peaked at 7.70 GiB RSS, 6.96 private (this plan: 9.06).
Without remat, XLA's plan for 2 and 4 layers plus `PROCESS_BYTES` is 6 to 8 % below
this one.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from fnrl.config import AlgoConfig, LoraConfig, TrainerConfig
from fnrl.models.decoder import ATTENTION_BLOCK, DecoderConfig, abstract_model
from fnrl.models.lora import adapter_leaves
from fnrl.trainer.logprobs import positions_per_chunk
from fnrl.trainer.platform import resolve_trainer, storage_dtype

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
PROCESS_BYTES = 2**30
"""Python, JAX and XLA's CPU runtime beside the arrays..."""
PROCESS_BYTES_PER_PARAM = 4
"""...plus this much per parameter: what compiling the step leaves on the heap grows
with the model (compiling the Qwen2.5-0.5B-shaped step alone peaks at 3.45 GB RSS). A
fit, not a derivation: over the plan's arrays, a step's measured peak RSS
(fnrl.trainer.peak, first step compiling) needed 0.6 GB for 2 layers at 8 × 256 tokens
float32 (0.17 B parameters), 1.5 GB for 24 layers at 8 × 1,024 float32 and 2.6 GB at
4 × 1,152 bfloat16 (0.49 B): 1 GiB + 4 bytes a parameter covers all three."""
LOGITS_COPIES = 2
"""Float32 vocabulary-wide arrays per token alive at once in the backward pass (the
logits and their cotangent; XLA fuses the softmax into them): fitted to XLA's buffer
plan of the Qwen2.5-0.5B-shaped step, chunked and not."""
ATTENTION_F32_COPIES = 2
"""Float32 T-wide arrays per head and token a layer keeps for the backward pass (the
scores and their softmax, float32 whatever the compute dtype)."""
MLP_COPIES = 8
"""I-wide arrays per token a layer keeps for the backward pass (gate and up, the SiLU and
the terms of its derivative, the product): fitted to XLA's buffer plan of the
Qwen2.5-0.5B-shaped step without remat at 8 × 1,024 tokens, float32, 2 and 4 layers
(1.54 GB a layer)."""
ATTENTION_BLOCK_COPIES = 3
"""Float32 block × T arrays per row and head alive at once while one attention block
is recomputed and differentiated (scores, softmax and their cotangent)."""
UPDATE_COPIES = 3
"""Param-sized temporaries of the AdamW update beside the gradients (new moments and
the update, before they replace the donated state): XLA's buffer plan shows 4 × params
in the update phase."""


@functools.lru_cache(maxsize=32)
def adapter_param_count(model: DecoderConfig, lora: LoraConfig) -> int:
    """Parameters of `lora`'s adapters on `model` (0 without LoRA)."""
    if not lora.enabled:
        return 0
    return int(sum(np.prod(a) + np.prod(b) for a, b in adapter_leaves(model, lora).values()))


@functools.lru_cache(maxsize=32)
def adapted_param_count(model: DecoderConfig, lora: LoraConfig) -> int:
    """Parameters of the projections `lora` adapts (their kernels, not the adapters)."""
    return int(sum(np.prod(a[:-1]) * np.prod(b[1:])
                   for a, b in adapter_leaves(model, lora).values())) if lora.enabled else 0


@functools.lru_cache(maxsize=32)
def param_count(model: DecoderConfig) -> int:
    """Parameters of `model` (every family's biases and norms), from shapes alone."""
    _, state = abstract_model(model)
    return int(sum(np.prod(x.shape, dtype=np.int64) for x in jax.tree.leaves(state)))


Items = tuple[tuple[str, int], ...]


def _sum(items: Items) -> int:
    return sum(b for _, b in items)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainerMemory:
    """The trainer's figures in bytes, by phase: what stays, and the transients of the
    backward pass, of the optimizer update and of the save after a step. The step's peak
    is resident + the larger of backward and update; the save adds to it."""

    resident: Items
    backward: Items
    update: Items
    save: Items

    @property
    def step_peak_bytes(self) -> int:
        """The train step's peak alone, what `fnrl.trainer.peak` measures."""
        return _sum(self.resident) + max(_sum(self.backward), _sum(self.update))

    @property
    def peak_bytes(self) -> int:
        """The role's peak: the step's, and the save's host copies on top of it."""
        return self.step_peak_bytes + _sum(self.save)

    @property
    def items(self) -> Items:
        """(name, bytes) of everything, transients named by their phase."""
        return (self.resident + tuple((f"backward: {n}", b) for n, b in self.backward)
                + tuple((f"update: {n}", b) for n, b in self.update)
                + tuple((f"after step: {n}", b) for n, b in self.save))


def activation_bytes_per_token_layer(model: DecoderConfig, length: int, compute: int,
                                     attention: str = "xla") -> int:
    """Bytes one token keeps for the backward pass in one layer, without remat; the
    T-wide attention scores only for the xla kernel when the sequence is one attention
    block (the fused cudnn kernel keeps one float32 softmax statistic per head)."""
    E, I = model.hidden_size, _mlp_width(model)
    H, K, D = model.num_attention_heads, model.num_key_value_heads, model.head_dim
    linear = ((4 * E + 2 * (H + 2 * K) * D + H * D + MLP_COPIES * I) * compute
              + (H + K) * D * 4 + _routing_bytes(model, compute))
    if attention == "cudnn":
        return linear + H * 4
    if _blocked(length, attention):
        return linear
    return linear + H * length * ATTENTION_F32_COPIES * 4


def saved_dots_bytes_per_token_layer(model: DecoderConfig, compute: int) -> int:
    """Bytes one token keeps in one layer under remat "dots": the outputs of the weight
    matmuls (q/k/v, o, gate/up, down) and the attention output, in the compute dtype."""
    E, I = model.hidden_size, _mlp_width(model)
    H, K, D = model.num_attention_heads, model.num_key_value_heads, model.head_dim
    return ((H + 2 * K) * D + H * D + E + 2 * I + E) * compute + _routing_bytes(model, compute)


def _mlp_width(model: DecoderConfig) -> int:
    """The feed-forward width one token passes through: a dense MLP's intermediate size,
    or a mixture of experts' top-k experts side by side (k x moe_intermediate_size)."""
    if model.is_moe:
        return model.num_experts_per_tok * model.moe_intermediate_size
    return model.intermediate_size


def _routing_bytes(model: DecoderConfig, compute: int) -> int:
    """What a mixture of experts keeps per token beside its experts' activations: the
    router's float32 probabilities over every expert and the token's k gathered inputs
    and outputs (fnrl.models.moe.expert_ffn); 0 for a dense model. An estimate from the
    dispatch's arrays, not a measured figure."""
    if not model.is_moe:
        return 0
    return model.num_experts * 4 + 2 * model.num_experts_per_tok * model.hidden_size * compute


def _blocked(length: int, attention: str = "xla") -> bool:
    return attention == "xla" and 0 < ATTENTION_BLOCK < length


def layer_param_count(model: DecoderConfig) -> int:
    """Parameters of the decoder layers alone (what a remat scan stacks)."""
    outside = model.vocab_size * model.hidden_size * (1 if model.tie_word_embeddings else 2)
    return param_count(model) - outside - model.hidden_size   # the final norm


def trainer_memory(model: DecoderConfig, trainer: TrainerConfig, algo: AlgoConfig, *,
                   rows: int, length: int, serve_dtype: str = "float32",
                   platform: str = "cpu", device: bool = False) -> TrainerMemory:
    """The trainer's memory for steps of `rows` × `length` tokens (the whole batch; a
    micro-batch holds rows / micro_batches of them) with `serve_dtype` weights published.

    "auto" fields of `trainer` are resolved for `platform` (fnrl.trainer.platform).
    `device`: one accelerator's memory (the arrays alone, no process or host copies)
    rather than the process's host memory: parameter-sized arrays are split over the
    mesh's fsdp × tensor devices, rows over its data × fsdp ones (data -1 counts as 1:
    the plan does not know how many devices are left over)."""
    if "auto" in (trainer.compute_dtype, trainer.remat, trainer.attention):
        trainer, _ = resolve_trainer(trainer, platform=platform, model=model)
    n = param_count(model)
    p, c = DTYPE_BYTES[trainer.param_dtype], DTYPE_BYTES[trainer.compute_dtype]
    # With LoRA the optimizer, gradients, checkpoints and publishes are the adapters'
    # (t parameters); the model's n stay frozen in the base's dtype.
    lora = trainer.lora.enabled
    t = adapter_param_count(model, trainer.lora) if lora else n
    b = DTYPE_BYTES[storage_dtype(trainer)]
    s = DTYPE_BYTES[serve_dtype]
    L, E, V = model.num_hidden_layers, model.hidden_size, model.vocab_size
    rows_mb = -(-rows // trainer.micro_batches)
    tokens = rows_mb * length   # one micro-batch's
    per_layer = activation_bytes_per_token_layer(model, length, c, trainer.attention) * tokens
    if trainer.remat == "full":
        activations = L * tokens * E * c + per_layer
    elif trainer.remat == "dots":
        activations = (L * tokens * (E * c + saved_dots_bytes_per_token_layer(model, c))
                       + per_layer)
    else:
        activations = L * per_layer
    if _blocked(length, trainer.attention):   # one attention block's scores at a time
        activations += (ATTENTION_BLOCK_COPIES * rows_mb * model.num_attention_heads
                        * ATTENTION_BLOCK * length * 4)
    logit_tokens = rows_mb * positions_per_chunk(rows_mb, length, trainer.logprob_chunk)
    resident = [("params", n * p)] if not lora else [
        (f"frozen base ({storage_dtype(trainer)})", n * b), ("LoRA adapters", t * p)]
    resident.append(("Adam moments", 2 * t * p))
    if algo.needs_reference and not lora:   # with LoRA the reference is the base
        resident.append(("KL reference weights", n * c))
    grads = [("gradients", t * p)]
    if trainer.micro_batches > 1:
        grads.append(("gradient accumulator", t * p))
    backward = list(grads)
    if model.tie_word_embeddings and not lora:
        # The embedding's two gradients (lookup and projection) exist apart until summed.
        backward.append(("tied embedding's second gradient", V * E * p))
    if c != (b if lora else p):
        backward.append((f"weights in {trainer.compute_dtype}", n * c))
    kept = "all layers" if trainer.remat == "none" else (
        "remat" if trainer.remat == "full" else f"remat {trainer.remat}")
    backward.append((f"activations ({kept}, {tokens} tokens)", activations))
    if trainer.remat != "none":
        stacked = layer_param_count(model) * c
        backward.append(("layers' parameters and gradients stacked for the scan",
                         stacked + (t * c if lora else stacked)))
    backward.append((f"logits ({logit_tokens} tokens x {V})",
                     LOGITS_COPIES * logit_tokens * V * 4))
    if logit_tokens < rows_mb * length:
        # The fused chunked backward carries the vocabulary kernel's gradient in float32.
        backward.append(("vocabulary kernel's float32 gradient carry", V * E * 4))
    update = grads + [("AdamW temporaries", UPDATE_COPIES * t * p)]
    save = (("checkpoint copy of the state", 3 * t * p),
            ("adapters for the relay" if lora else "weights for the relay", t * s))
    if not device:
        resident.insert(2, ("process", PROCESS_BYTES + PROCESS_BYTES_PER_PARAM * n))
        return TrainerMemory(resident=tuple(resident), backward=tuple(backward),
                             update=tuple(update), save=save)
    mesh = trainer.mesh
    weights, rows_split = mesh.fsdp * mesh.tensor, mesh.fsdp * max(mesh.data, 1)

    def per_device(items):
        return tuple((name, -(-b // (rows_split if name.startswith(("activations", "logits"))
                                     else weights))) for name, b in items)
    return TrainerMemory(resident=per_device(resident), backward=per_device(backward),
                         update=per_device(update), save=save)


def resolve_for_device(trainer: TrainerConfig, *, platform: str, model: DecoderConfig,
                       algo: AlgoConfig, rows: int, length: int, device_bytes: int | None
                       ) -> tuple[TrainerConfig, dict[str, str]]:
    """`resolve_trainer` with this plan of the device's memory for steps of `rows` ×
    `length`, so an automatic remat is "dots" where it fits the card, else "full"."""
    def peak(tc: TrainerConfig) -> int:
        return trainer_memory(model, tc, algo, rows=rows, length=length, platform=platform,
                              device=True).step_peak_bytes
    return resolve_trainer(trainer, platform=platform, model=model, device_bytes=device_bytes,
                           peak_bytes=peak)
