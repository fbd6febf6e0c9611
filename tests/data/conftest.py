"""Tokenizer directories built here, never downloaded: a Qwen-style byte-level BPE with its
special tokens, chat template and generation config (fnrl's character-level one is
tests/conftest.py's `char_tokenizer_dir`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fnrl.models.synthetic import ENDOFTEXT, IM_END, build_bpe_tokenizer

# Written for these tests in the shape of Qwen2.5's template: a default system turn when
# the chat has none, every turn wrapped in <|im_start|>role\n ... <|im_end|>\n, and the
# assistant's turn opened by add_generation_prompt.
QWEN_STYLE_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

SENTENCES = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many "
    "clips in May. How many clips did Natalia sell altogether in April and May?",
    "Please reason step by step, and put your final answer within \\boxed{}.",
    "You are a helpful assistant. Solve the problem: what is 12 + 30?",
    "The answer is \\frac{1}{2}, so #### 72 and 1,000 dollars.",
]


def build_qwen_style_tokenizer(out_dir: Path, *, vocab_size: int = 420) -> Path:
    """A byte-level BPE trained on a few sentences, saved as a Qwen2.5-Instruct checkpoint
    saves its tokenizer: EOS <|im_end|>, pad <|endoftext|>, no BOS, both ids as
    generation_config.json's eos_token_id (fnrl.models.synthetic.build_bpe_tokenizer)."""
    return build_bpe_tokenizer(
        out_dir, vocab_size=vocab_size, corpus=SENTENCES, eos_token=IM_END,
        chat_template=QWEN_STYLE_TEMPLATE,
        generation_config={"bos_token_id": ENDOFTEXT, "eos_token_id": [IM_END, ENDOFTEXT],
                           "pad_token_id": ENDOFTEXT, "temperature": 0.7, "top_p": 0.8})


@pytest.fixture(scope="session")
def qwen_tokenizer_dir(tmp_path_factory) -> Path:
    return build_qwen_style_tokenizer(tmp_path_factory.mktemp("qwen-tokenizer"))


@pytest.fixture(scope="session")
def synthetic_bpe_dir(tmp_path_factory) -> Path:
    """The tokenizer fnrl.models.synthetic gives its random checkpoints (EOS <|endoftext|>,
    specials after the learnt vocab), with the generation_config.json write_checkpoint
    writes beside it (eos ids [<|im_end|>, <|endoftext|>])."""
    return build_bpe_tokenizer(tmp_path_factory.mktemp("synthetic-bpe"), generation_config={
        "eos_token_id": [IM_END, ENDOFTEXT], "pad_token_id": ENDOFTEXT})
