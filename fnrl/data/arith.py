"""A synthetic, verifiable arithmetic task with graded difficulty.

Problems are symbol expressions over three digits ("2+3+5=", "6*7-9=") with integer
answers of one to two characters (three with a sign). Levels differ in their
operators, so a tiny model finds some easy and some hard: the spread GRPO learns from.

The tokenizer is character level, built with `tokenizers`, and saved as a
`tokenizer.json` that both fnrl and vLLM load.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from fnrl.types import Problem

PAD, EOS, BOS = "<pad>", "<eos>", "<bos>"
SPECIAL = (PAD, EOS, BOS)
ALPHABET = "0123456789+-*=()"


def build_tokenizer() -> Tokenizer:
    """Character-level tokenizer: one id per character, special tokens first."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL + tuple(ALPHABET))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    # Fuse joins characters back without inserted spaces, so decode(encode(s)) == s.
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL))
    return tok


def save_tokenizer(tok: Tokenizer, out_dir: Path) -> None:
    """Writes tokenizer.json plus the HF side files that vLLM/transformers expect."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": PAD}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096,
         "clean_up_tokenization_spaces": False, **special}, indent=2))
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2))


# Every level combines three digits 0-9 in its own surface form, so a held-out prompt is a
# new string built from single-digit facts that training does show: generalisation a
# small model can reach, unlike held-out multi-digit facts (a lookup it never saw).
_LEVEL_FORMS = {1: "{a}+{b}+{c}", 2: "{a}+{b}-{c}", 3: "{a}-{b}+{c}", 4: "{a}*{b}+{c}",
                5: "{a}*{b}-{c}"}


def _expression(rng: random.Random, level: int) -> tuple[str, int]:
    a, b, c = rng.randint(0, 9), rng.randint(0, 9), rng.randint(0, 9)
    text = _LEVEL_FORMS[level].format(a=a, b=b, c=c)
    return text, eval(text)  # noqa: S307 - our own digits and operators only


def make_problem(rng: random.Random, level: int, uid: str) -> Problem:
    """One problem of the given level (1 = a+b+c ... 5 = a*b-c)."""
    expr, value = _expression(rng, level)
    return Problem(uid=uid, prompt=f"{expr}=", answer=str(value), level=level)


# The eval split is a prefix of a fixed pool, so changing num_eval never changes its items.
_EVAL_POOL = 1024


def eval_problems(seed: int, count: int, min_level: int, max_level: int) -> list[Problem]:
    """The held-out split: a reproducible list, cycling through the levels."""
    if not 0 < count <= _EVAL_POOL:
        raise ValueError(f"num_eval={count} must be in 1..{_EVAL_POOL}")
    rng = random.Random(f"{seed}:eval")
    span = max_level - min_level + 1
    return [make_problem(rng, min_level + i % span, uid=f"eval-{i}") for i in range(_EVAL_POOL)][:count]


class PromptStream:
    """An endless, seeded stream of training problems with a resumable cursor."""

    def __init__(self, seed: int, min_level: int, max_level: int, *, held_out: frozenset[str],
                 cursor: int = 0, stream: str = "train"):
        self._seed, self._levels, self._stream = seed, (min_level, max_level), stream
        # Eval prompts are never trained on, so held-out accuracy means what it says.
        self._held_out = held_out
        self.cursor = cursor

    def take(self, n: int) -> list[Problem]:
        out = []
        while len(out) < n:
            # One RNG per cursor position makes the stream random-access (resume = set cursor).
            rng = random.Random(f"{self._seed}:{self._stream}:{self.cursor}")
            lo, hi = self._levels
            p = make_problem(rng, lo + self.cursor % (hi - lo + 1), uid=f"{self._stream}-{self.cursor}")
            self.cursor += 1
            if p.prompt not in self._held_out:
                out.append(p)
        return out

    def skip(self, n: int) -> None:
        """Moves on as if `take(n)` had been called (a restarted controller catching up)."""
        self.take(n)
