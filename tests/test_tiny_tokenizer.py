"""The tiny model's tokenizer reads every character of a prompt (docs/tasks.md, "What the tiny model reads"): one
token per code point, `<unk>` in place of one outside its vocabulary, nothing dropped. transformers 5 loads any
qwen2 folder's tokenizer as Qwen2's byte-level BPE, which dropped spaces, newlines and unknown characters."""

from __future__ import annotations

import pytest

from dataplane_rl.model.load import _CHARS, build_tiny, load_tokenizer, read_tokenizer

TEXT = 'Hello #1: "quoted" \'x\' café 🙂\n\nend  two spaces\r\n'


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(build_tiny(0))


def test_every_character_is_one_token_and_unknown_ones_are_unk(tok):
    ids = tok(TEXT, add_special_tokens=False).input_ids
    assert len(ids) == len(TEXT)  # one per code point: nothing dropped, nothing fused
    expected = "".join(c if c in _CHARS else "<unk>" for c in TEXT)
    assert tok.decode(ids) == expected
    assert [i for i, c in zip(ids, TEXT) if c not in _CHARS] == [tok.unk_token_id] * sum(c not in _CHARS for c in TEXT)
    assert tok.convert_ids_to_tokens(ids[:6]) == ["<unk>", "e", "l", "l", "o", " "]


def test_text_in_the_vocabulary_round_trips_exactly(tok):
    text = "q: 12 + 30 = ?\n\na:  42.\n(ok, done!)\n"
    ids = tok(text, add_special_tokens=False).input_ids
    assert len(ids) == len(text) and tok.decode(ids) == text
    assert tok.decode([tok.bos_token_id, *ids, tok.eos_token_id], skip_special_tokens=True) == text


def test_digit_prompts_are_one_token_a_digit_in_a_vocabulary_the_model_matches(tok):
    # the default task's prompts: what its pinned figures (README) were measured on
    vocab = tok.get_vocab()
    assert tok("407", add_special_tokens=False).input_ids == [vocab["4"], vocab["0"], vocab["7"]]
    from transformers import AutoConfig

    assert len(tok) == len(vocab) == AutoConfig.from_pretrained(build_tiny(0)).vocab_size == 53
    assert tok.pad_token_id == tok.unk_token_id == 0


def test_a_saved_copy_reads_the_same(tok, tmp_path):
    # what `dataplane-rl export` writes next to the weights
    read_tokenizer(build_tiny(0)).save_pretrained(tmp_path)
    copy = load_tokenizer(tmp_path)
    assert copy(TEXT).input_ids == tok(TEXT).input_ids and copy.decode(copy(TEXT).input_ids) == tok.decode(tok(TEXT).input_ids)


def test_the_chat_template_reaches_the_model_whole(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "what is 2+2?"}], add_generation_prompt=True,
                                   tokenize=False)
    assert text == "<bos>user: what is 2+2?\nassistant: "  # the template writes BOS, as Llama's do
    ids = tok(text, add_special_tokens=False).input_ids
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1  # "<bos>" is the token, not 5 characters
    assert tok.decode(ids) == text


def test_the_tokenizer_itself_adds_bos_to_a_text(tok):
    # a text prompt is tokenizer(text): BOS comes from the tokenizer (tasks/prompts.py encode_prompt), never added
    # again by the prompt encoder, so a real tokenizer that adds none gets none
    from dataplane_rl.tasks.prompts import encode_prompt

    assert tok("ab").input_ids == [tok.bos_token_id] + tok("ab", add_special_tokens=False).input_ids
    assert encode_prompt(tok, "ab") == tok("ab").input_ids
    chat = tok.apply_chat_template([{"role": "user", "content": "ab"}], add_generation_prompt=True, tokenize=False)
    assert encode_prompt(tok, chat, chat=True).count(tok.bos_token_id) == 1
