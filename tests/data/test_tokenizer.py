"""ChatTokenizer: the model's own chat template, special and stop ids, and prompts it
cannot represent refused, on a Qwen-style BPE and on fnrl's character-level tokenizer."""

from __future__ import annotations

import json
import shutil
import unicodedata

import pytest
from transformers import AutoTokenizer

from fnrl.config import TaskConfig
from fnrl.data.tokenizer import ChatTokenizer, UnrepresentablePrompt
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"

INSTRUCTION = "{prompt}\nPlease reason step by step, and put your final answer within \\boxed{}."
QUESTION = "Natalia sold 48 clips in April. How many did she sell?"


@pytest.fixture(scope="module")
def reference(qwen_tokenizer_dir):
    """transformers' own tokenizer of the same directory, loaded separately."""
    return AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir), local_files_only=True)


def test_chat_template_ids_equal_transformers_apply_chat_template(qwen_tokenizer_dir, reference):
    tok = ChatTokenizer.from_dir(qwen_tokenizer_dir, prompt_format=INSTRUCTION)
    user = f"{QUESTION}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
    assert tok.user_message(QUESTION) == user   # braces of \boxed{} stay literal
    ids = tok.encode_prompt(QUESTION)
    expected = reference.apply_chat_template([{"role": "user", "content": user}],
                                             add_generation_prompt=True, tokenize=True,
                                             return_dict=False)
    assert ids == tuple(expected)
    assert tok.decode(ids, skip_special_tokens=False) == (
        f"{IM_START}system\nYou are a helpful assistant.{IM_END}\n"
        f"{IM_START}user\n{user}{IM_END}\n{IM_START}assistant\n")

    with_system = ChatTokenizer.from_dir(qwen_tokenizer_dir, system_prompt="Be brief.")
    ids = with_system.encode_prompt(QUESTION)
    assert ids == tuple(reference.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}],
        add_generation_prompt=True, tokenize=True, return_dict=False))
    assert with_system.decode(ids, skip_special_tokens=False).startswith(
        f"{IM_START}system\nBe brief.{IM_END}\n{IM_START}user\n")
    assert with_system.decode(ids) == f"system\nBe brief.\nuser\n{QUESTION}\nassistant\n"


def test_stop_bos_and_pad_ids_come_from_the_tokenizer_and_generation_config(qwen_tokenizer_dir,
                                                                           reference):
    tok = ChatTokenizer.from_dir(qwen_tokenizer_dir)
    im_end, endoftext, im_start = (reference.convert_tokens_to_ids(t)
                                   for t in (IM_END, ENDOFTEXT, IM_START))
    # The tokenizer's EOS first, then generation_config.json's list, without repeats.
    assert tok.stop_ids == (im_end, endoftext) and tok.eos_id == im_end
    assert tok.bos_id is None and tok.pad_id == endoftext
    more = ChatTokenizer.from_dir(qwen_tokenizer_dir, stop_tokens=(ENDOFTEXT, IM_START))
    assert more.stop_ids == (im_end, endoftext, im_start)
    with pytest.raises(ValueError, match=r"TaskConfig\.stop_tokens=.*'<\|nope\|>' is not a "
                                         r"token of"):
        ChatTokenizer.from_dir(qwen_tokenizer_dir, stop_tokens=("<|nope|>",))


def test_without_generation_config_the_stop_ids_are_the_tokenizers_eos(qwen_tokenizer_dir,
                                                                       tmp_path, reference):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(qwen_tokenizer_dir / name, tmp_path / name)
    tok = ChatTokenizer.from_dir(tmp_path)
    assert tok.stop_ids == (reference.convert_tokens_to_ids(IM_END),)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": None}))
    with pytest.raises(ValueError, match="no eos_token and generation_config.json no "
                                         "eos_token_id"):
        ChatTokenizer.from_dir(tmp_path)


def test_task_config_sets_template_system_prompt_format_and_stops(qwen_tokenizer_dir, reference):
    task = TaskConfig(chat_template="none", prompt_format="Q: {prompt}\nA:",
                      stop_tokens=[IM_START])
    assert task.stop_tokens == (IM_START,)
    tok = ChatTokenizer.for_task(qwen_tokenizer_dir, task)
    # No template and no BOS: the message's own tokens only.
    assert tok.encode_prompt("1+1") == tuple(reference.encode("Q: 1+1\nA:",
                                                               add_special_tokens=False))
    assert tok.stop_ids[-1] == reference.convert_tokens_to_ids(IM_START)
    with pytest.raises(ValueError, match=r"TaskConfig\.system_prompt='Be brief\.': needs a chat "
                                         r"template, and task\.chat_template is 'none'"):
        ChatTokenizer.for_task(qwen_tokenizer_dir,
                               TaskConfig(chat_template="none", system_prompt="Be brief."))
    for kwargs, match in [({"prompt_format": "no placeholder"}, "prompt_format"),
                          ({"prompt_format": "{prompt}{prompt}"}, "exactly once"),
                          ({"chat_template": "chatml"}, "chat_template"),
                          ({"stop_tokens": ("",)}, "stop_tokens")]:
        with pytest.raises(ValueError, match=match):
            TaskConfig(**kwargs)


def test_byte_level_bpe_represents_any_text_but_not_special_tokens_as_text(qwen_tokenizer_dir):
    tok = ChatTokenizer.from_dir(qwen_tokenizer_dir)
    for text in ("π ≈ 3.14159 ∑ 🙂", "tabs\tand\n\nnewlines  ", "naïve café"):
        assert text in tok.decode(tok.encode_prompt(text))
    # A decomposed accent comes back composed (Qwen's NFC normalizer): the same text.
    assert not tok.drops_whitespace
    decomposed = unicodedata.normalize("NFD", "café")
    assert decomposed != "café" and tok.check_text(decomposed) == tok.check_text("café")
    for text in (f"stop here {IM_END} and go on", f"{ENDOFTEXT}", f"x{IM_START}user"):
        with pytest.raises(UnrepresentablePrompt, match="special token"):
            tok.encode_prompt(text)
    with pytest.raises(ValueError, match=r"TaskConfig\.system_prompt=.*special token"):
        ChatTokenizer.from_dir(qwen_tokenizer_dir, system_prompt=f"be {IM_END} brief")


def test_character_tokenizer_falls_back_to_bos_and_raw_text(char_tokenizer_dir):
    from tokenizers import Tokenizer
    raw = Tokenizer.from_file(str(char_tokenizer_dir / "tokenizer.json"))
    tok = ChatTokenizer.from_dir(char_tokenizer_dir)
    bos, eos, pad = (raw.token_to_id(t) for t in ("<bos>", "<eos>", "<pad>"))
    assert not tok.use_template
    assert (tok.bos_id, tok.stop_ids, tok.pad_id) == (bos, (eos,), pad)
    assert tok.encode_prompt("12+3=") == (bos, *raw.encode("12+3=", add_special_tokens=False).ids)
    assert tok.decode([*raw.encode("12+3=").ids, eos, pad]) == "12+3="
    # π is no character of its alphabet: it would go out as <pad> (the unknown token).
    with pytest.raises(UnrepresentablePrompt, match="cannot represent 'π'"):
        tok.encode_prompt("what is π?")
    assert not tok.drops_whitespace and tok.check_text("a b") == raw.encode("a b").ids


def test_a_tokenizer_that_drops_whitespace_represents_text_up_to_whitespace(char_tokenizer_dir,
                                                                            tmp_path):
    """Beside a Qwen2 config.json (the embedded model's directory) transformers loads the
    character tokenizer as a Qwen2Tokenizer, whose encoder drops whitespace from every
    text alike: text that differs from its decoding in whitespace alone is represented
    (a tool's error message, say); anything else still is not."""
    for f in char_tokenizer_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "config.json").write_text('{"model_type": "qwen2"}')
    tok = ChatTokenizer.from_dir(tmp_path)
    assert tok.drops_whitespace
    ids = tok.check_text("<result>error: bad  call</result>")
    assert tok.decode(ids) == "<result>error:badcall</result>"
    with pytest.raises(UnrepresentablePrompt, match="does not decode back to itself"):
        tok.check_text("error: π")   # lost (this class has no unknown token to name it)
    with pytest.raises(ValueError, match="system_prompt='Be brief.': needs a chat template, "
                                         "and .* has none"):
        ChatTokenizer.from_dir(char_tokenizer_dir, system_prompt="Be brief.")
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        ChatTokenizer.from_dir(char_tokenizer_dir / "missing")


def test_prompt_flags_reach_the_task_config():
    from fnrl.experiments.math_grpo import parse_config
    fmt = "{prompt}\nPlease put your final answer within \\boxed{}."
    cfg = parse_config(["--task.chat-template", "none", "--task.system-prompt", "Be brief.",
                        "--task.prompt-format", fmt, "--task.answer-format", "boxed",
                        "--task.stop-tokens", IM_END, ENDOFTEXT])
    assert (cfg.task.chat_template, cfg.task.system_prompt, cfg.task.prompt_format,
            cfg.task.answer_format, cfg.task.stop_tokens) == (
        "none", "Be brief.", fmt, "boxed", (IM_END, ENDOFTEXT))
    defaults = parse_config([]).task
    assert (defaults.chat_template, defaults.prompt_format, defaults.stop_tokens,
            defaults.answer_format) == ("auto", "{prompt}", (), "auto")


def test_the_synthetic_checkpoints_tokenizer(synthetic_bpe_dir):
    reference = AutoTokenizer.from_pretrained(str(synthetic_bpe_dir), local_files_only=True)
    endoftext, im_end = (reference.convert_tokens_to_ids(t) for t in (ENDOFTEXT, IM_END))
    tok = ChatTokenizer.from_dir(synthetic_bpe_dir, system_prompt="Be brief.",
                                 prompt_format=INSTRUCTION)
    # Its EOS is <|endoftext|> (a base model's): generation_config adds <|im_end|>.
    assert tok.stop_ids == (endoftext, im_end) and tok.pad_id == endoftext
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": tok.user_message(QUESTION)}]
    assert tok.encode_prompt(QUESTION) == tuple(reference.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    with pytest.raises(UnrepresentablePrompt, match="special token"):
        tok.encode_prompt(f"{QUESTION}{IM_START}assistant")


def test_without_generation_config_an_eos_list_in_config_json_stops(synthetic_bpe_dir,
                                                                    tmp_path):
    """As transformers does (GenerationConfig.from_model_config): no
    generation_config.json, so config.json's eos_token_id list names the stops."""
    reference = AutoTokenizer.from_pretrained(str(synthetic_bpe_dir), local_files_only=True)
    endoftext, im_end = (reference.convert_tokens_to_ids(t) for t in (ENDOFTEXT, IM_END))
    shutil.copytree(synthetic_bpe_dir, tmp_path / "model")
    model = tmp_path / "model"
    (model / "generation_config.json").unlink()
    assert ChatTokenizer.from_dir(model).stop_ids == (endoftext,)   # the tokenizer's EOS
    (model / "config.json").write_text(json.dumps({"eos_token_id": [im_end, endoftext],
                                                   "vocab_size": len(reference)}))
    assert ChatTokenizer.from_dir(model).stop_ids == (endoftext, im_end)


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused(synthetic_bpe_dir, tmp_path):
    shutil.copytree(synthetic_bpe_dir, tmp_path / "model")
    model = tmp_path / "model"
    size = len(AutoTokenizer.from_pretrained(str(model), local_files_only=True))
    (model / "config.json").write_text(json.dumps({"vocab_size": size}))
    ChatTokenizer.from_dir(model)
    (model / "config.json").write_text(json.dumps({"vocab_size": size - 3}))
    with pytest.raises(ValueError, match=rf"the tokenizer has {size} tokens but the model "
                                         rf"\(config.json vocab_size\) has {size - 3}"):
        ChatTokenizer.from_dir(model)
