"""Hub-free model fixtures: a Qwen-style byte-level BPE tokenizer and random checkpoints.

For tests, benchmarks and end-to-end runs on a machine without hub access:

    tok_dir = build_bpe_tokenizer(tmp / "tok")
    model_dir = write_checkpoint(tmp / "qwen3", "qwen3", seed=0, tokenizer_dir=tok_dir)
    big_dir = write_checkpoint(tmp / "0.5b", "qwen2", seed=0, dtype="bfloat16", **QWEN25_05B)
    # fnrl.data.arith's character-level tokenizer, saved by its save_tokenizer:
    tiny_dir = write_checkpoint(tmp / "tiny", "qwen2", seed=0, tokenizer_dir=char_tok_dir)

Checkpoints are written by fnrl's own init and `save_pretrained`, so they are exactly
what fnrl exports; transformers and vLLM load them (tests/models prove it).
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from collections.abc import Iterable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from fnrl.models.decoder import DecoderConfig, Llama3RopeScaling, init_model
from fnrl.models.hf_io import save_pretrained
from fnrl.shell.files import read_json_if_present

__all__ = ["CHAT_TEMPLATE", "ENDOFTEXT", "IM_END", "IM_START", "QWEN25_05B", "SMALL_SHAPES",
           "build_bpe_tokenizer", "math_corpus", "random_params", "write_checkpoint"]

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""Qwen's ChatML layout: `<|im_start|>role\\ncontent<|im_end|>\\n` per message, then
`<|im_start|>assistant\\n` when a generation prompt is asked for."""

# Words (with their leading space), single digits, punctuation runs, newlines: digits
# are split one by one, as Qwen's pre-tokenizer does, so numbers tokenise uniformly.
_SPLIT_PATTERN = (r"'(?:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

QWEN25_05B = dict(
    model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
    num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
    max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=True)
"""Qwen2.5-0.5B's architecture (its config.json), as DecoderConfig fields: pass as
`write_checkpoint(..., **QWEN25_05B)` for a random model of its real shape."""

SMALL_SHAPES = {
    # head_dim 32: vLLM's CPU attention supports 32, 64, 80, ... but not 16.
    "qwen2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                  rope_theta=1e6, tie_word_embeddings=True),
    # head_dim set apart from hidden/heads (64/4 = 16), as Qwen3 configs do.
    "qwen3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  max_position_embeddings=512, rope_theta=1e6, tie_word_embeddings=True),
    # Qwen3's shape with 8 experts, 2 per token, each a quarter of the dense MLP's width;
    # renormalised top-k and untied embeddings, as Qwen3-30B-A3B has them.
    "qwen3_moe": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      max_position_embeddings=512, rope_theta=1e6, tie_word_embeddings=False,
                      num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True),
    # A short original context, so llama3 scaling stretches, blends and keeps frequencies.
    "llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                  rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                  rope_scaling=Llama3RopeScaling(factor=8.0, low_freq_factor=1.0,
                                                 high_freq_factor=4.0,
                                                 original_max_position_embeddings=64)),
}
"""Small default shapes per family (any field can be overridden)."""

_NAMES = ("Natalia", "Weng", "Betty", "James", "Julie", "Mark", "Albert", "Ken", "Alexis", "Tina")
_ITEMS = ("clips", "apples", "books", "pencils", "cookies", "marbles", "stickers", "eggs")

_SENTENCES = (
    "You are a helpful assistant. Think step by step and give the final answer.",
    "Please reason step by step, and put your final answer within \\boxed{}.",
    "Solve the following math problem. Write the answer after ####.",
    "Let's think about this carefully. First we find the total, then we subtract.",
    "The question asks how much money she has left after paying for the tickets.",
    "Each week he saves some dollars, so after a few weeks the savings grow.",
    "A train travels at a constant speed of miles per hour for several hours.",
    "What is the remainder when the number is divided by seven? Show your work.",
    "If the price increases by ten percent, what is the new price of the shirt?",
    "There are twice as many students in the second class as in the first one.",
)


def math_corpus(n: int = 1500, seed: int = 0) -> list[str]:
    """GSM8K/MATH-style lines: word problems, worked steps, `#### 42`, `\\boxed{42}`,
    digit-by-digit additions; deterministic in `seed`."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        kind = rng.randrange(5)
        if kind == 0:
            lines.append(
                f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have?\n"
                f"{name} has {a} + {b} = {a + b} {item}.\n#### {a + b}")
        elif kind == 1:
            lines.append(
                f"A box holds {a} {item}. How many {item} are in {b} boxes?\n"
                f"There are {a} * {b} = {a * b} {item} in all. The answer is "
                f"$\\boxed{{{a * b}}}$.")
        elif kind == 2:
            x, y = rng.randint(100, 9999), rng.randint(100, 9999)
            steps, carry = [], 0
            for dx, dy in zip(reversed(str(x).zfill(4)), reversed(str(y).zfill(4))):
                s = int(dx) + int(dy) + carry
                steps.append(f"{dx} + {dy} + {carry} = {s}, write {s % 10} carry {s // 10}.")
                carry = s // 10
            lines.append(f"Compute {x} + {y} step by step.\n" + "\n".join(steps)
                         + f"\nSo {x} + {y} = {x + y}.\n#### {x + y}")
        elif kind == 3:
            lines.append(rng.choice(_SENTENCES))
        else:
            lines.append(
                f"Solve for x: {a}x = {a * b}. Dividing both sides by {a}, x = {b}. "
                f"Therefore the answer is \\boxed{{{b}}}.\n"
                f"user: what is {a} - {b}?\nassistant: {a} - {b} = {a - b}. #### {a - b}")
    return lines


def build_bpe_tokenizer(out_dir: str | os.PathLike, *, vocab_size: int = 1024,
                        corpus: Iterable[str] | None = None, eos_token: str = ENDOFTEXT,
                        chat_template: str = CHAT_TEMPLATE,
                        generation_config: dict | None = None) -> Path:
    """Trains a byte-level BPE (`tokenizers`) on `corpus` (default `math_corpus()`) and
    writes `tokenizer.json` and `tokenizer_config.json` to `out_dir`, with Qwen's special
    tokens (`<|endoftext|>` as pad, `<|im_start|>`, `<|im_end|>`) as the last three ids,
    `eos_token` as EOS (`<|endoftext|>` as in Qwen's base models, `<|im_end|>` as in its
    instruct ones) and `chat_template` (Qwen's ChatML by default). `generation_config`,
    if given, is written beside it as generation_config.json, its values naming special
    tokens by text ("eos_token_id": ["<|im_end|>", "<|endoftext|>"]) turned into their
    ids. Loads in `transformers.AutoTokenizer` and vLLM. Returns `out_dir`. The one
    builder of fnrl's BPE tokenizers: the synthetic checkpoints' and the tests'."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers import processors, trainers

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size={vocab_size}: must be at least 259 (256 bytes + 3 specials)")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    # Specials go after the learnt vocab, where Qwen keeps them.
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(list(corpus) if corpus is not None else math_corpus(),
                                  trainer=trainer)
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": eos_token,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "chat_template": chat_template,
        "model_max_length": 32768,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    if generation_config is not None:
        def ids(value):
            if isinstance(value, list):
                return [ids(v) for v in value]
            return tokenizer.token_to_id(value) if isinstance(value, str) else value
        (out_dir / "generation_config.json").write_text(json.dumps(
            {k: ids(v) for k, v in generation_config.items()}, indent=2))
    return out_dir


def _tokenizer_ids(tokenizer_dir: Path) -> tuple[dict[str, int], list[int], int]:
    """What a checkpoint takes from its tokenizer: the bos/eos/pad ids its
    tokenizer_config.json names (bos, where it names none, is the pad token: Qwen's
    configs give <|endoftext|> for it), Qwen's instruct stop ids [<|im_end|>,
    <|endoftext|>] of those it has, and its size (largest id + 1)."""
    data = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    ids = {**data["model"]["vocab"],
           **{t["content"]: t["id"] for t in data.get("added_tokens", [])}}
    named = read_json_if_present(tokenizer_dir / "tokenizer_config.json") or {}
    # A token is named by its text, or (as transformers saves some) by {"content": text}.
    text = {k: v.get("content") if isinstance(v, dict) else v for k, v in named.items()
            if k in ("bos_token", "eos_token", "pad_token")}
    roles = {"bos_token_id": text.get("bos_token") or text.get("pad_token"),
             "eos_token_id": text.get("eos_token"), "pad_token_id": text.get("pad_token")}
    config_ids = {k: ids[token] for k, token in roles.items() if token in ids}
    stop_ids = [ids[t] for t in (IM_END, ENDOFTEXT) if t in ids]
    return config_ids, stop_ids, max(ids.values()) + 1


def random_params(cfg: DecoderConfig, seed: int, *, init_std: float = 0.02,
                  perturb_std: float = 0.0, param_dtype=jnp.float32) -> dict:
    """fnrl's init with matrices drawn at `init_std` instead of 0.02 (larger makes
    next-token distributions peaked: clear greedy winners, telling log-probs) and, when
    `perturb_std` > 0, norm scales 1 + N(0, perturb_std²) and biases N(0, perturb_std²),
    so a swapped or dropped norm or bias shows in the logits."""
    _, params = init_model(cfg, seed, param_dtype=param_dtype)
    if init_std == 0.02 and perturb_std == 0.0:
        return params
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    out = []
    for (path, x), key in zip(leaves, keys):
        name = str(path[-1].key)
        if name == "scale":  # norm scales start at 1
            out.append((x + perturb_std * jax.random.normal(key, x.shape)).astype(x.dtype))
        elif name.endswith("_bias"):  # biases start at 0
            out.append((perturb_std * jax.random.normal(key, x.shape)).astype(x.dtype))
        else:
            out.append((x * (init_std / 0.02)).astype(x.dtype))
    return jax.tree.unflatten(treedef, out)


def write_checkpoint(out_dir: str | os.PathLike, family: str, *, seed: int,
                     tokenizer_dir: str | os.PathLike | None = None, dtype: str = "float32",
                     shard_bytes: int | None = None, init_std: float = 0.02,
                     perturb_std: float = 0.0, vocab_multiple: int = 64,
                     **shape_overrides) -> Path:
    """A random checkpoint of `family` (a key of `SMALL_SHAPES`: "qwen2", "qwen3",
    "llama", "qwen3_moe") in `out_dir`, complete for transformers, vLLM and fnrl's job:
    config, safetensors (in `dtype`, sharded at `shard_bytes` if given), the tokenizer
    and a generation_config.json. The one builder of fnrl's random models: the tests',
    the benchmarks' and the end-to-end runs'.

    The tokenizer is `tokenizer_dir`'s (a `build_bpe_tokenizer`, or fnrl.data.arith's
    character-level one), else a fresh `build_bpe_tokenizer`; its tokenizer_config.json
    names the config's bos, eos and pad tokens. A tokenizer with Qwen's specials gets
    generation eos ids [<|im_end|>, <|endoftext|>] as in Qwen's instruct models; any
    other the config's own.

    `shape_overrides` are DecoderConfig fields over `SMALL_SHAPES[family]`
    (`**QWEN25_05B` for the real 0.5B shape); vocab_size defaults to the tokenizer's,
    rounded up to a multiple of `vocab_multiple` (64 as Qwen pads it; fnrl's embedded
    model pads to 16). `init_std` and `perturb_std` are `random_params`'. Params are made
    in bfloat16 when `dtype` is "bfloat16", so a 0.5B model takes ~1 GB while it is written.
    """
    if family not in SMALL_SHAPES:
        raise ValueError(f"family={family!r}: not one of {sorted(SMALL_SHAPES)}")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype={dtype!r}: not float32 or bfloat16")
    if not (isinstance(vocab_multiple, int) and vocab_multiple > 0):
        raise ValueError(f"vocab_multiple={vocab_multiple!r}: must be a positive int")
    # The temporary directory holds the tokenizer built when none is given.
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_dir = Path(tokenizer_dir if tokenizer_dir is not None
                             else build_bpe_tokenizer(tmp))
        config_ids, stop_ids, tokenizer_size = _tokenizer_ids(tokenizer_dir)
        fields = {**SMALL_SHAPES[family], **config_ids, **shape_overrides, "model_type": family}
        if isinstance(fields.get("rope_scaling"), dict):
            fields["rope_scaling"] = Llama3RopeScaling(**{
                k: v for k, v in fields["rope_scaling"].items() if k not in ("rope_type", "type")})
        fields.setdefault("vocab_size", -(-tokenizer_size // vocab_multiple) * vocab_multiple)
        if fields["vocab_size"] < tokenizer_size:
            raise ValueError(f"vocab_size={fields['vocab_size']}: below the tokenizer's "
                             f"{tokenizer_size} ids")
        cfg = DecoderConfig(**fields)
        param_dtype = jnp.bfloat16 if dtype == "bfloat16" else jnp.float32
        params = random_params(cfg, seed, init_std=init_std, perturb_std=perturb_std,
                               param_dtype=param_dtype)
        generation = None  # save_pretrained writes the config's ids
        if stop_ids:
            generation = {k: v for k, v in (("bos_token_id", cfg.bos_token_id),
                                            ("eos_token_id", stop_ids),
                                            ("pad_token_id", cfg.pad_token_id)) if v is not None}
        return save_pretrained(out_dir, cfg, params, tokenizer_dir=tokenizer_dir,
                               dtype=np.dtype(param_dtype), max_shard_bytes=shard_bytes,
                               generation_config=generation)
