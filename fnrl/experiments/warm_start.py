"""The embedded default model: a tiny Qwen2, warm-started by a short supervised phase.

Built on first use and cached under `warm_start.cache_dir` in a directory named by a
hash of everything that shapes it, so RL starts from a policy that is sometimes right
and every later run (and the test suite) reuses it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

from fnrl.config import ModelConfig, TaskConfig, WarmStartConfig, to_dict
from fnrl.data.arith import (BOS, EOS, PAD, PromptStream, build_tokenizer, eval_problems,
                             save_tokenizer)
from fnrl.data.reward import math_reward
from fnrl.models.hf_io import save_pretrained
from fnrl.models.decoder import DecoderConfig, forward, init_model
from fnrl.trainer.step import init_state, pack_sequences, sft_step

_RECIPE_VERSION = 2  # bump when the recipe below changes what gets built


def model_config(model: ModelConfig, vocab_size: int, ids: dict[str, int]) -> DecoderConfig:
    return DecoderConfig(
        vocab_size=vocab_size, hidden_size=model.hidden_size,
        intermediate_size=model.intermediate_size, num_hidden_layers=model.num_hidden_layers,
        num_attention_heads=model.num_attention_heads,
        num_key_value_heads=model.num_key_value_heads,
        max_position_embeddings=model.max_position_embeddings, tie_word_embeddings=True,
        bos_token_id=ids[BOS], eos_token_id=ids[EOS], pad_token_id=ids[PAD])


def default_model_dir(model: ModelConfig, task: TaskConfig, warm: WarmStartConfig) -> Path:
    # Only the synthetic task's fields shape the warm start; a dataset path does not.
    synthetic = {k: getattr(task, k) for k in ("seed", "num_eval", "min_level", "max_level")}
    recipe = {"v": _RECIPE_VERSION, "model": to_dict(model), "task": synthetic,
              "warm_start": {k: v for k, v in to_dict(warm).items() if k != "cache_dir"}}
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]
    return Path(warm.cache_dir).expanduser() / f"tiny-qwen2-math-{digest}"


def encode_prompt(tok, prompt: str) -> list[int]:
    return [tok.token_to_id(BOS)] + tok.encode(prompt, add_special_tokens=False).ids


def greedy_accuracy(graphdef, params, tok, problems, max_new_tokens: int) -> float:
    """Greedy decoding in JAX without a KV cache: fine for a tiny model and short answers."""
    eos, pad = tok.token_to_id(EOS), tok.token_to_id(PAD)
    prompts = [encode_prompt(tok, p.prompt) for p in problems]
    width = max(map(len, prompts)) + max_new_tokens
    tokens = np.full((len(prompts), width), pad, np.int32)
    lens = np.array([len(p) for p in prompts])
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    step = jax.jit(lambda params, toks: jnp.argmax(forward(graphdef, params, toks), axis=-1))
    done = np.zeros(len(prompts), bool)
    for k in range(max_new_tokens):
        nxt = np.asarray(step(params, jnp.asarray(tokens)))[np.arange(len(prompts)), lens + k - 1]
        nxt = np.where(done, pad, nxt)
        tokens[np.arange(len(prompts)), lens + k] = nxt
        done |= nxt == eos
    correct = []
    for i, p in enumerate(problems):
        gen = tokens[i, lens[i]:]
        gen = gen[: np.argmax(gen == eos)] if (gen == eos).any() else gen
        out = [int(t) for t in gen if t != pad]
        correct.append(math_reward(tok.decode(out), p.answer))
    return float(np.mean(correct))


def demonstration(answer: str, teacher: random.Random, error_rate: float) -> str:
    """What the imperfect teacher writes: the answer, with a stray "0" at `error_rate`."""
    return answer + "0" if teacher.random() < error_rate else answer


def build_default_model(model: ModelConfig, task: TaskConfig, warm: WarmStartConfig,
                        out_dir: Path) -> dict:
    """Initialises, fine-tunes and saves the tiny model; returns what was measured."""
    tok = build_tokenizer()
    ids = {t: tok.token_to_id(t) for t in (BOS, EOS, PAD)}
    vocab = -(-tok.get_vocab_size() // 16) * 16  # round up: friendlier shapes, same tokens
    cfg = model_config(model, vocab, ids)
    graphdef, params = init_model(cfg, model.seed)
    optimizer = optax.adamw(optax.warmup_cosine_decay_schedule(
        0.0, warm.learning_rate, max(1, warm.steps // 10), warm.steps), weight_decay=0.01)
    state = init_state(params, optimizer)
    step = jax.jit(functools.partial(sft_step, graphdef=graphdef, optimizer=optimizer),
                   donate_argnums=0)
    eval_set = eval_problems(task.seed, task.num_eval, task.min_level, task.max_level)
    stream = PromptStream(task.seed, task.min_level, task.max_level, stream="sft",
                          held_out=frozenset(p.prompt for p in eval_set))
    seq_len = model.max_position_embeddings
    t0 = time.perf_counter()
    teacher = random.Random(f"{model.seed}:teacher")
    for _ in tqdm(range(warm.steps), desc="warm start (SFT)", unit="step"):
        batch = stream.take(warm.batch_size)
        prompts = [tuple(encode_prompt(tok, p.prompt)) for p in batch]
        answers = [tuple(tok.encode(demonstration(p.answer, teacher, warm.demo_error_rate),
                                    add_special_tokens=False).ids) + (ids[EOS],) for p in batch]
        # Pad to a multiple of 8, not the model's maximum: few shapes, little padding.
        longest = max(len(p) + len(a) for p, a in zip(prompts, answers)) - 1
        width = min(seq_len, -(-longest // 8) * 8)
        state, metrics = step(state, pack_sequences(prompts, answers, width, ids[PAD]))
    accuracy = greedy_accuracy(graphdef, state.params, tok, eval_set, max_new_tokens=6)
    with tempfile.TemporaryDirectory() as tok_dir:
        save_tokenizer(tok, Path(tok_dir))
        save_pretrained(out_dir, cfg, jax.device_get(state.params), tokenizer_dir=tok_dir)
    info = {"sft_loss": float(metrics["loss"]), "heldout_greedy_accuracy": accuracy,
            "seconds": time.perf_counter() - t0, "params": int(sum(
                x.size for x in jax.tree.leaves(state.params)))}
    (out_dir / "warm_start.json").write_text(json.dumps(info, indent=2))
    return info


def ensure_default_model(model: ModelConfig, task: TaskConfig, warm: WarmStartConfig) -> Path:
    """The cached warm-started model directory, building it if it is missing."""
    out = default_model_dir(model, task, warm)
    if not (out / "warm_start.json").exists():
        info = build_default_model(model, task, warm, out)
        print(f"warm start: {info['params']:,} parameters, held-out greedy accuracy "
              f"{100 * info['heldout_greedy_accuracy']:.1f}% after {warm.steps} SFT steps "
              f"({info['seconds']:.0f}s) -> {out}")
    return out
