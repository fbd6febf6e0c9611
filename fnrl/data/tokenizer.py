"""The model's own tokenizer, as users expect it: chat template, special and stop tokens.

`ChatTokenizer.from_dir(model_dir, ...)` reads the files a Hugging Face checkpoint ships,
from local disk only: `tokenizer.json`, `tokenizer_config.json` (its special tokens and
`chat_template`, or a `chat_template.jinja` beside it) and `generation_config.json`.
transformers' AutoTokenizer reads them, so the template is rendered exactly as
`apply_chat_template` renders it for the same model elsewhere (vLLM included).

A prompt becomes a user message, `task.prompt_format` with the row's prompt in place of
"{prompt}", after `task.system_prompt` as the system message when one is set; the chat
template renders both with the assistant's turn opened (add_generation_prompt). A
tokenizer without a template (fnrl's embedded character-level one) gives BOS, when it
has one, followed by the message's own tokens; `task.chat_template="none"` asks for that
with any tokenizer.

A prompt the tokenizer cannot represent raises `UnrepresentablePrompt` instead of going
out silently changed: a character that becomes the unknown token, text that does not
decode back to itself, or the text of a special token ("<|im_end|>") inside the prompt.
The dataset reader makes that a bad row.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from fnrl.config.run import TaskConfig
from fnrl.shell.files import read_json_if_present


class UnrepresentablePrompt(ValueError):
    """A prompt the tokenizer would not encode faithfully."""


def _generation_config(model_dir: Path, model: dict) -> dict:
    """generation_config.json, or what transformers derives without one from the model's
    config.json (`model`): its eos/bos/pad ids (GenerationConfig.from_model_config), so an
    eos list there stops generation as it does in transformers."""
    gen = read_json_if_present(model_dir / "generation_config.json")
    if gen is not None:
        return gen
    return {k: model[k] for k in ("eos_token_id", "bos_token_id", "pad_token_id")
            if model.get(k) is not None}


def check_ids_in_vocab(hf: Any, ids: dict[str, Sequence[int]], model_dir: Path,
                       model: dict) -> None:
    """ValueError before anything starts when the tokenizer can produce ids the model
    has no embedding row for (its size above config.json's vocab_size), or a special or
    stop id is out of range: vLLM would refuse the first request, and JAX's gather would
    clamp the id to another token's row without a word. `model`: config.json's fields."""
    vocab = model.get("vocab_size")
    if vocab is None:
        return
    size = len(hf)
    if size > vocab:
        raise ValueError(f"{model_dir}: the tokenizer has {size} tokens but the model "
                         f"(config.json vocab_size) has {vocab} embedding rows; ids "
                         f"{vocab}..{size - 1} have no row. Use the model's own tokenizer")
    for what, values in ids.items():
        bad = sorted(i for i in values if i is not None and not 0 <= int(i) < vocab)
        if bad:
            raise ValueError(f"{model_dir}: {what} id(s) {bad} are outside the model's "
                             f"vocabulary of {vocab} (config.json vocab_size)")


def _ids(value: Any) -> list[int]:
    """generation_config's eos_token_id: absent, one id, or a list of them."""
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _dedupe(ids: Sequence[int]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(ids))


@dataclass(frozen=True, kw_only=True, eq=False)
class ChatTokenizer:
    """Prompts to ids with the model's chat template, ids to text, and the ids that
    matter around generation. Build it with `from_dir` or `for_task`."""

    hf: Any
    """The transformers tokenizer (PreTrainedTokenizerFast or its v5 equivalent)."""
    bos_id: int | None
    pad_id: int
    stop_ids: tuple[int, ...]
    """Generation ends at any of these: the tokenizer's EOS, generation_config.json's
    eos ids and task.stop_tokens, in that order."""
    use_template: bool
    system_prompt: str = ""
    prompt_format: str = "{prompt}"

    @classmethod
    def from_dir(cls, model_dir: str | Path, *, chat_template: str = "auto",
                 system_prompt: str = "", prompt_format: str = "{prompt}",
                 stop_tokens: Sequence[str] = ()) -> ChatTokenizer:
        """The tokenizer of a local model directory (no hub: local files only)."""
        # Imported here: transformers takes seconds to import, and only the processes
        # that tokenize need it.
        from transformers import AutoTokenizer

        model_dir = Path(model_dir).expanduser()
        if not (model_dir / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{model_dir} has no tokenizer.json")
        hf = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True,
                                           trust_remote_code=False)
        model = read_json_if_present(model_dir / "config.json") or {}
        gen = _generation_config(model_dir, model)
        stops = ([hf.eos_token_id] if hf.eos_token_id is not None else []) \
            + _ids(gen.get("eos_token_id"))
        for name in stop_tokens:
            tid = hf.convert_tokens_to_ids(name)
            if tid is None or hf.convert_ids_to_tokens(tid) != name:
                raise ValueError(f"invalid config TaskConfig.stop_tokens={tuple(stop_tokens)!r}: "
                                 f"{name!r} is not a token of {model_dir / 'tokenizer.json'}")
            stops.append(tid)
        if not stops:
            raise ValueError(f"{model_dir}: the tokenizer has no eos_token and "
                             "generation_config.json no eos_token_id; name the stop tokens "
                             "with --task.stop-tokens")
        stop_ids = _dedupe(stops)
        pad = hf.pad_token_id if hf.pad_token_id is not None else gen.get("pad_token_id")
        check_ids_in_vocab(hf, {"stop": stop_ids, "special": sorted(hf.all_special_ids),
                                "pad": [pad], "bos": [hf.bos_token_id]}, model_dir, model)
        use_template = chat_template == "auto" and bool(getattr(hf, "chat_template", None))
        if system_prompt and not use_template:
            raise ValueError(f"invalid config TaskConfig.system_prompt={system_prompt!r}: "
                             "needs a chat template, and "
                             + ("task.chat_template is 'none'" if chat_template == "none"
                                else f"{model_dir} has none"))
        tok = cls(hf=hf, bos_id=hf.bos_token_id, pad_id=int(pad if pad is not None else
                                                              stop_ids[0]),
                  stop_ids=stop_ids, use_template=use_template, system_prompt=system_prompt,
                  prompt_format=prompt_format)
        if system_prompt:
            try:
                tok.check_text(system_prompt)
            except UnrepresentablePrompt as err:
                raise ValueError(f"invalid config TaskConfig.system_prompt="
                                 f"{system_prompt!r}: {err}") from None
        return tok

    @classmethod
    def for_task(cls, model_dir: str | Path, task: TaskConfig) -> ChatTokenizer:
        """`from_dir` with the task config's template, system prompt, format and stops."""
        return cls.from_dir(model_dir, chat_template=task.chat_template,
                            system_prompt=task.system_prompt, prompt_format=task.prompt_format,
                            stop_tokens=task.stop_tokens)

    @property
    def eos_id(self) -> int:
        """The first stop id: the tokenizer's own EOS when it has one."""
        return self.stop_ids[0]

    def special_ids(self) -> frozenset[int]:
        """Ids of every special token (named ones and added tokens marked special)."""
        added = getattr(self.hf, "added_tokens_decoder", {}) or {}
        return frozenset(self.hf.all_special_ids) | {i for i, t in added.items()
                                                     if getattr(t, "special", False)}

    def check_text(self, text: str) -> list[int]:
        """The ids of `text` alone (no special tokens added), or UnrepresentablePrompt."""
        ids = self.hf.encode(text, add_special_tokens=False)
        unk = self.hf.unk_token_id
        if unk is not None and unk in ids:
            # Some tokenizers' unknown token is also a real one (Qwen's <|endoftext|>):
            # only characters that become it alone are lost.
            lost = sorted({c for c in text if unk in self.hf.encode(c, add_special_tokens=False)})
            if lost:
                raise UnrepresentablePrompt(f"the tokenizer cannot represent {''.join(lost)!r} "
                                            f"(it becomes {self.hf.unk_token!r})")
        special = sorted(set(ids) & self.special_ids())
        if special:
            names = [self.hf.convert_ids_to_tokens(i) for i in special]
            raise UnrepresentablePrompt(f"contains the special token(s) {names} as text")
        back = self.hf.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        # Canonically equivalent text (a normalizer's NFC, as Qwen's has) is the same text,
        # and so is text that differs in whitespace alone for a tokenizer that drops all
        # of it (the embedded character-level one: its model never sees whitespace).
        nfc = unicodedata.normalize
        if back != text and nfc("NFC", back) != nfc("NFC", text) and not (
                self.drops_whitespace and _squeezed(back) == _squeezed(text)):
            raise UnrepresentablePrompt(f"does not decode back to itself (got {back[:60]!r})")
        return ids

    @functools.cached_property
    def drops_whitespace(self) -> bool:
        """Whether the tokenizer's encoder drops whitespace (every text loses it alike)."""
        probe = "a b\tc\nd"
        ids = self.hf.encode(probe, add_special_tokens=False)
        return self.hf.decode(ids, clean_up_tokenization_spaces=False) == "abcd"

    def user_message(self, prompt: str) -> str:
        """The user turn: prompt_format with the prompt in place of "{prompt}"."""
        # Plain substitution, not str.format: "\boxed{}" in the format stays literal.
        return self.prompt_format.replace("{prompt}", prompt, 1)

    def encode_prompt(self, prompt: str) -> tuple[int, ...]:
        """The ids the model is prompted with (UnrepresentablePrompt if it cannot be)."""
        content = self.user_message(prompt)
        ids = self.check_text(content)
        if not self.use_template:
            return tuple(([self.bos_id] if self.bos_id is not None else []) + ids)
        messages = ([{"role": "system", "content": self.system_prompt}]
                    if self.system_prompt else []) + [{"role": "user", "content": content}]
        return tuple(self.hf.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=True, return_dict=False))

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """The text of `ids` (special tokens left out unless asked for)."""
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens,
                              clean_up_tokenization_spaces=False)


def _squeezed(text: str) -> str:
    return re.sub(r"\s+", "", text)
