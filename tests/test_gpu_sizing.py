"""What a GPU build sizes from the machine (triton_vlm.repository.sizing), read back from the written
configs with the machine's facts given (no GPU needed): the llm's KV cache from each GPU's memory
after the weights and the rest, 8192 prompt rows a step, instance counts from the cores; explicit
flags win; a CPU build keeps its fixed defaults."""
from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from triton_vlm.contract.params import LLMOptions
from triton_vlm.repository.build import build_repository
from triton_vlm.repository.options import BuildOptions
from triton_vlm.repository.sizing import GIB, MIB, MachineFacts, _weights

H100 = MachineFacts(cores=16, gpus={0: (80 * GIB, 79 * GIB), 1: (80 * GIB, 79 * GIB)})
GPU_BUILD = BuildOptions(device="gpu", gpus="0", encoder_backend="torch")


@pytest.fixture(scope="module")
def long_context(tiny_checkpoint, tmp_path_factory):
    """The tiny checkpoint with a context so long that memory, not the context, bounds the cache."""
    path = shutil.copytree(tiny_checkpoint, tmp_path_factory.mktemp("long") / "ckpt")
    config = json.loads((path / "config.json").read_text())
    config["text_config"]["max_position_embeddings"] = 1 << 30
    (path / "config.json").write_text(json.dumps(config))
    return path


def build(checkpoint, tmp_path, options: BuildOptions, facts: MachineFacts | None = H100) -> tuple[dict, list[str]]:
    """The written configs by model name, and what the build said it chose."""
    said: list[str] = []
    repo = build_repository(checkpoint, tmp_path / f"repo-{len(list(tmp_path.iterdir()))}", options, facts=facts,
                            report=said.append)
    return {p.parent.name: text_format.Parse(p.read_text(), mc.ModelConfig()) for p in repo.glob("*/config.pbtxt")}, said


def llm(written: dict) -> LLMOptions:
    return LLMOptions.from_params({k: v.string_value for k, v in written["llm"].parameters.items()})


def count(written: dict, model: str) -> int:
    return written[model].instance_group[0].count


def test_the_decoder_weights_counted_are_transformers_language_model(tiny_checkpoint):
    from transformers import AutoModelForImageTextToText

    from triton_vlm.llm.config import DecoderConfig
    from triton_vlm.llm.model import decoder_weight

    config = DecoderConfig.from_checkpoint(tiny_checkpoint)
    decoder, vision = _weights(tiny_checkpoint, lambda key: decoder_weight(key, config))
    hf = AutoModelForImageTextToText.from_pretrained(tiny_checkpoint)
    tower = sum(p.numel() for p in hf.model.visual.parameters())
    assert (decoder, vision) == (sum(p.numel() for p in hf.parameters()) - tower
                                 + (hf.lm_head.weight.numel() if config.tie_word_embeddings else 0), tower)


def test_a_gpu_build_sizes_the_kv_cache_from_the_gpus_memory(long_context, tiny_checkpoint, tmp_path):
    written, said = build(long_context, tmp_path, GPU_BUILD)
    kv = llm(written).kv_cache_bytes
    # 0.9 of 80 GiB, less the weights (tiny here), a CUDA context for the llm and the encoder, the
    # graphs and the activations
    assert 0.9 * 80 * GIB - 4 * GIB < kv < 0.9 * 80 * GIB - 2.5 * GIB and kv % MIB == 0
    assert any(line.startswith(f"llm KV cache: {kv / GIB:.1f} GiB a GPU") for line in said), said
    # every other term stays: the utilization moves the cache by its share of the memory, to the MiB
    lower = llm(build(long_context, tmp_path, dataclasses.replace(GPU_BUILD, gpu_memory_utilization=0.5))[0])
    assert abs((kv - lower.kv_cache_bytes) - 0.4 * 80 * GIB) <= MIB
    # no more than is free while building
    busy = MachineFacts(16, {0: (80 * GIB, 20 * GIB)})
    assert llm(build(long_context, tmp_path, GPU_BUILD, busy)[0]).kv_cache_bytes < 20 * GIB - 2.5 * GIB
    # the encoder's share: a second instance on the GPU costs its weights, workspace and context
    two = llm(build(long_context, tmp_path, dataclasses.replace(GPU_BUILD, encoder_instances=2))[0])
    assert two.kv_cache_bytes < kv - GIB
    # and no more than every running sequence at its full context (the tiny checkpoint's 4096 tokens)
    from triton_vlm.llm.config import DecoderConfig

    per_token = DecoderConfig.from_checkpoint(tiny_checkpoint).kv_bytes_per_token(__import__("torch").bfloat16)
    written, said = build(tiny_checkpoint, tmp_path, GPU_BUILD)
    assert llm(written).kv_cache_bytes == -(-64 * 4096 * per_token // MIB) * MIB
    assert any("64 sequences at the full context of 4096 tokens" in line for line in said), said


def test_a_gpu_build_steps_thousands_of_prompt_rows_and_counts_instances_from_the_cores(tiny_checkpoint, tmp_path):
    for cores, preprocess, fronts in ((16, 8, 16), (2, 2, 4), (96, 16, 32)):
        written, said = build(tiny_checkpoint, tmp_path, GPU_BUILD, MachineFacts(cores, H100.gpus))
        assert llm(written).max_num_tokens == 8192
        assert (count(written, "preprocess"), count(written, "vision_encoder")) == (preprocess, fronts)
        assert f"preprocess: {preprocess} instances ({cores} cores; --preprocess-instances to choose)" in said


def test_explicit_flags_win_over_the_machine(tiny_checkpoint, tmp_path):
    given = dataclasses.replace(GPU_BUILD, kv_cache_bytes=1 * GIB, llm_max_num_tokens=256, preprocess_instances=3,
                                encoder_frontends=5)
    written, said = build(tiny_checkpoint, tmp_path, given)
    options = llm(written)
    assert (options.kv_cache_bytes, options.max_num_tokens) == (GIB, 256)
    assert (count(written, "preprocess"), count(written, "vision_encoder")) == (3, 5)
    assert "llm KV cache: as given (--kv-cache-mb / --kv-cache-tokens)" in said


def test_without_the_gpus_visible_the_fixed_cache_and_why(tiny_checkpoint, tmp_path):
    written, said = build(tiny_checkpoint, tmp_path, GPU_BUILD, MachineFacts(8, {}))
    assert llm(written).kv_cache_bytes == 0 and llm(written).max_num_tokens == 8192  # 0: the engine's 256 MiB
    assert any("256 MiB, the fixed default: GPU(s) 0 not visible while building" in line for line in said), said


def test_a_cpu_build_keeps_its_fixed_defaults(tiny_checkpoint, tmp_path):
    written, said = build(tiny_checkpoint, tmp_path, BuildOptions(), facts=None)
    assert (llm(written).kv_cache_bytes, llm(written).max_num_tokens) == (0, 512)
    assert (count(written, "preprocess"), count(written, "vision_encoder")) == (2, 4)
    assert said == ["preprocess: 2 instances; vision_encoder: 4 fronts; llm: 512 prompt rows a step, KV cache 256 MiB"]


def test_a_gpu_too_small_is_refused_naming_the_flags(tiny_checkpoint, tmp_path):
    with pytest.raises(ValueError, match=r"--gpu-memory-utilization 0\.9: .* GiB for the KV cache after .* "
                                         r"raise it, or give --kv-cache-mb"):
        build(tiny_checkpoint, tmp_path, GPU_BUILD, MachineFacts(16, {0: (2 * GIB, 2 * GIB)}))


def test_the_build_command_prints_what_it_chose(tiny_checkpoint, tmp_path, capsys):
    from triton_vlm.tools.cli import main

    assert main(["build", "--checkpoint", str(tiny_checkpoint), "--repo", str(tmp_path / "r"), "--device", "gpu",
                 "--gpus", "0", "--encoder-backend", "torch"]) == 0
    out = capsys.readouterr().out
    assert "build: llm: 8192 prompt rows a step (--llm-max-num-tokens to choose)" in out
    assert "build: llm KV cache:" in out and "built model repository" in out
