"""`triton-vlm build --device gpu` (no GPU needed): every step placed where it runs, the configs
from the one generator, parsed back and checked; the encoder back end and GPU choices."""
from __future__ import annotations

import json

import pytest
from tritonclient.grpc import model_config_pb2 as mc

from triton_vlm.contract.params import EncoderBatchOptions, EncoderOptions, LLMOptions

GPU, CPU = mc.ModelInstanceGroup.KIND_GPU, mc.ModelInstanceGroup.KIND_CPU


def configs(checkpoint, *flags: str) -> dict[str, mc.ModelConfig]:
    from triton_vlm.families import detect_family
    from triton_vlm.repository.configs import check_pipeline, model_configs
    from triton_vlm.tools.cli import build_options, parser

    args = parser().parse_args(["build", "--checkpoint", str(checkpoint), "--repo", "r", *flags])
    out = model_configs(detect_family(checkpoint), json.loads((checkpoint / "config.json").read_text()),
                        build_options(args))
    check_pipeline(out)
    return out


def params(config: mc.ModelConfig) -> dict[str, str]:
    return {k: v.string_value for k, v in config.parameters.items()}


def placement(config: mc.ModelConfig) -> tuple[int, list[int], int]:
    (group,) = config.instance_group
    return group.kind, list(group.gpus), group.count


def test_gpu_build_places_llm_and_encoder_on_the_gpus(tiny_checkpoint, tmp_path):
    """The written repository: llm and vision_encoder_batch on GPUs 0 and 1 (count per GPU), the
    llm's `cuda` the instance's own GPU; preprocess, the front and the ensemble on the CPU."""
    from google.protobuf import text_format

    from triton_vlm.tools.cli import main

    repo = tmp_path / "repository"
    assert main(["build", "--checkpoint", str(tiny_checkpoint), "--repo", str(repo), "--device", "gpu",
                 "--gpus", "0,1", "--encoder-backend", "torch", "--encoder-instances", "2"]) == 0
    written = {p.parent.name: text_format.Parse(p.read_text(), mc.ModelConfig()) for p in repo.glob("*/config.pbtxt")}
    assert placement(written["llm"]) == (GPU, [0, 1], 1)
    assert placement(written["vision_encoder_batch"]) == (GPU, [0, 1], 2)
    for name in ("preprocess", "vision_encoder", "ensemble"):
        assert placement(written[name])[:2] == (CPU, []), name
    assert LLMOptions.from_params(params(written["llm"])).device == "cuda"
    batch = EncoderBatchOptions.from_params(params(written["vision_encoder_batch"]))
    assert (batch.backend, batch.dtype, batch.instances) == ("torch", "bfloat16", 4)
    assert EncoderOptions.from_params(params(written["vision_encoder"])).batch_instances == 4
    # the torch back end reads the tower's weights from its own checkpoint copy; no ONNX export
    assert list((repo / "vision_encoder_batch" / "1" / "checkpoint").glob("*.safetensors"))
    assert not (repo / "vision_encoder" / "1" / "encoder.onnx").exists()


def test_a_tensor_parallel_llm_instance_takes_a_run_of_gpus(tiny_checkpoint):
    """--tensor-parallel 2 on GPUs 0-3: two llm instances, on GPUs 0 and 2 (their ranks on 1 and 3);
    GPUs that do not come in runs of 2 are refused naming the flag; the encoder keeps every GPU."""
    import json

    from triton_vlm.families import detect_family
    from triton_vlm.repository.configs import model_configs
    from triton_vlm.repository.options import BuildOptions

    config = json.loads((tiny_checkpoint / "config.json").read_text())
    options = BuildOptions(device="gpu", gpus="0,1,2,3", tensor_parallel=2, encoder_backend="torch")
    configs = model_configs(detect_family(tiny_checkpoint), config, options)
    assert placement(configs["llm"]) == (GPU, [0, 2], 1)
    assert LLMOptions.from_params(params(configs["llm"])).tensor_parallel == 2
    assert placement(configs["vision_encoder_batch"])[1] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="--tensor-parallel 2: the GPUs \\(0,2\\) must come in runs of 2"):
        model_configs(detect_family(tiny_checkpoint), config, BuildOptions(device="gpu", gpus="0,2", tensor_parallel=2))


def test_instance_device():
    from triton_vlm.contract.params import instance_device

    assert instance_device({"model_instance_kind": "GPU", "model_instance_device_id": "1"}, "cuda") == "cuda:1"
    assert instance_device({"model_instance_kind": "GPU", "model_instance_device_id": "1"}, "cuda:0") == "cuda:0"
    assert instance_device({"model_instance_kind": "CPU", "model_instance_device_id": "0"}, "cpu") == "cpu"


def test_defaults_and_choices(tiny_checkpoint):
    import torch

    from triton_vlm.vision.runtime.backends import default_backend

    cpu = configs(tiny_checkpoint)
    assert placement(cpu["llm"])[0] == placement(cpu["vision_encoder_batch"])[0] == CPU
    assert EncoderBatchOptions.from_params(params(cpu["vision_encoder_batch"])).backend == "onnxruntime"
    gpu = configs(tiny_checkpoint, "--device", "gpu")
    visible = list(range(torch.cuda.device_count())) or [0]
    assert placement(gpu["llm"])[:2] == (GPU, visible)
    assert EncoderBatchOptions.from_params(params(gpu["vision_encoder_batch"])).backend == default_backend("gpu")
    # onnxruntime stays on the CPU in a GPU build; an explicit llm cpu too
    mixed = configs(tiny_checkpoint, "--device", "gpu", "--encoder-backend", "onnxruntime", "--llm-device", "cpu")
    assert placement(mixed["vision_encoder_batch"])[0] == placement(mixed["llm"])[0] == CPU
    # a CPU build with the torch back end runs the tower on the CPU in float32
    torch_cpu = configs(tiny_checkpoint, "--encoder-backend", "torch")
    assert EncoderBatchOptions.from_params(params(torch_cpu["vision_encoder_batch"])).dtype == "float32"
    # TensorRT's profile bounds preprocess's frames
    trt = configs(tiny_checkpoint, "--device", "gpu", "--encoder-backend", "tensorrt", "--trt-max-patches", "4096")
    assert params(trt["preprocess"])["max_frame_patches"] == "4096"


@pytest.mark.parametrize("flags, message", [
    (("--encoder-backend", "tensorrt"), "needs --device gpu"),
    (("--device", "gpu", "--gpus", "0,x"), "--gpus 0,x"),
    (("--device", "gpu", "--encoder-backend", "onnxruntime", "--encoder-dtype", "bfloat16"), "runs float32, float16"),
])
def test_bad_choices_are_named(tiny_checkpoint, flags, message):
    with pytest.raises(ValueError, match=message):
        configs(tiny_checkpoint, *flags)


def test_the_pipeline_check_names_what_a_step_would_lack(tiny_checkpoint):
    from triton_vlm.repository.configs import check_pipeline

    good = configs(tiny_checkpoint)
    steps = json.loads(good["ensemble"].parameters["steps"].string_value)
    assert [s.get("skip_when_empty", "") for s in steps] == ["", "pixel_values", ""]
    assert [s.get("calls", []) for s in steps] == [[], ["vision_encoder_batch"], []]

    def broken(change) -> str:
        out = {name: mc.ModelConfig.FromString(c.SerializeToString()) for name, c in good.items()}
        change(out)
        with pytest.raises(RuntimeError) as error:
            check_pipeline(out)
        return str(error.value)

    def embeddings_required(out):
        next(t for t in out["llm"].input if t.name == "embeddings").optional = False

    assert "llm.embeddings is required but vision_encoder may be skipped" in broken(embeddings_required)

    def grid_not_passed(out):
        listed = json.loads(out["ensemble"].parameters["steps"].string_value)
        listed[1]["inputs"].remove("grid_thw")
        out["ensemble"].parameters["steps"].string_value = json.dumps(listed)

    assert "vision_encoder.grid_thw is required but not passed" in broken(grid_not_passed)

    def calls_unknown(out):
        listed = json.loads(out["ensemble"].parameters["steps"].string_value)
        listed[1]["calls"] = ["vision_encoder_batches"]
        out["ensemble"].parameters["steps"].string_value = json.dumps(listed)

    assert "vision_encoder calls ['vision_encoder_batches'], not in the repository" in broken(calls_unknown)
