"""Guided decoding (`triton_vlm.llm.engine.grammar`) in the engine, on the tiny Qwen2.5-VL checkpoint
(random weights: whatever the model prefers, the grammar alone makes the answer valid), against
transformers' greedy `generate` with xgrammar's own logits processor (`xgrammar.contrib.hf`); the
tokenizer info of both tokenizer kinds against xgrammar's reading of transformers' tokenizers; the
inputs' checks. Over the wire: tests/test_trtllm_inputs.py."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.test_llm import PROMPTS, ckpt, engine, hf, hf_generate, media, requests, submit  # noqa: F401 (fixtures)
from triton_vlm.errors import InvalidInput
from triton_vlm.llm import Engine, SamplingParams
from triton_vlm.llm.engine.grammar import Grammars, tokenizer_info
from triton_vlm.tokenizer import load_tokenizer

SCHEMA = {"type": "object", "required": ["name", "age", "color"],
          "properties": {"name": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "color": {"enum": ["red", "green", "blue"]}}}
MAX_TOKENS = 60  # the longest answer SCHEMA allows is under 60 tokens of the tiny vocabulary
REGEX = r"(red|green|blue) [0-9]{2}"
EBNF = 'root ::= answer " " [a-z]{1,8} "."\nanswer ::= "yes" | "no"'


def guided(kind: str, guide: str | None = None, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=kw.pop("max_tokens", MAX_TOKENS), guide_type=kind, guide=guide, **kw)


def schema_params(**kw) -> SamplingParams:
    return guided("json_schema", json.dumps(SCHEMA), **kw)


@pytest.mark.parametrize("name", list(PROMPTS))
def test_json_schema_answers_parse_and_validate(engine, requests, name):
    import jsonschema

    col = submit(engine, requests[name], schema_params(), f"schema-{name}").wait()
    assert col.finish_reason == "stop" and col.ids[-1] in engine.eos_token_ids
    jsonschema.validate(json.loads(col.text), SCHEMA)


def hf_guided(hf, ckpt, req, guide_type: str, guide: str, max_new_tokens: int = MAX_TOKENS, **kw) -> list[int]:
    """transformers' greedy generate, masked by xgrammar's HF logits processor on a grammar compiled
    from transformers' own tokenizer (compact JSON, as the engine compiles it)."""
    import xgrammar as xgr
    from transformers import AutoTokenizer, LogitsProcessorList
    from xgrammar.contrib.hf import LogitsProcessor

    model, _ = hf
    config = json.loads((Path(ckpt) / "config.json").read_text())
    eos = config.get("eos_token_id", config.get("text_config", {}).get("eos_token_id"))
    info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(ckpt),
                                              vocab_size=model.config.text_config.vocab_size,
                                              stop_token_ids=eos if isinstance(eos, list) else [eos])
    compiler = xgr.GrammarCompiler(info)
    grammar = {"json_schema": lambda: compiler.compile_json_schema(guide, any_whitespace=False),
               "regex": lambda: compiler.compile_regex(guide),
               "ebnf_grammar": lambda: compiler.compile_grammar(guide)}[guide_type]()
    return hf_generate(hf, req, max_new_tokens=max_new_tokens, do_sample=False,
                       logits_processor=LogitsProcessorList([LogitsProcessor(grammar)]), **kw)


@pytest.mark.parametrize("name", ["text", "image+video"])
def test_json_schema_greedy_equals_hf_generate_with_xgrammar(hf, ckpt, engine, requests, name):
    expected = hf_guided(hf, ckpt, requests[name], "json_schema", json.dumps(SCHEMA))
    assert submit(engine, requests[name], schema_params(), f"schema-hf-{name}").wait().ids == expected


@pytest.mark.parametrize("other", [{"repetition_penalty": 1.3}, {"bad_words": ["blue", "age"]}],
                         ids=["repetition_penalty", "bad_words"])
def test_the_grammar_masks_after_the_other_processors_as_hf(hf, ckpt, engine, requests, other):
    """Repetition penalty and bad words (transformers' own processors, which run before a user's)
    and then the grammar: the same tokens. The grammar then spells a banned word it needs with
    other tokens."""
    req = requests["text"]
    hf_kw = dict(other)
    if "bad_words" in hf_kw:
        words = [engine.tokenizer.encode(w, add_special_tokens=False).ids for w in hf_kw.pop("bad_words")]
        hf_kw["bad_words_ids"] = words
    expected = hf_guided(hf, ckpt, req, "json_schema", json.dumps(SCHEMA), **hf_kw)
    assert submit(engine, req, schema_params(**other), f"other-{sorted(other)[0]}").wait().ids == expected


@pytest.mark.parametrize("kind, guide, check", [
    ("regex", REGEX, lambda text: re.fullmatch(REGEX, text)),
    ("ebnf_grammar", EBNF, lambda text: re.fullmatch(r"(yes|no) [a-z]{1,8}\.", text)),
    ("json", None, lambda text: isinstance(json.loads(text), dict)),
])
def test_regex_ebnf_and_json_are_honoured(hf, ckpt, engine, requests, kind, guide, check):
    for name in ("text", "image"):
        col = submit(engine, requests[name], guided(kind, guide, max_tokens=40), f"{kind}-{name}").wait()
        if kind == "json" and col.finish_reason == "length":  # any object: it may be longer than 40 tokens
            continue
        assert col.finish_reason == "stop" and check(col.text), col.text
        if kind != "json":
            assert col.ids == hf_guided(hf, ckpt, requests[name], kind, guide, max_new_tokens=40)


def test_a_request_without_a_guide_next_to_guided_ones_is_unchanged(engine, requests):
    plain = SamplingParams(max_tokens=20)
    sampled = SamplingParams(max_tokens=20, temperature=0.9, top_k=40, seed=5)
    alone = [submit(engine, requests[n], p, f"plain-alone-{n}-{i}").wait().ids
             for i, p in enumerate((plain, sampled)) for n in ("text", "video")]
    guided_alone = submit(engine, requests["image"], schema_params(), "guided-alone").wait().ids
    cols = [submit(engine, requests["image"], schema_params(), "guided-together")]
    cols += [submit(engine, requests[n], p, f"plain-together-{n}-{i}")
             for i, p in enumerate((plain, sampled)) for n in ("text", "video")]
    together = [c.wait().ids for c in cols]
    assert together == [guided_alone, *alone]


def test_preempted_guided_requests_give_the_same_tokens(ckpt, engine, requests):
    """A preempted sequence keeps its matcher, whose state its kept tokens give."""
    jobs = [(n, schema_params() if i % 2 == 0 else guided("regex", REGEX, max_tokens=12)) for i, n in
            enumerate(list(PROMPTS) * 2)]
    alone = [submit(engine, requests[n], p, f"pre-alone-{i}").wait().ids for i, (n, p) in enumerate(jobs)]
    longest = max(int(requests[n]["llm"]["input_ids"].size) + p.max_tokens for n, p in jobs)
    eng = Engine(ckpt, model=engine.model, kv_cache_tokens=longest + 16, block_size=8, max_num_tokens=24)
    try:
        cols = [submit(eng, requests[n], p, f"pre-{i}") for i, (n, p) in enumerate(jobs)]
        assert [c.wait().ids for c in cols] == alone
        assert eng.num_preempted > 0 and eng.kv_blocks_free == eng.blocks.num_blocks
    finally:
        eng.shutdown()


def test_stop_words_and_min_tokens_with_a_grammar(engine, requests):
    req = requests["text"]
    col = submit(engine, req, schema_params(stop_words=['"age"']), "stop-word").wait()
    assert col.finish_reason == "stop" and col.text.startswith('{"name": "') and '"age"' not in col.text
    # a grammar that must end before min_tokens: no token left that both allow
    col = submit(engine, req, guided("regex", "no", min_tokens=5), "min-tokens").wait()
    assert col.finish_reason == "error" and "min_tokens" in col.outputs[-1].error


@pytest.mark.parametrize("kind, guide, message", [
    ("json_schema", '{"type": "object", "properties": 5}', "guided_decoding_guide: invalid JSON schema: "
                                                            "properties must be an object"),
    ("json_schema", "not json", "guided_decoding_guide: invalid JSON schema: Failed to parse JSON"),
    ("regex", "a(b", "guided_decoding_guide: invalid regex: "),
    ("ebnf_grammar", "root ::= rule", 'guided_decoding_guide: invalid EBNF grammar: '),
])
def test_a_guide_xgrammar_cannot_compile_is_refused_and_others_are_served(engine, requests, kind, guide, message):
    with pytest.raises(InvalidInput) as error:
        submit(engine, requests["text"], guided(kind, guide), f"bad-{kind}")
    assert str(error.value).startswith(message), error.value
    assert engine.kv_blocks_used == 0
    assert submit(engine, requests["text"], guided("regex", REGEX), f"after-bad-{kind}").wait().finish_reason == "stop"


@pytest.mark.parametrize("inputs, message", [
    ({"guided_decoding_guide_type": [b"xml"]}, "guided_decoding_guide_type: must be one of json, json_schema, regex, "
                                               "ebnf_grammar, got 'xml'"),
    ({"guided_decoding_guide_type": [b"regex"]}, "guided_decoding_guide: required with guided_decoding_guide_type regex"),
    ({"guided_decoding_guide_type": [b"json_schema"], "guided_decoding_guide": [b" "]},
     "guided_decoding_guide: required with guided_decoding_guide_type json_schema, got an empty one"),
    ({"guided_decoding_guide_type": [b"json"], "guided_decoding_guide": [b"{}"]},
     "guided_decoding_guide: not taken with guided_decoding_guide_type json"),
    ({"guided_decoding_guide": [b"[a-z]+"]}, "guided_decoding_guide: given without guided_decoding_guide_type"),
    ({"guided_decoding_guide_type": [b"regex"], "guided_decoding_guide": [b"\xff"]}, "guided_decoding_guide: not UTF-8"),
    ({"guided_decoding_guide_type": [b"regex", b"json"]}, "guided_decoding_guide_type: expected one value, got 2"),
])
def test_bad_guide_inputs_are_refused_naming_them(inputs, message):
    with pytest.raises(InvalidInput) as error:
        SamplingParams.from_inputs({"max_tokens": [4], **{k: np.array(v, np.object_) for k, v in inputs.items()}})
    assert str(error.value).startswith(message), error.value


def test_guide_inputs_are_read():
    p = SamplingParams.from_inputs({"max_tokens": [4], "guided_decoding_guide_type": np.array([b"regex"], np.object_),
                                    "guided_decoding_guide": np.array(["[a-z]+ é".encode()], np.object_)})
    assert (p.guide_type, p.guide) == ("regex", "[a-z]+ é")
    assert SamplingParams.from_inputs({"max_tokens": [4]}).guide_type is None


def test_tokenizer_info_is_xgrammars_reading_of_transformers_tokenizers(ckpt):
    """Byte-level BPE (`tokenizers`) and byte-fallback SentencePiece (MiniCPM-V 2.0's
    `tokenizer.model` alone) read as xgrammar reads transformers' own tokenizers of the same files;
    rows past the tokenizer's vocabulary are never allowed."""
    import xgrammar as xgr
    from transformers import AutoTokenizer
    from transformers.tokenization_utils_sentencepiece import SentencePieceBackend

    golden = Path(__file__).parent / "golden" / "minicpmv2_0"
    for root, reference, kind in ((Path(ckpt), AutoTokenizer.from_pretrained(ckpt), xgr.VocabType.BYTE_LEVEL),
                                  (golden, SentencePieceBackend.from_pretrained(str(golden), legacy=True),
                                   xgr.VocabType.BYTE_FALLBACK)):
        vocab = len(reference.get_vocab()) + 40
        ours = tokenizer_info(load_tokenizer(root), vocab, {2})
        theirs = xgr.TokenizerInfo.from_huggingface(reference, vocab_size=vocab, stop_token_ids=[2])
        assert ours.vocab_type == theirs.vocab_type == kind
        assert ours.add_prefix_space == theirs.add_prefix_space == (kind == xgr.VocabType.BYTE_FALLBACK)
        assert ours.decoded_vocab == theirs.decoded_vocab and ours.stop_token_ids == [2]
        matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(ours).compile_regex(".*"))
        mask = xgr.allocate_token_bitmask(1, vocab)
        matcher.fill_next_token_bitmask(mask)
        allowed = torch.zeros(1, vocab)
        xgr.apply_token_bitmask_inplace(allowed, mask)
        assert (allowed[0, vocab - 40:] == -torch.inf).all() and (allowed[0, :vocab - 40] == 0).any()


def test_compiled_grammars_are_cached_with_a_bound(ckpt):
    grammars = Grammars(load_tokenizer(ckpt), 600, {2}, cache_size=2)
    first = grammars.compile("regex", "a+")
    assert grammars.compile("regex", "a+") is first
    grammars.compile("regex", "b+")
    grammars.compile("regex", "c+")
    assert grammars.compile("regex", "a+") is not first and len(grammars._cache) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_guided_decoding_on_cuda_with_graphs(ckpt, requests):
    """The bitmask applied on the device after a CUDA graph's logits: guided answers validate, and
    guided and plain requests together give what each gives alone."""
    import jsonschema

    eng = Engine(ckpt, device="cuda", dtype="float32", cuda_graphs=True, max_running=8)
    try:
        jobs = [(n, schema_params() if i % 2 == 0 else SamplingParams(max_tokens=24)) for i, n in
                enumerate(list(PROMPTS) * 2)]
        alone = [submit(eng, requests[n], p, f"cuda-alone-{i}").wait() for i, (n, p) in enumerate(jobs)]
        cols = [submit(eng, requests[n], p, f"cuda-{i}") for i, (n, p) in enumerate(jobs)]
        assert [c.wait().ids for c in cols] == [c.ids for c in alone]
        for (_, p), col in zip(jobs, alone):
            if p.guide_type:
                jsonschema.validate(json.loads(col.text), SCHEMA)
    finally:
        eng.shutdown()


def test_the_grammar_mask_comes_before_top_k_and_leaves_logits_alone():
    """Top-k 1 keeps the best token the grammar allows (masked first), not the best one; a row
    without a grammar beside it is untouched, and so are the logits (they feed log-probabilities)."""
    import xgrammar as xgr

    from triton_vlm.llm import NO_TOKEN, make_generator, sample_batch

    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0]] * 3)
    before = logits.clone()
    bits = xgr.allocate_token_bitmask(3, 4)
    bits[0] = 0b1100  # tokens 2 and 3
    bits[2] = 0       # nothing: its grammar and other masks leave no token
    params = [SamplingParams(max_tokens=4, temperature=1.0, top_k=1)] * 3
    tokens = sample_batch(logits, params, [make_generator(i) for i in range(3)], [None] * 3, None, (bits, [0, 2]))
    assert tokens.tolist() == [2, 0, -2] and NO_TOKEN == -1
    assert torch.equal(logits, before)


def test_end_id_is_the_grammars_stop_token(engine, requests):
    """The grammar complete, only the request's own eos id is allowed (here a plain token, whose
    text ends the answer as an `end_id`'s does)."""
    stop = engine.tokenizer.token_to_id("!")
    col = submit(engine, requests["text"], guided("regex", "[a-z]{1,5}", end_id=stop), "end-id").wait()
    assert col.finish_reason == "stop" and col.ids[-1] == stop and re.fullmatch("[a-z]{1,5}!", col.text)
