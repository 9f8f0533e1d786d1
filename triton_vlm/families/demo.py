"""`triton-vlm demo-checkpoint`: random-weight checkpoints that transformers loads offline.

What every family's demo is made with: a `Demo` (its sizes and its writer; each family folder's
`demo.py` holds one, which its `Family.demo` names), random weights (`random_model`), a chat
template reduced to what the demo needs (`chat_template`) and a tokenizer trained here
(`train_tokenizer`: a byte-level BPE on generated text, with the family's special tokens as single
ids), so no model hub is needed for tests or the demo. Demo data is kept out of the serving path:
a served checkpoint brings its own.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from triton_vlm.families import get_family
from triton_vlm.families.base import Family

_WORDS = (
    "the a an image video picture frame scene shows describe what is in this of and to with on at "
    "red green blue yellow black white cat dog person car tree house sky road water light dark left "
    "right top bottom small large two three many one moving still second first next answer question "
    "color shape number count where who how why when please tell me about it there are see you can "
    "0 1 2 3 4 5 6 7 8 9 , . ? ! : ; ( ) - ' \" \n"
).split(" ")


def corpus(n_lines: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 24))) for _ in range(n_lines)]


def train_tokenizer(family: Family, vocab_size: int, seed: int = 0):
    """A byte-level BPE with the family's special tokens, wrapped as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(family.prompt.special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(corpus(4000, seed), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token=family.prompt.eos_tokens[0], pad_token=family.prompt.special_tokens[0],
        extra_special_tokens=dict(family.prompt.named_special_tokens))
    for token in family.prompt.special_tokens:
        ids = tokenizer.encode(token, add_special_tokens=False)
        if len(ids) != 1:
            raise RuntimeError(f"special token {token} encodes to {ids}, not one id")
    return tokenizer


def random_model(model_class, config, shape: dict[str, Any], seed: int):
    """`model_class(config)` with random weights from `seed`, made on the shape's `device` in its
    `dtype` (a 7B-sized model initialises in seconds on a GPU, in half the memory in bfloat16)."""
    import torch

    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, shape["dtype"]))
    try:
        with torch.device(shape["device"]):
            return model_class(config).eval()
    finally:
        torch.set_default_dtype(default)


def perturb(model, seed: int, scale: Callable[[str, Any], float]) -> None:
    """Noise (standard normal from a generator seeded `seed` + 1, times `scale(name, parameter)`) added
    to the parameters for which the scale is not 0: those a random init leaves constant (biases at
    zero, norms at one), which would hide a wrong bias or norm from the tests."""
    import torch

    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if factor := scale(name, p):
                p.add_(torch.randn(p.shape, generator=gen).to(p) * factor)


def chat_template(*, prefix: str, message_start: str, message_end: str, image: str, video: str,
                  generation_prompt: str) -> str:
    """A Jinja chat template reduced to what the demo needs: text, image and video content parts.
    `message_start` may use `{{ message['role'] }}`."""
    return (
        prefix + "{% for message in messages %}" + message_start
        + "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        "{% if part['type'] == 'image' %}" + image
        + "{% elif part['type'] == 'video' %}" + video
        + "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
        "{% endfor %}{% endif %}" + message_end + "{% endfor %}"
        "{% if add_generation_prompt %}" + generation_prompt + "{% endif %}"
    )


@dataclass(frozen=True)
class Demo:
    """A family's demo checkpoint: its sizes and its writer (`write(out, shape, tokenizer, seed)`,
    `shape` from `demo_shape`)."""
    sizes: dict[str, dict[str, Any]]
    write: Callable[..., None]


def demo_shape(family: Family, size: str, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The family's `size` shape with `overrides` on top (`text` and `vision` replaced key by key).
    Besides the family's keys, a shape holds `dtype` (of the written weights, default float32),
    `device` (where the random weights are made, default CPU) and may hold `model_vocab_size` (the
    model's vocabulary rows, past the tokenizer's, as real Qwen checkpoints pad theirs)."""
    sizes = family.demo_spec().sizes
    if size not in sizes:
        raise ValueError(f"size must be one of {sorted(sizes)}")
    shape: dict[str, Any] = {"dtype": "float32", "device": "cpu", **sizes[size]}
    for key, value in (overrides or {}).items():
        shape[key] = {**shape[key], **value} if isinstance(value, Mapping) and key in shape else value
    return shape


def write_demo_checkpoint(family_name: str, out: str | Path, size: str = "tiny", seed: int = 0,
                          overrides: Mapping[str, Any] | None = None) -> Path:
    """A random-weight checkpoint of `family_name` at `size` (with `overrides`, see `demo_shape`)."""
    family = get_family(family_name)
    shape = demo_shape(family, size, overrides)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(family, shape["vocab_size"], seed)
    shape.setdefault("model_vocab_size", len(tokenizer))
    family.demo_spec().write(out, shape, tokenizer, seed)
    return out
