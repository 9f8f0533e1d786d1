"""`triton_vlm.tokenizer` on MiniCPM-V 2.0's SentencePiece-only tokenizer (`tests/golden/minicpmv2_0`): the
official slow tokenizer's ids for every golden prompt, and transformers' own SentencePiece tokenizer
(`SentencePieceBackend`, legacy) on generated text mixing added tokens, SentencePiece's user-defined
symbols, spaces, digits, bytes and newlines."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from triton_vlm.tokenizer import SentencePieceTokenizer, load_tokenizer

GOLDEN = Path(__file__).parent / "golden" / "minicpmv2_0"
PIECES = ["<用户>", "<AI>", "<image>", "</image>", "<slice>", "</slice>", "<unk>", "<s>", "</s>", "\n", "\t", " ",
          "  ", "hello", "world", "What is", "12 34", "ü", "漢字", "?", "<img>", "<SEP>", ".", "-"]


@pytest.fixture(scope="module")
def tokenizer() -> SentencePieceTokenizer:
    return load_tokenizer(GOLDEN)


@pytest.fixture(scope="module")
def reference():
    from transformers.tokenization_utils_sentencepiece import SentencePieceBackend

    return SentencePieceBackend.from_pretrained(str(GOLDEN), legacy=True)


def test_a_checkpoint_without_tokenizer_json_gets_its_sentencepiece_model(tokenizer):
    assert isinstance(tokenizer, SentencePieceTokenizer)


def test_golden_prompts_encode_to_the_official_ids(tokenizer):
    """The official `tokenizer.encode(expanded_prompt)`: `<s>` first, `▁` before a leading `<用户>` and
    before the newline after `</image>`, no `▁` after `<用户>`'s text neighbours."""
    meta = json.loads((GOLDEN / "cases.json").read_text())
    with np.load(GOLDEN / "golden.npz") as golden:
        for case in meta["cases"]:
            assert tokenizer.encode(case["expanded_prompt"]).ids == golden[f"{case['id']}/input_ids"].tolist(), case["id"]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(PIECES) | st.text(max_size=6), max_size=12))
def test_text_encodes_as_transformers_sentencepiece_tokenizer(tokenizer, reference, parts):
    text = "".join(parts)
    assert tokenizer.encode(text, add_special_tokens=False).ids == reference.encode(text, add_special_tokens=False)


def test_special_tokens_bos_and_ids(tokenizer):
    assert tokenizer.encode("hello").ids[0] == 1 and tokenizer.encode("hello", add_special_tokens=False).ids[0] != 1
    assert [tokenizer.token_to_id(t) for t in ("<unk>", "<s>", "</s>", "<image>", "<用户>", "\n")] == [0, 1, 2, 101, 113, 5]
    assert tokenizer.token_to_id("no such piece") is None
    assert len(tokenizer.encode_batch(["a", "b c"], add_special_tokens=False)) == 2


def test_decode_drops_special_tokens_where_asked(tokenizer):
    ids = tokenizer.encode("<image>hello world</image>", add_special_tokens=True).ids
    assert tokenizer.decode(ids) == "hello world"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<s><image>hello world</image>"


def test_a_tokenizer_json_wins(tmp_path):
    from tokenizers import Tokenizer

    (tmp_path / "tokenizer.model").write_bytes((GOLDEN / "tokenizer.model").read_bytes())
    (tmp_path / "tokenizer.json").write_text((Path(__file__).parent / "golden" / "minicpmv2_6" / "tokenizer.json").read_text())
    assert isinstance(load_tokenizer(tmp_path), Tokenizer)


def test_legacy_false_is_refused():
    with pytest.raises(NotImplementedError, match="legacy false"):
        SentencePieceTokenizer(GOLDEN / "tokenizer.model", {"legacy": False})
