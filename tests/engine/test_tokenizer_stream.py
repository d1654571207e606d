"""Streaming decodes UTF-8 incrementally: for any tokens (bytes of any text, invalid bytes,
specials) split anywhere, the streamed pieces join to exactly the whole decode. Broken mode:
decoding each chunk on its own (what the front door did) splits characters into U+FFFD."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.engine.tokenizer import (
    BOS,
    CONFLICT,
    EOS,
    SPECIAL_NAMES,
    StreamDecoder,
    decode,
    encode,
    encode_array,
    token_count,
)

tokens_ = st.one_of(
    st.text().map(encode),
    st.lists(st.one_of(st.integers(0, 255), st.sampled_from([BOS, EOS, CONFLICT])), max_size=60),
)


def _whole(tokens: list[int]) -> str:
    """The reference: each run of bytes between specials decoded in one go."""
    out, run = [], bytearray()
    for t in tokens:
        if t < 256:
            run.append(t)
        else:
            out += [run.decode("utf-8", errors="replace"), SPECIAL_NAMES[t]]
            run.clear()
    return "".join(out) + run.decode("utf-8", errors="replace")


def _stream(tokens: list[int], cuts: list[int]) -> str:
    dec, out, last = StreamDecoder(), [], 0
    for cut in sorted(set(cuts)) + [len(tokens)]:
        out.append(dec.feed(tokens[last:cut]))
        last = cut
    return "".join(out) + dec.finish()


@settings(max_examples=400, deadline=None)
@given(tokens=tokens_, data=st.data())
def test_a_streamed_answer_equals_the_whole_answer(tokens, data):
    cuts = data.draw(st.lists(st.integers(0, len(tokens)), max_size=8))
    assert _stream(tokens, cuts) == decode(tokens) == _whole(tokens)


@pytest.mark.parametrize("text", ["é" * 50, "€" * 50, "😀" * 50, "aé€😀" * 20])
def test_multibyte_text_split_on_every_byte_streams_back_whole(text):
    tokens = encode(text)
    assert _stream(tokens, list(range(len(tokens)))) == text
    # the broken mode, each chunk decoded alone, is what the check catches
    assert "".join(decode([t]) for t in tokens) != text


@given(st.text())
@settings(max_examples=300, deadline=None)
def test_token_count_is_the_length_of_the_tokens(text):
    """The router refuses on :func:`token_count` before any token is made: it must equal
    the count the tokens have, for ASCII and for text of 2-, 3- and 4-byte characters."""
    assert token_count(text) == len(encode_array(text)) == len(encode(text))
