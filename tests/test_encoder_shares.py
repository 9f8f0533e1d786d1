"""One request's media items split over two CPU encoder instances (the torch back end, float32),
and a frame over the encoder's largest run refused by `preprocess`, through a real tritonserver."""
from __future__ import annotations

import re
import urllib.request

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from tests.encoder_checks import encode, rel_err
from tests.servers import served
from triton_vlm.families.qwen2_5_vl import QWEN2_5_VL
from triton_vlm.media import samples

MAX_FRAME_PATCHES = 512
GRID = [[1, 16, 16], [1, 8, 12], [2, 8, 8], [1, 4, 6]]  # frames of 256, 96, 64, 64 and 24 patches


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    from triton_vlm.contract.limits import Limits
    from triton_vlm.repository.options import BuildOptions

    # no queue delay: the second share is scheduled while the first is still running
    options = BuildOptions(encoder_backend="torch", encoder_instances=2, encoder_cache_bytes=0,
                           encoder_max_queue_delay_us=0, limits=Limits(max_frame_patches=MAX_FRAME_PATCHES))
    with served(tiny_checkpoint, tmp_path_factory, "shares", options,
                log_file=tmp_path_factory.mktemp("logs") / "shares.log") as running:
        yield running


def patches_per_instance(server) -> dict[str, float]:
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^triton_vlm_encoder_patches{[^}]*instance="([^"]+)"[^}]*} ([0-9.e+-]+)$', text, re.M)}


def test_items_split_over_two_instances_and_joined_in_order(server, tiny_checkpoint):
    from triton_vlm.vision.batching import balance_items
    from triton_vlm.vision.runtime.torch_encoder import TorchEncoder

    grid = np.array(GRID, dtype=np.int64)
    frames = np.repeat(np.concatenate([np.ones_like(grid[:, :1]), grid[:, 1:]], axis=1), grid[:, 0], axis=0)
    assert [s.tolist() for s in balance_items(frames, 2)] == [[0], [1, 2, 3, 4]]  # 256 against 248 patches
    settings = TorchEncoder(tiny_checkpoint).settings
    pixels = np.random.default_rng(7).standard_normal((int(grid.prod(1).sum()), settings["patch_dim"]))
    pixels = pixels.astype(np.float32)
    before = patches_per_instance(server)
    served = encode(server, pixels, grid)
    after = patches_per_instance(server)
    used = {name: after[name] - before.get(name, 0.0) for name in after}
    assert sorted(used.values()) == [248, 256], used  # both instances, each its share
    assert rel_err(served, TorchEncoder(tiny_checkpoint).encode(pixels, grid)) < 1e-5


def test_frame_over_the_encoders_largest_run_is_refused_by_preprocess(server, pre):
    import tritonclient.grpc as grpcclient

    image = samples.image_bytes(640, 480, seed=3.0)
    (_, h, w), = pre(QWEN2_5_VL.image_placeholder, [image]).grid_thw.tolist()  # the tiny processor's size
    inputs = [grpcclient.InferInput("text_input", [1], "BYTES"), grpcclient.InferInput("images", [1], "BYTES")]
    inputs[0].set_data_from_numpy(np.array([QWEN2_5_VL.image_placeholder.encode()], dtype=np.object_))
    inputs[1].set_data_from_numpy(np.array([image], dtype=np.object_))
    with grpcclient.InferenceServerClient(server.grpc_url) as client, pytest.raises(InferenceServerException) as error:
        client.infer("preprocess", inputs)
    assert error.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert f"images[0]: {h * w} patches per frame exceed max_frame_patches={MAX_FRAME_PATCHES}" in error.value.message()
