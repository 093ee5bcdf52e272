"""Tests for jaxserve.tokenizer: loading and streaming detokenization.

The tokenizers are tiny ones built here; the reference for what a user must
see is the Hugging Face decode of the prompt and output together, minus the
decode of the prompt (see the module docstring of jaxserve.tokenizer).
"""

import functools
import json

import pytest
from hypothesis import given, settings, strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

from jaxserve.engine.llm_engine import default_model_path
from jaxserve.tokenizer import IncrementalDetokenizer, load_chat_template, load_tokenizer, render_chat_text

REPLACEMENT = "\ufffd"
SPECIALS = ["<unk>", "<s>", "</s>"]
CORPUS = [
    "héllo wörld ✓ 日本語 emoji 🙂",
    "hello world the quick brown fox, jumps over the lazy dog",
    "naïve café ✓✓ 日本 語 🙂🙂 wörld",
] * 4
# Characters for random texts; the byte-fallback tokenizer, trained on ASCII only,
# spells the others in <0xNN> byte tokens.
TEXT_ALPHABET = "abhelowrd ,éö✓日本語🙂🙃\n"


def _wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    """Wrap a `tokenizers` object the way a loaded checkpoint tokenizer is."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        clean_up_tokenization_spaces=False,
    )


def _train_bpe(tok: Tokenizer, corpus: list[str], vocab_size: int, **trainer_kwargs) -> Tokenizer:
    """Train `tok`'s BPE model in place on `corpus`."""
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False, **trainer_kwargs
    )
    tok.train_from_iterator(corpus, trainer)
    return tok


@functools.cache
def byte_level() -> PreTrainedTokenizerFast:
    """GPT-2 style byte-level BPE, plus a non-special added token."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    _train_bpe(tok, CORPUS, 320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.add_tokens(["<tool>"])
    return _wrap(tok)


@functools.cache
def metaspace() -> PreTrainedTokenizerFast:
    """SentencePiece-style BPE: Metaspace pre-tokenizer and decoder, no bytes."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    return _wrap(_train_bpe(tok, CORPUS, 150))


@functools.cache
def byte_fallback() -> PreTrainedTokenizerFast:
    """Llama-2 style: "▁" pieces, <0xNN> byte-fallback tokens, Strip decoder."""
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    _train_bpe(trained, [text for text in CORPUS if text.isascii()], 160)
    model = json.loads(trained.to_str())["model"]
    vocab = model["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    merges = [tuple(merge) for merge in model["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = trained.pre_tokenizer
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens(SPECIALS)
    return _wrap(tok)


TOKENIZERS = {"byte_level": byte_level, "metaspace": metaspace, "byte_fallback": byte_fallback}


def _decode(tokenizer, ids: list[int], skip: bool) -> str:
    """What a user gets from Hugging Face for `ids`."""
    return tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def _in_context(tokenizer, prompt: list[int], output: list[int], skip: bool) -> str:
    """decode(prompt + output) minus decode(prompt): the reference output text."""
    full = _decode(tokenizer, prompt + output, skip)
    prefix = _decode(tokenizer, prompt, skip)
    assert full.startswith(prefix)
    return full[len(prefix) :]


def _chunks(ids: list[int], sizes: list[int]) -> list[list[int]]:
    """Split `ids` into consecutive chunks whose sizes cycle through `sizes`."""
    chunks, start, i = [], 0, 0
    while start < len(ids):
        size = sizes[i % len(sizes)]
        chunks.append(ids[start : start + size])
        start, i = start + size, i + 1
    return chunks


def _encode(tokenizer, text: str) -> list[int]:
    """Token ids of `text`, without BOS/EOS."""
    return tokenizer.encode(text, add_special_tokens=False)


def _ids(name: str, max_size: int):
    """Strategy: random ids over the whole vocabulary, special ids drawn often."""
    tok = TOKENIZERS[name]()
    any_id = st.integers(0, len(tok) - 1)
    return st.lists(any_id | st.sampled_from(tok.all_special_ids), max_size=max_size)


chunk_sizes = st.lists(st.integers(1, 4), min_size=1, max_size=5)


def _check_stream(tokenizer, prompt, output, sizes, skip, reference, spaces=True):
    """Stream `output` in chunks and check every delta against `reference`.

    `reference(ids)` is the text a user must see for output `ids`. After each
    chunk the text so far is a prefix of the final text, and equals the
    reference whenever that does not end in U+FFFD (a character that is
    still incomplete); no delta holds U+FFFD unless the final text does.
    """
    detok = IncrementalDetokenizer(tokenizer, prompt, skip, spaces)
    expected = reference(output)
    deltas, seen = [], []
    for chunk in _chunks(output, sizes):
        deltas.append(detok.add_tokens(chunk))
        seen += chunk
        assert expected.startswith(detok.text)
        so_far = reference(seen)
        if not so_far.endswith(REPLACEMENT):
            assert detok.text == so_far
    assert REPLACEMENT in expected or not any(REPLACEMENT in d for d in deltas)
    deltas.append(detok.finish())
    assert "".join(deltas) == detok.text == expected
    assert detok.token_ids == output


# --- properties over random streams -----------------------------------------


@settings(max_examples=150, deadline=None)
@given(
    prompt=_ids("byte_level", 6),
    output=_ids("byte_level", 24),
    sizes=chunk_sizes,
    skip=st.booleans(),
    spaces=st.booleans(),
)
def test_byte_level_random_ids_match_decode_of_output(prompt, output, sizes, skip, spaces):
    tok = byte_level()
    reference = functools.partial(_decode, tok, skip=skip)
    _check_stream(tok, prompt, output, sizes, skip, reference, spaces)


@settings(max_examples=150, deadline=None)
@given(
    prompt=_ids("metaspace", 6), output=_ids("metaspace", 24), sizes=chunk_sizes, skip=st.booleans()
)
def test_metaspace_random_ids_match_decode_in_context(prompt, output, sizes, skip):
    tok = metaspace()
    reference = functools.partial(_in_context, tok, prompt, skip=skip)
    _check_stream(tok, prompt, output, sizes, skip, reference)


@pytest.mark.parametrize("name", TOKENIZERS)
@settings(max_examples=60, deadline=None)
@given(
    prompt_text=st.text(TEXT_ALPHABET, max_size=12),
    output_text=st.text(TEXT_ALPHABET, max_size=20),
    bos=st.booleans(),
    sizes=chunk_sizes,
    skip=st.booleans(),
)
def test_text_streams_match_decode_in_context(name, prompt_text, output_text, bos, sizes, skip):
    tok = TOKENIZERS[name]()
    prompt = [tok.bos_token_id] * bos + _encode(tok, prompt_text)
    output = _encode(tok, output_text)
    reference = functools.partial(_in_context, tok, prompt, skip=skip)
    _check_stream(tok, prompt, output, sizes, skip, reference)


@settings(max_examples=150, deadline=None)
@given(prompt=_ids("byte_fallback", 6), output=_ids("byte_fallback", 24), sizes=chunk_sizes)
def test_byte_fallback_random_ids_never_show_replacement_char_early(prompt, output, sizes):
    """Invalid byte runs can rewrite text already sent, so only these hold."""
    tok = byte_fallback()
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.add_tokens(chunk) for chunk in _chunks(output, sizes)]
    if any(REPLACEMENT in delta for delta in deltas):
        assert REPLACEMENT in _decode(tok, output, True)
    deltas.append(detok.finish())
    assert "".join(deltas) == detok.text


# --- specific behaviour -----------------------------------------------------


def _byte_ids(tokenizer, text: str) -> list[int]:
    """Byte-level ids spelling `text` one byte per token."""
    byte_to_char = bytes_to_unicode()
    return tokenizer.convert_tokens_to_ids([byte_to_char[b] for b in text.encode()])


def test_multibyte_character_is_emitted_once_complete():
    tok = byte_level()
    detok = IncrementalDetokenizer(tok, _encode(tok, "hi "))
    deltas = [detok.add_tokens([i]) for i in _byte_ids(tok, "日🙂")]
    assert deltas == ["", "", "日", "", "", "", "🙂"]


def test_finish_releases_an_incomplete_character_as_the_full_decode_does():
    tok = byte_level()
    output = _encode(tok, "ab") + _byte_ids(tok, "日")[:2]
    detok = IncrementalDetokenizer(tok, [])
    assert detok.add_tokens(output) == "ab"
    assert detok.finish() == REPLACEMENT
    assert detok.text == _decode(tok, output, True) == "ab" + REPLACEMENT
    assert detok.finish() == ""
    with pytest.raises(ValueError, match="after finish"):
        detok.add_tokens(output)


@pytest.mark.parametrize("name", ["metaspace", "byte_fallback"])
@pytest.mark.parametrize(
    ("prompt_tokens", "skip", "expected"),
    [
        (["▁hello"], True, " world"),  # After prompt text: the space is kept.
        (["<s>", "▁hello", "</s>"], True, " world"),  # Skipped ids after the text.
        (["▁"], True, " world"),  # Decodes to "" yet is a token before the output.
        (["<s>", "▁", "</s>"], True, " world"),
        (["<s>"], True, "world"),  # Only a skipped BOS before: first token, stripped.
        ([], True, "world"),  # Empty prompt: as decode(output).
        (["<s>"], False, " world"),  # BOS shown as text: the space is kept.
    ],
)
def test_sentencepiece_leading_space_rule(name, prompt_tokens, skip, expected):
    tok = TOKENIZERS[name]()
    prompt = tok.convert_tokens_to_ids(prompt_tokens)
    output = tok.convert_tokens_to_ids(["▁world"])
    assert tok.unk_token_id not in prompt + output
    assert _in_context(tok, prompt, output, skip) == expected
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    assert detok.add_tokens(output) == expected


def test_prompt_ending_inside_a_character_is_left_out_of_the_context():
    """The output is then decoded on its own bytes: no prompt text leaks out."""
    tok = byte_level()
    char = _byte_ids(tok, "日")
    prompt, output = _encode(tok, "x") + char[:1], char[1:] + _encode(tok, "ab")
    detok = IncrementalDetokenizer(tok, prompt)
    assert detok.add_tokens(output) == _decode(tok, output, True) == REPLACEMENT * 2 + "ab"


@pytest.mark.parametrize(("skip", "expected"), [(True, "hello<tool>"), (False, "hello</s><tool>")])
def test_skip_special_tokens_keeps_non_special_added_tokens(skip, expected):
    tok = byte_level()
    output = _encode(tok, "hello") + tok.convert_tokens_to_ids(["</s>", "<tool>"])
    detok = IncrementalDetokenizer(tok, [tok.bos_token_id], skip_special_tokens=skip)
    assert detok.add_tokens(output) == expected


def test_spaces_between_special_tokens():
    """With a decoder that spaces tokens (WordPiece), the flag joins added tokens."""
    words = ["hello", "world", "[A]", "[B]"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="hello"))
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens(["[A]", "[B]"])
    tok = PreTrainedTokenizerFast(tokenizer_object=tok)
    output = [1, 2, 3, 2]
    spaced = IncrementalDetokenizer(tok, [0], skip_special_tokens=False)
    joined = IncrementalDetokenizer(tok, [0], False, spaces_between_special_tokens=False)
    assert _in_context(tok, [0], output, False) == " world [A] [B] [A]"
    assert spaced.add_tokens(output) == " world [A] [B] [A]"
    assert joined.add_tokens(output) == " world [A][B][A]"


def test_invalid_byte_run_restarts_the_stream():
    """A byte run that stops being valid UTF-8 would rewrite text already sent."""
    tok = byte_fallback()
    e6, x97, xa5 = tok.convert_tokens_to_ids(["<0xE6>", "<0x97>", "<0xA5>"])
    output = [e6, x97, xa5, e6, x97] + _encode(tok, "ab")
    detok = IncrementalDetokenizer(tok, _encode(tok, "hello"))
    deltas = [detok.add_tokens([i]) for i in output]
    assert deltas[:5] == ["", "", "日", "", ""]
    assert "".join(deltas) == detok.text == "日" + REPLACEMENT * 2 + " ab"
    assert _decode(tok, output, True) == REPLACEMENT * 5 + " ab"  # What HF would show.


@pytest.mark.parametrize("bad", [[-1], [1.0], [True], ["a"]])
def test_rejects_bad_token_ids(bad):
    tok = byte_level()
    with pytest.raises(ValueError, match="Token ids"):
        IncrementalDetokenizer(tok, bad)
    with pytest.raises(ValueError, match="Token ids"):
        IncrementalDetokenizer(tok, []).add_tokens(bad)


def test_rejects_a_tokenizer_without_a_tokenizers_backend():
    with pytest.raises(ValueError, match="fast"):
        IncrementalDetokenizer(object(), [])


# --- loading ----------------------------------------------------------------


def test_load_tokenizer_round_trip(tmp_path):
    byte_level().save_pretrained(tmp_path)
    loaded = load_tokenizer(str(tmp_path))
    text = "héllo 日本語 🙂<tool>"
    assert loaded.encode(text) == byte_level().encode(text)
    assert IncrementalDetokenizer(loaded, []).add_tokens(_encode(loaded, text)) == text


def test_load_tokenizer_names_the_folder_without_tokenizer_files(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=str(tmp_path)):
        load_tokenizer(str(tmp_path))
    with pytest.raises(ValueError, match="does not exist"):
        load_tokenizer(str(tmp_path / "missing"))


def test_a_chat_template_is_a_file_or_the_template_itself(tmp_path):
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    path = tmp_path / "chat.jinja"
    path.write_text(template)
    assert load_chat_template(str(path)) == template
    assert load_chat_template(template) == template
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    tokenizer = load_tokenizer(default_model_path())
    messages = [{"role": "user", "content": "hi"}]
    assert render_chat_text(tokenizer, messages, add_generation_prompt=False, chat_template=template) == "[user] hi\n"
    assert render_chat_text(tokenizer, messages).startswith("<|user|>\nhi</s>")  # the tokenizer's own
