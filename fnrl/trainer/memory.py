"""What the trainer process will hold, in bytes, from the model and run config alone.

Pure arithmetic over shapes (the parameter count comes from `jax.eval_shape` of the
model): no files, no devices. `fnrl.control.memory` adds the relays and the vLLM
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
The phases follow each other: the peak is resident + the largest phase.

Activations per token and layer, without remat: the norms' inputs and outputs and the
residual (4 E), q/k/v before and after RoPE (RoPE in float32), the attention output
(H·D), the MLP's four I-wide tensors, and the attention matrix: float32 scores and
softmax over all T keys (attention is not flash, so this term grows with T per token
and dominates long contexts). With remat the layer inputs are kept (E per token and
layer), one layer is recomputed at a time, and on CPU most of each layer's
activations stay anyway (`REMAT_RETAINED`). Logits: float32 logits and their
cotangent, for every token at once or for `logprob_chunk` tokens.

Against XLA's buffer plan of the Qwen2.5-0.5B-shaped step at 8 × 1,024 tokens (memory
scheduler): the plan is 4 to 29 % above it for 24 layers (float32 and bfloat16, chunked
or not, remat or not), 13 % above for 2 layers and 82 % above for 2 layers with remat.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from fnrl.config import AlgoConfig, TrainerConfig
from fnrl.models.decoder import DecoderConfig, abstract_model
from fnrl.trainer.logprobs import positions_per_chunk

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
PROCESS_BYTES = 2**30
"""Python, JAX, XLA's CPU runtime and compiler in the trainer process, beside the
arrays: the measured peak RSS of a step is XLA's buffer plan + 0.82 to 0.96 GB
(fnrl.trainer.peak, Qwen2.5-0.5B-shaped, 2 layers, 8 × 256 tokens)."""
LOGITS_COPIES = 2
"""Float32 vocabulary-wide arrays per token alive at once in the backward pass (the
logits and their cotangent; XLA fuses the softmax into them): fitted to XLA's buffer
plan of the Qwen2.5-0.5B-shaped step, chunked and not."""
ATTENTION_F32_COPIES = 2
"""Float32 T-wide arrays per head and token a layer keeps for the backward pass (the
scores and their softmax, float32 whatever the compute dtype)."""
REMAT_RETAINED = 0.7
"""Fraction of a layer's activations still held per layer with remat on XLA's CPU
backend: its memory-minimising scheduler (fnrl.trainer.xla_flags) keeps about
1.13 GB of a layer's 1.48 GB at 8 × 1,024 tokens of the Qwen2.5-0.5B shape (XLA's
buffer plan, 2 and 24 layers), float32 and bfloat16 alike."""
UPDATE_COPIES = 3
"""Param-sized temporaries of the AdamW update beside the gradients (new moments and
the update, before they replace the donated state): XLA's buffer plan shows 4 × params
in the update phase."""


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
    backward pass, of the optimizer update and of the save after a step. Phases follow
    each other, so the peak is resident + the largest phase."""

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
        return _sum(self.resident) + max(_sum(self.backward), _sum(self.update), _sum(self.save))

    @property
    def items(self) -> Items:
        """(name, bytes) of everything, transients named by their phase."""
        return (self.resident + tuple((f"backward: {n}", b) for n, b in self.backward)
                + tuple((f"update: {n}", b) for n, b in self.update)
                + tuple((f"after step: {n}", b) for n, b in self.save))


def activation_bytes_per_token_layer(model: DecoderConfig, length: int, compute: int) -> int:
    """Bytes one token keeps for the backward pass in one layer, without remat."""
    E, I = model.hidden_size, model.intermediate_size
    H, K, D = model.num_attention_heads, model.num_key_value_heads, model.head_dim
    linear = (4 * E + 2 * (H + 2 * K) * D + H * D + 4 * I) * compute + (H + K) * D * 4
    return linear + H * length * ATTENTION_F32_COPIES * 4


def trainer_memory(model: DecoderConfig, trainer: TrainerConfig, algo: AlgoConfig, *,
                   rows: int, length: int, serve_dtype: str = "float32") -> TrainerMemory:
    """The trainer's memory for steps of `rows` × `length` tokens (the whole batch; a
    micro-batch holds rows / micro_batches of them) with `serve_dtype` weights published."""
    n = param_count(model)
    p, c = DTYPE_BYTES[trainer.param_dtype], DTYPE_BYTES[trainer.compute_dtype]
    s = DTYPE_BYTES[serve_dtype]
    L, E, V = model.num_hidden_layers, model.hidden_size, model.vocab_size
    rows_mb = -(-rows // trainer.micro_batches)
    tokens = rows_mb * length   # one micro-batch's
    per_layer = activation_bytes_per_token_layer(model, length, c) * tokens
    if trainer.remat:
        activations = L * tokens * E * c + int(REMAT_RETAINED * L * per_layer) + per_layer
    else:
        activations = L * per_layer
    logit_tokens = rows_mb * positions_per_chunk(rows_mb, length, trainer.logprob_chunk)
    resident = [("params", n * p), ("Adam moments", 2 * n * p), ("process", PROCESS_BYTES)]
    if algo.needs_reference:
        resident.append(("KL reference weights", n * c))
    grads = [("gradients", n * p)]
    if trainer.micro_batches > 1:
        grads.append(("gradient accumulator", n * p))
    backward = list(grads)
    if model.tie_word_embeddings:
        # The embedding's two gradients (lookup and projection) exist apart until summed.
        backward.append(("tied embedding's second gradient", V * E * p))
    if c != p:
        backward.append((f"weights in {trainer.compute_dtype}", n * c))
    backward.append((f"activations ({'remat' if trainer.remat else 'all layers'}, "
                     f"{tokens} tokens)", activations))
    backward.append((f"logits ({logit_tokens} tokens x {V})",
                     LOGITS_COPIES * logit_tokens * V * 4))
    update = grads + [("AdamW temporaries", UPDATE_COPIES * n * p)]
    save = (("checkpoint copy of the state", 3 * n * p), ("weights for the relay", n * s))
    return TrainerMemory(resident=tuple(resident), backward=tuple(backward),
                         update=tuple(update), save=save)
