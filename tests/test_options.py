"""Typed model parameters (triton_vlm.contract.params): written by the build, read back by the models."""
from __future__ import annotations

import dataclasses
import json

import pytest

from triton_vlm.contract.limits import Limits
from triton_vlm.contract.params import EncoderBatchOptions, EncoderOptions, LLMOptions

SAMPLES = [
    LLMOptions(device="cuda:1", dtype="bfloat16", kv_cache_tokens=4096, kv_cache_bytes=1 << 30, block_size=32,
               prefix_caching=True, max_running=7, max_num_tokens=1024, queue_timeout_ms=250),
    EncoderOptions(batch_model="vision_encoder_batch", patch_dim=1176, hidden=2048, spatial_merge_size=2,
                   max_batch_patches=65536, packed_frames=True, extras="temporal_ids",
                   rows="triton_vlm.vision.tower.rows:embedding_rows", tower_settings='{"query_num": 64}'),
    EncoderBatchOptions(instances=3, cache_bytes=1 << 20, engine_file="encoder.plan"),
    EncoderBatchOptions(instances=2, encoder_file="../../vision_encoder/1/encoder.onnx", intra_op_threads=4),
    EncoderBatchOptions(instances=2, backend="torch", weights_dir="checkpoint", dtype="bfloat16"),
    Limits(max_item_bytes=1234, max_aspect_ratio=50.5),
]


@pytest.mark.parametrize("options", SAMPLES, ids=lambda o: type(o).__name__)
def test_round_trip(options):
    params = options.to_params()
    assert all(isinstance(v, str) for v in params.values())
    assert type(options).from_params({**params, "family": "qwen2_5_vl", "checkpoint": "checkpoint"}) == options


def test_values_as_written():
    assert LLMOptions(prefix_caching=True, queue_timeout_ms=250).to_params()["prefix_caching"] == "true"
    assert LLMOptions(queue_timeout_ms=250).to_params()["queue_timeout_ms"] == "250"
    assert "engine_file" not in EncoderBatchOptions().to_params()  # None: not written
    assert LLMOptions.from_params({"prefix_caching": "True"}).prefix_caching is True


def test_bad_or_missing_values_are_named():
    with pytest.raises(ValueError, match="max_running: expected int, got 'many'"):
        LLMOptions.from_params({"max_running": "many"})
    with pytest.raises(ValueError, match="prefix_caching: expected true or false, got 'yes'"):
        LLMOptions.from_params({"prefix_caching": "yes"})
    with pytest.raises(ValueError, match="EncoderOptions: parameter patch_dim is missing"):
        EncoderOptions.from_params({"batch_model": "b", "hidden": "2", "spatial_merge_size": "2",
                                    "max_batch_patches": "4"})
    with pytest.raises(ValueError, match="max_media_items must be positive"):
        Limits.from_params({"max_media_items": "0"})


def test_the_engines_settings_are_llm_options(tiny_checkpoint):
    """The llm model's parameters are the Engine's settings, declared once: every field reaches
    the engine as given, and a name that is not one is refused before anything is loaded."""
    from triton_vlm.llm.engine.engine import Engine

    options = LLMOptions(kv_cache_tokens=512, block_size=8, prefix_caching=True, max_running=3, max_num_tokens=64,
                         queue_timeout_ms=250, cuda_graphs=False)
    with Engine(tiny_checkpoint, **dataclasses.asdict(options)) as engine:
        assert engine.settings == options
        assert (engine.pool_tokens, engine.blocks.block_size, engine.prefix_caching) == (512, 8, True)
        assert (engine.scheduler.max_running, engine.scheduler.max_num_tokens) == (3, 64)
        assert engine.scheduler.queue_timeout_ms == 250
    with pytest.raises(TypeError, match="max_batch"):
        Engine(tiny_checkpoint, max_batch=4)


@pytest.mark.parametrize("device", ["cpu", "gpu"])
def test_build_writes_what_the_models_read(tiny_checkpoint, device):
    from triton_vlm.contract.tensors import ENCODER_BATCH_MODEL
    from triton_vlm.families import detect_family
    from triton_vlm.repository.configs import model_configs
    from triton_vlm.repository.options import BuildOptions

    options = BuildOptions(device=device, encoder_backend="tensorrt" if device == "gpu" else "", kv_cache_tokens=8192, kv_block_size=32, prefix_caching=False,
                           llm_max_running=5, llm_max_num_tokens=256, llm_queue_timeout_ms=900, encoder_instances=2,
                           encoder_threads=3, encoder_cache_bytes=1 << 20, encoder_max_batch_patches=1000)
    configs = model_configs(detect_family(tiny_checkpoint), json.loads((tiny_checkpoint / "config.json").read_text()),
                            options)

    def params(name: str) -> dict[str, str]:
        return {k: v.string_value for k, v in configs[name].parameters.items()}

    gpu = device == "gpu"
    assert LLMOptions.from_params(params("llm")) == LLMOptions(
        device="cuda" if gpu else "cpu", dtype="bfloat16" if gpu else "float32", kv_cache_tokens=8192, block_size=32, prefix_caching=False, max_running=5,
        max_num_tokens=256, queue_timeout_ms=900)
    front = EncoderOptions.from_params(params("vision_encoder"))
    assert (front.batch_model, front.max_batch_patches, front.spatial_merge_size) == (ENCODER_BATCH_MODEL, 1000, 2)
    batch = EncoderBatchOptions.from_params(params(ENCODER_BATCH_MODEL))
    assert (batch.instances, batch.cache_bytes) == (2, 1 << 20)
    if gpu:
        assert (batch.engine_file, batch.encoder_file, batch.intra_op_threads) == ("encoder.plan", None, None)
    else:
        assert (batch.engine_file, batch.encoder_file, batch.intra_op_threads) == (
            None, "../../vision_encoder/1/encoder.onnx", 3)
