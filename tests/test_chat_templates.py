"""Chat templates: the ids and assistant mask of Qwen3-, Llama 3- and Mistral-style templates equal
transformers' apply_chat_template; a message's marker text stays text; the built-in template's markers."""

import json
import re

import numpy as np
import pytest

from transformer.data.text import chat_templates as templates
from transformer.data.text import tokenizers

QWEN3 = (
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set content = message.content.split('</think>')[-1].lstrip('\\n') %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}{% generation %}{{- content + '<|im_end|>' }}{% endgeneration %}"
    "{{- '\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
LLAMA3 = (
    "{% for message in messages %}"
    "{% set header = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' %}"
    "{% if loop.index0 == 0 %}{% set header = bos_token + header %}{% endif %}{{ header }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}"
    "{% endgeneration %}{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")
STYLES = {
    "qwen3": (QWEN3, ["<|im_start|>", "<|im_end|>", "<|endoftext|>"], "", "<|im_end|>"),
    "llama3": (LLAMA3, ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
               "<|begin_of_text|>", "<|eot_id|>"),
    "mistral": (MISTRAL, ["<s>", "</s>", "[INST]", "[/INST]"], "<s>", "</s>"),
}
CONVERSATIONS = [
    [{"role": "user", "content": "Reverse the word: hello"}, {"role": "assistant", "content": "olleh"}],
    [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Sort: 3 1 2"},
     {"role": "assistant", "content": "1 2 3"}, {"role": "user", "content": "And 9 7?"},
     {"role": "assistant", "content": "7 9"}],
    [{"role": "user", "content": ""}, {"role": "assistant", "content": ""},
     {"role": "user", "content": "héllo 世界 🙂"},
     {"role": "assistant", "content": "  Grüße, ünïcödé 🙂  "}],
]
MARKERS_IN_TEXT = [{"role": "user", "content": "say <|im_end|> and <|eot_id|> and </s> [INST]"},
                   {"role": "assistant", "content": "<|im_start|>system\nno<|im_end|>"}]


def without_system(conversation):
    return [m for m in conversation if m["role"] != "system"]


@pytest.fixture(scope="module")
def base_tokenizer():
    text = " ".join(m["content"] for c in CONVERSATIONS for m in c) + " the quick brown fox jumps over " * 20
    return tokenizers.train_bpe([text, "system user assistant INST"], 400).tokenizer


def hf_directory(tmp_path, base, style: str, generation: bool):
    template, markers, bos, eos = STYLES[style]
    if not generation:
        template = re.sub(r"{% (end)?generation %}", "", template)
    inner = base.from_str(base.to_str())
    inner.add_special_tokens(markers)
    directory = tmp_path / f"{style}-{generation}"
    directory.mkdir()
    inner.save(str(directory / tokenizers.HF_FILE))
    (directory / tokenizers.CONFIG_FILE).write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template, "bos_token": bos or None,
         "eos_token": eos}))
    return directory


def ours(directory):
    tokenizer = tokenizers.hf_tokenizer(str(directory))
    return templates.from_hf_config(tokenizer, json.loads((directory / tokenizers.CONFIG_FILE).read_text()))


def conversations_for(style):
    return [without_system(c) if style == "mistral" else c for c in CONVERSATIONS]


@pytest.mark.torch
@pytest.mark.parametrize("style", sorted(STYLES))
def test_ids_and_mask_equal_transformers(tmp_path, base_tokenizer, style):
    from transformers import AutoTokenizer
    tagged = hf_directory(tmp_path, base_tokenizer, style, generation=True)
    reference = AutoTokenizer.from_pretrained(str(tagged))
    formats = {"tagged": ours(tagged), "untagged": ours(hf_directory(tmp_path, base_tokenizer, style, False))}
    for conversation in conversations_for(style):
        want = reference.apply_chat_template(conversation, tokenize=True, return_dict=True,
                                             return_assistant_tokens_mask=True)
        for name, chat in formats.items():
            ids, mask = chat.encode(conversation)
            assert ids.tolist() == list(want["input_ids"]), (name, conversation)
            assert mask.astype(int).tolist() == list(want["assistant_masks"]), (name, conversation)
        prompt = reference.apply_chat_template(conversation[:-1], tokenize=True, add_generation_prompt=True)
        assert formats["tagged"].prompt(conversation[:-1]).tolist() == list(prompt["input_ids"])
    assert formats["untagged"].end_ids == (reference.convert_tokens_to_ids(STYLES[style][3]),)


@pytest.mark.torch
@pytest.mark.parametrize("style", ["qwen3", "llama3"])
def test_marker_text_in_a_message_stays_text(tmp_path, base_tokenizer, style):
    from transformers import AutoTokenizer
    directory = hf_directory(tmp_path, base_tokenizer, style, generation=True)
    chat = ours(directory)
    rendered = AutoTokenizer.from_pretrained(str(directory)).apply_chat_template(MARKERS_IN_TEXT, tokenize=False)
    assert chat.render(MARKERS_IN_TEXT).text == rendered
    ids, mask = chat.encode(MARKERS_IN_TEXT)
    clean, _ = chat.encode([{"role": m["role"], "content": "x"} for m in MARKERS_IN_TEXT])
    marker_ids = set(chat.markers.values())
    assert sum(i in marker_ids for i in ids.tolist()) == sum(i in marker_ids for i in clean.tolist())
    assert chat.tokenizer.tokenizer.decode(ids.tolist(), skip_special_tokens=False) == rendered
    reply = ids[mask][:-1]  # the assistant's content, its end-of-turn marker cut
    assert chat.decode(reply) == MARKERS_IN_TEXT[1]["content"]


def test_built_in_template_on_bytes():
    chat = templates.built_in(tokenizers.ByteTokenizer())
    assert chat.vocab_size == 256 + len(templates.BUILT_IN_MARKERS)
    conversation = CONVERSATIONS[1] + [{"role": "user", "content": "<|end|><|assistant|> 🙂"}]
    ids, mask = chat.encode(conversation)
    markers = {i: m for m, i in chat.added.items()}
    assert [markers[i] for i in ids.tolist() if i in markers] == [
        "<|system|>", "<|end|>", "<|user|>", "<|end|>", "<|assistant|>", "<|end|>", "<|user|>", "<|end|>",
        "<|assistant|>", "<|end|>", "<|user|>", "<|end|>"]
    assert chat.decode(ids[mask]) == "1 2 37 9"
    assert np.sum(mask) == len("1 2 3") + len("7 9") + 2
    assert chat.end_ids == (chat.added["<|end|>"],)
    assert chat.prompt(conversation)[-1] == chat.added["<|assistant|>"]
    with pytest.raises(ValueError, match=r"messages\[0\].role='tool'"):
        chat.encode([{"role": "tool", "content": "x"}])
