"""`triton_vlm.shm_arena` without a server (registration recorded), then `GrpcSteps.call` through
it against the session's real server: large outputs in place, a slot too small grown and the call
run again, an output going on as the next call's input without a copy."""
from __future__ import annotations

import mmap
import os

import numpy as np
import pytest

from triton_vlm.shm_arena import ALIGN, MIN_REGION, Arena


class Registry:
    def __init__(self) -> None:
        self.live: dict[str, int] = {}

    def register(self, name: str, key: str, size: int) -> None:
        assert key == "/" + name and name not in self.live
        self.live[name] = size

    def unregister(self, name: str) -> None:
        del self.live[name]


def test_slots_are_aligned_and_a_full_region_gets_a_larger_one():
    registry = Registry()
    arena = Arena(registry.register, registry.unregister)
    a, b = arena.alloc(10), arena.alloc(100)
    assert (a.offset, a.size, b.offset, b.size) == (0, ALIGN, ALIGN, 2 * ALIGN)
    assert a.region is b.region and a.region.size == MIN_REGION
    big = arena.alloc(MIN_REGION + 1)
    assert big.region is not a.region and big.region.size == 2 * MIN_REGION and big.offset == 0
    assert sorted(registry.live.values()) == [MIN_REGION, 2 * MIN_REGION]
    # the /dev/shm names are gone at once: nothing is left behind by a process that dies
    assert not any(os.path.exists(f"/dev/shm/{name}") for name in registry.live)
    arena.close()
    assert not registry.live


def test_put_copies_once_and_an_array_in_the_arena_is_found_in_place():
    registry = Registry()
    arena = Arena(registry.register, registry.unregister)
    array = np.arange(1000, dtype=np.float32).reshape(10, 100)
    slot = arena.put(array)
    view = slot.view(array.dtype, array.shape)
    np.testing.assert_array_equal(view, array)
    used = arena.mark()
    again = arena.put(view[2:5])  # a contiguous part of an output: no new slot, no copy
    assert arena.mark() == used and again.region is slot.region and again.offset == slot.offset + 2 * 100 * 4
    assert arena.locate(view[:, :3]) is None  # not contiguous
    assert arena.locate(array) is None


def test_rollback_frees_what_a_failed_call_took():
    registry = Registry()
    arena = Arena(registry.register, registry.unregister)
    arena.alloc(100)
    mark = arena.mark()
    arena.alloc(1000)
    arena.alloc(2 * MIN_REGION)
    arena.rollback(mark)
    assert arena.alloc(100).offset == 2 * ALIGN
    assert arena.alloc(2 * MIN_REGION).offset == 0


def test_reset_makes_one_region_of_the_total_and_returns_pages_beyond_keep_bytes():
    registry = Registry()
    arena = Arena(registry.register, registry.unregister, keep_bytes=mmap.PAGESIZE)
    arena.alloc(MIN_REGION)
    arena.alloc(MIN_REGION)  # a second region
    arena.reset()
    assert len(arena.regions) == 1 and arena.regions[0].size == 3 * MIN_REGION
    assert list(registry.live.values()) == [3 * MIN_REGION]
    slot = arena.alloc(4 * mmap.PAGESIZE)
    slot.view(np.dtype(np.uint8), (slot.size,))[...] = 7
    arena.reset()
    after = arena.alloc(4 * mmap.PAGESIZE).view(np.dtype(np.uint8), (4 * mmap.PAGESIZE,))
    assert (after[:mmap.PAGESIZE] == 7).all() and (after[mmap.PAGESIZE:] == 0).all()


@pytest.fixture(scope="module")
def steps(server):
    from triton_vlm.loopback import GrpcSteps

    steps = GrpcSteps(server.grpc_url)
    yield steps
    steps.close()


def test_call_moves_large_outputs_to_shared_memory_and_grows_a_slot_that_was_too_small(steps, server, pre,
                                                                                        ckpt_config):
    import tritonclient.grpc as grpcclient

    from triton_vlm.samples import image_bytes

    stats = grpcclient.InferenceServerClient(server.grpc_url)
    text = "<|vision_start|><|image_pad|><|vision_end|>What is it?"
    outputs = ["input_ids", "pixel_values", "grid_thw"]

    def executions() -> int:
        return stats.get_inference_statistics("preprocess").model_stats[0].inference_stats.success.count

    def call(size: tuple[int, int], request_id: str) -> tuple[dict, int]:
        images = [image_bytes(*size)]
        before = executions()
        got = steps.call("preprocess", {"text_input": np.array([text.encode()], dtype=object),
                                        "images": np.array(images, dtype=object)}, outputs, request_id)
        want = pre(text, images, [])
        for name in outputs:
            np.testing.assert_array_equal(got[name], getattr(want, name))
        return got, executions() - before

    steps._seen.clear()
    got, runs = call((160, 120), "a")  # nothing seen yet: every output in the message
    assert runs == 1 and steps._leased["a"].locate(got["pixel_values"]) is None
    steps.release("a")
    got, runs = call((320, 240), "b")  # a slot for the largest seen, too small: Triton ran again
    assert runs == 2 and steps._leased["b"].locate(got["pixel_values"]) is not None
    assert steps._leased["b"].locate(got["input_ids"]) is None  # small: in the message
    steps.release("b")
    got, runs = call((320, 240), "c")
    arena = steps._leased["c"]
    assert runs == 1 and arena.locate(got["pixel_values"]) is not None

    # the rows go on to the encoder from where they are: nothing new is allocated for them
    used = sum(arena.used)
    encoded = steps.call("vision_encoder", {"pixel_values": got["pixel_values"], "grid_thw": got["grid_thw"]},
                         ["embeddings"], "c")
    assert sum(arena.used) - used < got["pixel_values"].nbytes
    merge = ckpt_config["vision_config"]["spatial_merge_size"]
    assert encoded["embeddings"].shape[0] == got["pixel_values"].shape[0] // merge**2
    steps.release("c")
    assert not steps._leased


def test_a_step_error_keeps_its_code(steps):
    from triton_vlm.pipeline import StepFailed

    with pytest.raises(StepFailed) as failed:
        steps.call("vision_encoder", {"pixel_values": np.zeros((4, 5), dtype=np.float32),
                                      "grid_thw": np.array([[1, 2, 2]], dtype=np.int64)}, ["embeddings"], "shm-2")
    steps.release("shm-2")
    assert failed.value.error.code == "INVALID_ARG" and "pixel_values" in failed.value.error.message
