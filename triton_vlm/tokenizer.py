"""A checkpoint's tokenizer: its `tokenizer.json` (the `tokenizers` library), or, for a checkpoint
that ships only a SentencePiece model (`tokenizer.model`, e.g. MiniCPM-V 2.0's slow
`LlamaTokenizer`), `SentencePieceTokenizer`, which encodes as that slow tokenizer does in its
`legacy` mode. Both answer the calls the server makes (`encode`, `encode_batch`, `decode`,
`token_to_id`; `get_vocab` for guided decoding, `triton_vlm.llm.engine.grammar`).

Why not convert the SentencePiece model to `tokenizer.json`: the slow tokenizer splits the text on
its added tokens and encodes each piece with SentencePiece, which prepends its dummy prefix `▁` to
every piece; SentencePiece's own user-defined symbols (MiniCPM's `\\n`, `<用户>`, `<AI>`) are atomic
but get no prefix after them. No `tokenizers` pipeline has both rules, so the model itself encodes.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Encoding:
    """What `encode` returns (the part of `tokenizers.Encoding` the server reads)."""
    ids: list[int]


class SentencePieceTokenizer:
    """A slow SentencePiece `LlamaTokenizer` with `legacy` true (transformers 4.x): the added tokens
    of `tokenizer_config.json` (`added_tokens_decoder`) are split out of the text first, every other
    piece is encoded by the SentencePiece model, `<s>` goes first where `add_bos_token` (its default)
    and `</s>` last where `add_eos_token`."""

    def __init__(self, model_file: str | Path, tokenizer_config: dict[str, Any]):
        import sentencepiece

        if not tokenizer_config.get("legacy", True):
            raise NotImplementedError(f"{model_file}: a SentencePiece tokenizer with legacy false is not supported")
        self.sp = sentencepiece.SentencePieceProcessor(model_file=str(model_file))
        added = {int(i): t for i, t in (tokenizer_config.get("added_tokens_decoder") or {}).items()}
        self.added = {(t["content"] if isinstance(t, dict) else str(t)): i for i, t in added.items()}
        self.special = {i for i, t in added.items() if not isinstance(t, dict) or t.get("special", True)}
        self.special.update(i for i in range(self.sp.get_piece_size()) if self.sp.is_control(i) or self.sp.is_unknown(i))
        # longest first, as transformers' trie matches
        self._split = re.compile("(" + "|".join(map(re.escape, sorted(self.added, key=len, reverse=True))) + ")") \
            if self.added else None
        self.bos = [self.sp.bos_id()] if tokenizer_config.get("add_bos_token", True) and self.sp.bos_id() >= 0 else []
        self.eos = [self.sp.eos_id()] if tokenizer_config.get("add_eos_token", False) and self.sp.eos_id() >= 0 else []

    def encode(self, text: str, add_special_tokens: bool = True) -> Encoding:
        pieces = self._split.split(text) if self._split else [text]
        ids: list[int] = []
        for i, piece in enumerate(pieces):
            if i % 2:
                ids.append(self.added[piece])
            elif piece:
                ids += self.sp.encode(piece)
        return Encoding(self.bos + ids + self.eos if add_special_tokens else ids)

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[Encoding]:
        return [self.encode(text, add_special_tokens) for text in texts]

    @property
    def sp_model(self) -> Any:
        """The SentencePiece model, under the name transformers' tokenizers give it (which
        xgrammar's `TokenizerInfo.from_huggingface` reads)."""
        return self.sp

    def get_vocab(self) -> dict[str, int]:
        """Every piece of the model and every added token, with its id (transformers' `get_vocab`)."""
        vocab = {self.sp.id_to_piece(i): i for i in range(self.sp.get_piece_size())}
        vocab.update(self.added)
        return vocab

    def token_to_id(self, token: str) -> int | None:
        if token in self.added:
            return self.added[token]
        token_id = self.sp.piece_to_id(token)
        return None if token_id == self.sp.unk_id() and token != self.sp.id_to_piece(token_id) else token_id

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids` (SentencePiece's decoding; special tokens dropped where asked, else
        written out as their text)."""
        out, run = [], []
        for token_id in map(int, ids):
            if token_id in self.special:
                out.append(self.sp.decode(run))
                run = []
                if not skip_special_tokens:
                    out.append(self.sp.id_to_piece(token_id))
            else:
                run.append(token_id)
        return "".join(out) + self.sp.decode(run)


def load_tokenizer(checkpoint: str | Path) -> Any:
    """The checkpoint's `tokenizer.json`, else its SentencePiece `tokenizer.model` (with
    `tokenizer_config.json`)."""
    from tokenizers import Tokenizer

    root = Path(checkpoint)
    if (root / "tokenizer.json").is_file() or not (root / "tokenizer.model").is_file():
        return Tokenizer.from_file(str(root / "tokenizer.json"))
    config_path = root / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    return SentencePieceTokenizer(root / "tokenizer.model", config)
