"""The embedded default model: a tiny Qwen2, warm-started by a short supervised phase.

Built on first use and cached under `warm_start.cache_dir` in a directory named by a
hash of everything that shapes it, so RL starts from a policy that is sometimes right
and every later run (and the test suite) reuses it.

The supervised phase shows worked solutions of the reasoning task (fnrl.data.arith)
from an imperfect teacher, packed whole into rows of the model's length so a step
costs the same whatever the mix of short and long demonstrations.
"""

from __future__ import annotations

import dataclasses
import fcntl
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
                             save_tokenizer, solution)
from fnrl.data.tool_arith import DEMO_MODES, ToolPromptStream, tool_eval_problems
from fnrl.data.tool_arith import demonstration as tool_demonstration
from fnrl.models.decoder import DecoderConfig, forward, init_model
from fnrl.models.hf_io import save_pretrained
from fnrl.shell.files import write_atomic
from fnrl.trainer.step import TrainState, init_state, token_logprobs

_RECIPE_VERSION = 3  # bump when the recipe below changes what gets built


def model_config(model: ModelConfig, vocab_size: int, ids: dict[str, int]) -> DecoderConfig:
    """The embedded model's architecture: a Qwen2, or with `model.num_experts` a Qwen3-MoE
    (every layer sparse, top-k weights renormalised as Qwen3-MoE's released models do)."""
    moe = dict(model_type="qwen3_moe", num_experts=model.num_experts,
               num_experts_per_tok=model.num_experts_per_tok,
               moe_intermediate_size=model.moe_intermediate_size,
               norm_topk_prob=True) if model.num_experts else {}
    return DecoderConfig(
        **moe, vocab_size=vocab_size, hidden_size=model.hidden_size,
        intermediate_size=model.intermediate_size, num_hidden_layers=model.num_hidden_layers,
        num_attention_heads=model.num_attention_heads,
        num_key_value_heads=model.num_key_value_heads,
        max_position_embeddings=model.max_position_embeddings, tie_word_embeddings=True,
        bos_token_id=ids[BOS], eos_token_id=ids[EOS], pad_token_id=ids[PAD])


def default_model_dir(model: ModelConfig, task: TaskConfig, warm: WarmStartConfig) -> Path:
    # Only the synthetic task's fields shape the warm start; a dataset path does not.
    synthetic = {k: getattr(task, k) for k in ("seed", "num_eval", "min_level", "max_level")}
    tools = task.env == "tool_arith"
    # The tool task's fields enter the recipe only for it: the math model's digest (and
    # its cache) are what they were before the tool task had a warm start.
    warm_fields = {k: v for k, v in to_dict(warm).items() if k != "cache_dir"
                   and (tools or not k.startswith("tool_"))}
    # The MoE fields likewise only for a MoE model: the dense digest is unchanged.
    moe = model.num_experts > 0
    model_fields = {k: v for k, v in to_dict(model).items()
                    if moe or k not in ("num_experts", "num_experts_per_tok",
                                        "moe_intermediate_size")}
    recipe = {"v": _RECIPE_VERSION, "model": model_fields, "task": synthetic,
              "warm_start": warm_fields, **({"env": task.env} if tools else {})}
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]
    family = "qwen3moe" if moe else "qwen2"
    name = f"tiny-{family}-toolarith" if tools else f"tiny-{family}-arith"
    return Path(warm.cache_dir).expanduser() / f"{name}-{digest}"


def encode_prompt(tok, prompt: str) -> list[int]:
    return [tok.token_to_id(BOS)] + tok.encode(prompt, add_special_tokens=False).ids


def worked_solution(tok, problem) -> tuple[list[int], list[float]]:
    """The arithmetic task's worked solution and EOS, every token sampled (mask 1)."""
    ids = tok.encode(solution(problem.prompt), add_special_tokens=False).ids
    return ids + [tok.token_to_id(EOS)], [1.0] * (len(ids) + 1)


def tool_solution(tok, problem, mode: str = "tool",
                  rng: random.Random | None = None) -> tuple[list[int], list[float]]:
    """A tool-task demonstration (fnrl.data.tool_arith.demonstration) as ids and EOS,
    with mask 0 on what the environment feeds (the calculator's result)."""
    ids, mask = [], []
    for text, sampled in tool_demonstration(problem, mode, rng=rng):
        piece = tok.encode(text, add_special_tokens=False).ids
        ids += piece
        mask += [float(sampled)] * len(piece)
    return ids + [tok.token_to_id(EOS)], mask + [1.0]


def greedy_solves(argmax_fn, tok, problems, width: int, demo=worked_solution
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Whether greedy decoding would write each problem's correct solution (`demo`:
    worked arithmetic, or the tool call with its result fed): one teacher-forced pass,
    checking the argmax at every sampled response position (greedy follows the solution
    exactly when each of its sampled tokens is the argmax there). `argmax_fn` maps
    tokens 32×width to the model's argmax next tokens (`model_argmax`).

    Returns (solved, answered): `solved` includes the EOS after the answer line,
    `answered` stops at the answer's last digit (right up to the teacher's slip)."""
    pad = tok.token_to_id(PAD)
    seqs = [(encode_prompt(tok, p.prompt), *demo(tok, p)) for p in problems]
    solved, answered = [], []
    for lo in range(0, len(seqs), 32):   # 32 rows at a time: one compiled shape
        chunk = seqs[lo:lo + 32]
        input_BxT = np.full((32, width), pad, np.int32)
        fits = [len(prompt) + len(response) - 1 <= width for prompt, response, _ in chunk]
        for i, (prompt, response, _) in enumerate(chunk):
            if fits[i]:
                input_BxT[i, :len(prompt) + len(response) - 1] = (prompt + response)[:-1]
        argmax_BxT = np.asarray(argmax_fn(input_BxT))
        for i, (prompt, response, mask) in enumerate(chunk):
            # A solution longer than the model's context is one it cannot write.
            hit = (argmax_BxT[i, len(prompt) - 1:len(prompt) - 1 + len(response)] == response
                   if fits[i] else np.zeros(len(response), bool))
            hit = hit | (np.asarray(mask) == 0)   # fed tokens are not the model's to write
            solved.append(bool(hit.all()))
            answered.append(bool(hit[:-1].all()))
    return np.array(solved), np.array(answered)


def model_argmax(graphdef, params):
    """The model's greedy next token at every position, jitted once."""
    step = jax.jit(lambda params, tokens_BxT: jnp.argmax(forward(graphdef, params, tokens_BxT),
                                                         axis=-1))
    return lambda tokens_BxT: step(params, tokens_BxT)


def demonstration(prompt: str, teacher: random.Random, error_rate: float) -> str:
    """What the imperfect teacher writes: the worked solution, whose answer line has a
    stray trailing "0" at `error_rate` (fnrl.data.arith.solution)."""
    return solution(prompt, slip=teacher.random() < error_rate)


def pack_rows(sequences: list[tuple[list[int], list[int]]], rows: int, width: int, pad_id: int
              ) -> tuple[dict[str, np.ndarray], int]:
    """Packs (prompt, response[, response mask]) sequences whole, in order, into `rows` rows of `width`
    next-token positions; returns the arrays (with positions and segment ids, so a
    sequence attends only to itself) and how many sequences went in."""
    input_BxT = np.full((rows, width), pad_id, np.int32)
    target_BxT = np.full((rows, width), pad_id, np.int32)
    mask_BxT = np.zeros((rows, width), np.float32)
    positions_BxT = np.zeros((rows, width), np.int32)
    segments_BxT = np.zeros((rows, width), np.int32)   # 0: padding
    row, col, used = 0, 0, 0
    for prompt, response, *response_mask in sequences:
        seq = prompt + response
        n = len(seq) - 1   # next-token positions this sequence fills
        if n > width:
            raise ValueError(f"a demonstration of {len(seq)} tokens exceeds the model's "
                             f"{width} (model.max_position_embeddings)")
        if col + n > width:
            row, col = row + 1, 0
            if row == rows:
                break
        input_BxT[row, col:col + n] = seq[:-1]
        target_BxT[row, col:col + n] = seq[1:]
        # A response mask (tool demonstrations): fed ids are context, never targets.
        mask_BxT[row, col + len(prompt) - 1:col + n] = response_mask[0] if response_mask else 1.0
        positions_BxT[row, col:col + n] = np.arange(n)
        segments_BxT[row, col:col + n] = used + 1
        col, used = col + n, used + 1
    return {"input_BxT": input_BxT, "target_BxT": target_BxT, "mask_BxT": mask_BxT,
            "positions_BxT": positions_BxT, "segment_ids_BxT": segments_BxT}, used


def sft_packed_step(state: TrainState, batch, *, graphdef, optimizer) -> tuple[TrainState, dict]:
    """Supervised next-token step on packed rows (mean over the masked targets)."""

    def objective(params):
        logp_BxT = token_logprobs(graphdef, params, batch["input_BxT"], batch["target_BxT"],
                                  batch["positions_BxT"], batch["segment_ids_BxT"])
        mask_BxT = batch["mask_BxT"]
        return -jnp.sum(logp_BxT * mask_BxT) / jnp.maximum(mask_BxT.sum(), 1.0)

    loss, grads = jax.value_and_grad(objective)(state.params)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    return dataclasses.replace(state, step=state.step + 1, params=params,
                               opt_state=opt_state), {"loss": loss}


def build_default_model(model: ModelConfig, task: TaskConfig, warm: WarmStartConfig,
                        out_dir: Path) -> dict:
    """Initialises, fine-tunes and saves the tiny model; returns what was measured."""
    tok = build_tokenizer()
    ids = {t: tok.token_to_id(t) for t in (BOS, EOS, PAD)}
    vocab = -(-tok.get_vocab_size() // 16) * 16  # round up: friendlier shapes, same tokens
    cfg = model_config(model, vocab, ids)
    graphdef, params = init_model(cfg, model.seed)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(
        optax.warmup_cosine_decay_schedule(0.0, warm.learning_rate, max(1, warm.steps // 10),
                                           warm.steps), weight_decay=0.01))
    state = init_state(params, optimizer)
    step = jax.jit(functools.partial(sft_packed_step, graphdef=graphdef, optimizer=optimizer),
                   donate_argnums=0)
    tools = task.env == "tool_arith"
    if tools:   # the tool task's problems; SFT prompts from a stream of their own
        eval_set = tool_eval_problems(task.seed, task.num_eval)
        stream = ToolPromptStream(-1 - task.seed, held_out=frozenset(p.prompt for p in eval_set))
    else:
        eval_set = eval_problems(task.seed, task.num_eval, task.min_level, task.max_level)
        stream = PromptStream(task.seed, task.min_level, task.max_level, stream="sft",
                              held_out=frozenset(p.prompt for p in eval_set))
    modes, weights = DEMO_MODES, (warm.tool_call_rate, 1.0 - warm.tool_call_rate
                                  - warm.tool_bad_call_rate, warm.tool_bad_call_rate)
    width = model.max_position_embeddings
    t0 = time.perf_counter()
    teacher = random.Random(f"{model.seed}:teacher")
    pending: list[tuple[list[int], list[int]]] = []
    examples = skipped = 0
    for _ in tqdm(range(warm.steps), desc="warm start (SFT)", unit="step"):
        # Enough demonstrations to fill the rows; what does not fit waits for the next step.
        while sum(len(p) + len(r) for p, r, *_ in pending) < warm.batch_size * width:
            for p in stream.take(16):
                if tools:
                    mode = teacher.choices(modes, weights=weights)[0]
                    demo = (encode_prompt(tok, p.prompt), *tool_solution(tok, p, mode, teacher))
                else:
                    text = demonstration(p.prompt, teacher, warm.demo_error_rate)
                    demo = (encode_prompt(tok, p.prompt),
                            tok.encode(text, add_special_tokens=False).ids + [ids[EOS]])
                # A model shorter than the longest solution (a test's) learns the rest.
                if len(demo[0]) + len(demo[1]) - 1 <= width:
                    pending.append(demo)
                else:
                    skipped += 1
        arrays, used = pack_rows(pending, warm.batch_size, width, ids[PAD])
        pending, examples = pending[used:], examples + used
        state, metrics = step(state, arrays)
    solved, answered = greedy_solves(model_argmax(graphdef, state.params), tok, eval_set, width,
                                     tool_solution if tools else worked_solution)
    with tempfile.TemporaryDirectory() as tok_dir:
        save_tokenizer(tok, Path(tok_dir))
        save_pretrained(out_dir, cfg, jax.device_get(state.params), tokenizer_dir=tok_dir)
    info = {"sft_loss": float(metrics["loss"]), "heldout_greedy_accuracy": float(solved.mean()),
            "heldout_greedy_right_but_slip": float(answered.mean()),
            "demonstrations": examples, "too_long_skipped": skipped, "seconds": time.perf_counter() - t0,
            "params": int(sum(x.size for x in jax.tree.leaves(state.params)))}
    write_atomic(out_dir / "warm_start.json", json.dumps(info, indent=2))
    return info


def ensure_default_model(model: ModelConfig, task: TaskConfig, warm: WarmStartConfig) -> Path:
    """The cached warm-started model directory, building it if it is missing."""
    out = default_model_dir(model, task, warm)
    if (out / "warm_start.json").exists():
        return out
    # One builder per model: two jobs started together on an empty cache would otherwise
    # both build it, one replacing the directory the other is reading. The second waits
    # on the lock and then finds it built (warm_start.json is written last, atomically).
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"warm start: another job is building {out}; waiting for it", flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / "warm_start.json").exists():
            return out
        info = build_default_model(model, task, warm, out)
        print(f"warm start: {info['params']:,} parameters, held-out greedy accuracy "
              f"{100 * info['heldout_greedy_accuracy']:.1f}% ({100 * info['heldout_greedy_right_but_slip']:.1f}% "
              f"right up to the teacher's slip) after "
              f"{warm.steps} SFT steps on {info['demonstrations']:,} demonstrations "
              f"({info['seconds']:.0f}s) -> {out}")
    return out
