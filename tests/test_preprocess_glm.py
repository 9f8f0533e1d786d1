"""GLM-4.1V, GLM-4.6V-Flash, GLMGA, GLM-OCR and GLM-4.5V `preprocess` against transformers, computed
in the same run. GLM-OCR and GLM-4.5V use GLM-4.6V's and GLM-4.1V's processor rules: they get the
image, video and mixed cases and the sampler checks.

Oracles:
- token ids (timestamps included), grids, pixel values: `AutoProcessor.from_pretrained(ckpt)` of
  each tiny demo checkpoint (`Glm4vProcessor` / `Glm46VProcessor` with the torchvision-backend
  image and video processors); videos decoded with PyAV and passed as frames + `VideoMetadata`,
  sampled by the video processor's own `sample_frames` at its own default rate;
- positions and delta: `model.model.get_rope_index` of the HF model built from the same checkpoint;
- frame indices: the video processors' `sample_frames`, and a direct port of the reference's
  (vLLM glm4_1v.py) `_get_video_second_idx_*` below. Where the reference and transformers
  disagree (noted in the tests) the code follows transformers.
"""
from __future__ import annotations

import ast
import math
import re
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from tests.oracle import Oracle, rows_in_prompt_order
from triton_vlm.contract.limits import Limits
from triton_vlm.errors import InvalidInput
from triton_vlm.families import get_family
from triton_vlm.families.glm4v import GLM4V
from triton_vlm.families.glm4v.processor import resize_rule, sample_frames_glm4v
from triton_vlm.media import samples
from triton_vlm.media.sizing import VisionSettings
from triton_vlm.media.videos import VideoMetadata, video_facts
from triton_vlm.preprocessing.items import bind_sampler
from triton_vlm.preprocessing.preprocessor import Preprocessor

VARIANTS = ("glm4v", "glm46v", "glmga")
ALL_VARIANTS = VARIANTS + ("glm_ocr", "glm4v_moe")
IMG, VID = GLM4V.image_placeholder, GLM4V.video_placeholder
PIXEL_TOL = 1e-4


def chat(content: str) -> str:
    return f"[gMASK]<sop><|user|>\n{content}<|assistant|>\n"


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    """variant -> (Preprocessor, Oracle) of its tiny demo checkpoint, built on first use."""
    from triton_vlm.families.demo import write_demo_checkpoint

    built = {}

    def get(variant: str) -> tuple[Preprocessor, Oracle]:
        if variant not in built:
            ckpt = write_demo_checkpoint(variant, tmp_path_factory.mktemp(f"{variant}-tiny"), "tiny")
            built[variant] = Preprocessor(ckpt), Oracle(ckpt)
        return built[variant]
    return get


@cache
def video(seconds: float, fps: int, width: int = 64, height: int = 48) -> bytes:
    return samples.video_bytes(seconds=seconds, fps=fps, width=width, height=height)


@cache
def image(width: int, height: int, fmt: str = "JPEG") -> bytes:
    return samples.image_bytes(width, height, fmt=fmt, seed=width / 7)


def bound_sampler(pre: Preprocessor):
    """The frame sampler `pre` uses for a request without options."""
    return bind_sampler(pre.family.processor.sample_frames, pre.video_sampling, pre.video_settings)


def even(indices) -> list[int]:
    """transformers' even frame count: the last index again when the count is odd."""
    indices = [int(i) for i in indices]
    return indices + indices[-1:] if len(indices) % 2 else indices


# ------------------------------------------------------------------------------ against the processor

def hf_in_prompt_order(text: str, out) -> tuple[np.ndarray, np.ndarray]:
    """The HF processor's pixel rows and grids (images and videos kept apart) in prompt order."""
    return rows_in_prompt_order(re.findall(r"<\|(image|video)\|>", text), out)


def check_against_hf(pre: Preprocessor, hf: Oracle, text: str, images=(), videos=(), mm_options=None,
                     fps: float | None = None):
    ours = pre(text, list(images), list(videos), mm_options)
    out = hf.inputs(text, list(images), list(videos), fps=fps)
    np.testing.assert_array_equal(ours.input_ids, out["input_ids"][0].numpy())
    pixel_values, grid_thw = hf_in_prompt_order(text, out)
    np.testing.assert_array_equal(ours.grid_thw, grid_thw)
    np.testing.assert_allclose(ours.pixel_values, pixel_values, rtol=0, atol=PIXEL_TOL)
    positions, delta = hf.rope_index(out)
    np.testing.assert_array_equal(ours.mrope_position_ids, positions)
    assert ours.mrope_position_delta == delta
    return ours, out


# name -> (prompt content, images, videos per variant); sources at low frame rates and small sizes.
ODD = {"glm4v": (2.5, 6), "glm46v": (2.5, 6), "glmga": (1.5, 5)}  # an odd number of distinct frames
CASES = {
    "image": lambda v: (IMG + "What is this?", [image(100, 70)], []),
    "video_4s": lambda v: (VID + "What moves?", [], [video(4, 5, 160, 120)]),
    "video_45s": lambda v: (VID + "What moves?", [], [video(45, 4)]),
    "video_400s": lambda v: (VID + "What moves?", [], [video(400, 1)]),
    "video_odd_frames": lambda v: (VID + "What moves?", [], [video(*ODD[v])]),
    "image_and_video": lambda v: (IMG + "and" + VID + "then" + IMG, [image(100, 70), image(20, 90, "PNG")],
                                  [video(4, 5)]),
}


@pytest.mark.parametrize("variant,case", [(v, c) for v in VARIANTS for c in CASES] + [
    (v, c) for v in ALL_VARIANTS[len(VARIANTS):] for c in ("image", "video_4s", "image_and_video")])
def test_matches_transformers(glm, variant, case):
    pre, hf = glm(variant)
    content, images, videos = CASES[case](variant)
    ours, _ = check_against_hf(pre, hf, chat(content), images, videos)
    assert ours.grid_thw.shape[0] == len(images) + len(videos)


@pytest.mark.parametrize("variant", ["glm4v", "glmga"])
def test_request_fps_matches_transformers(glm, variant):
    """GLM-4.1V and GLMGA sample at a requested fps as their processors do (GLM-4.6V ignores it)."""
    pre, hf = glm(variant)
    ours, _ = check_against_hf(pre, hf, chat(VID), videos=[video(4, 5)], mm_options={"fps": 1}, fps=1.0)
    default = pre(chat(VID), [], [video(4, 5)])
    assert ours.grid_thw[0, 0] < default.grid_thw[0, 0]


def test_odd_frame_case_is_odd(glm):
    """The odd case really has an odd number of distinct frames (the last temporal patch repeats one)."""
    for variant, spec in ODD.items():
        pre, _ = glm(variant)
        meta = VideoMetadata(total_num_frames=int(spec[0] * spec[1]), fps=float(spec[1]), width=64, height=48,
                             duration=spec[0])
        assert len(bound_sampler(pre)(meta)) % 2 == 1, variant


# ------------------------------------------------------------------------------ frame sampling

# (total frames, fps, duration or None): boundaries of each rule (30 s, 300 s, 2400 s, 640 frames),
# fractional and low rates, a duration that is not frames / fps, one frame.
METADATA = [
    (1, 5.0, 0.2), (2, 30.0, 2 / 30), (7, 3.0, 7 / 3), (20, 5.0, 4.0), (20, 5.0, 4.3), (20, 5.0, None),
    (30, 10.0, 3.0), (45, 30000 / 1001, 45 * 1001 / 30000), (120, 4.0, 30.0), (124, 4.0, 31.0),
    (299, 29.97, 299 / 29.97), (1200, 4.0, 300.0), (1204, 4.0, 301.0), (3100, 10.0, 310.0), (400, 1.0, 400.0),
    (2400, 1.0, 2400.0), (30000, 10.0, 3000.0), (2000, 0.5, 4000.0), (90, 2.0, 45.0), (8, 0.25, 32.0),
]


def hf_metadata(total, fps, duration):
    from transformers.video_utils import VideoMetadata as HFVideoMetadata

    return HFVideoMetadata(total_num_frames=total, fps=fps, duration=duration)


@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_sampler_matches_transformers(glm, variant):
    pre, hf = glm(variant)
    sampler, processor = bound_sampler(pre), hf.processor.video_processor
    for total, fps, duration in METADATA:
        want = processor.sample_frames(hf_metadata(total, fps, duration)).tolist()
        ours = sampler({"total_num_frames": total, "fps": fps, "duration": duration}).tolist()
        # Where transformers samples nothing (and then fails), the first frame is kept.
        assert even(ours) == want if want else ours == [0], (total, fps, duration)


@pytest.mark.parametrize("variant", ["glm46v", "glmga"])
def test_short_clip_keeps_first_frame(glm, variant):
    """Where transformers samples no frame at all (a clip shorter than one step), the first is kept."""
    pre, hf = glm(variant)
    meta = (1, 30.0, 1 / 30)
    assert hf.processor.video_processor.sample_frames(hf_metadata(*meta)).tolist() == []
    assert bound_sampler(pre)(dict(zip(("total_num_frames", "fps", "duration"), meta))).tolist() == [0]


# Direct port of the reference (vLLM glm4_1v.py `Glm4vProcessingInfo._get_video_second_idx_*`),
# returning the frame indices it settles on as well as its timestamps. `processor` holds the video
# processor attributes the reference reads (fps, max_duration, temporal_patch_size, max_frames).
def _dedupe_even(frame_indices):
    seen, uniq = set(), []
    for idx in frame_indices:
        if idx not in seen:
            seen.add(idx)
            uniq.append(idx)
    if len(uniq) & 1:
        uniq.append(uniq[-1])
    return uniq


def _second_idx(frame_indices, video_fps):
    frame_indices = _dedupe_even(frame_indices)
    full_second_idxs = [int(idx / video_fps) for idx in frame_indices]
    return frame_indices, full_second_idxs[::2]


def ref_glm4v(metadata, total_frames, processor):
    video_fps = metadata.get("fps", processor["fps"])
    meta_frames = metadata.get("total_num_frames", total_frames)
    max_frame_idx = meta_frames - 1
    duration = metadata.get("duration", round(max_frame_idx / video_fps) + 1)
    if duration <= processor["max_duration"]:
        n = int(math.floor(duration * processor["fps"]))
        frame_indices = [min(max_frame_idx, int(math.ceil(i * video_fps / processor["fps"]))) for i in range(n)]
    else:
        num_samples = int(processor["max_duration"] * processor["fps"])
        if num_samples >= meta_frames:
            frame_indices = list(range(meta_frames))
        else:
            target_seconds = np.linspace(0, duration, num_samples, endpoint=True)
            frame_indices = [min(max_frame_idx, int(math.ceil(t * video_fps))) for t in target_seconds]
    return _second_idx(frame_indices, video_fps)


def ref_glm46v(metadata, total_frames, processor):
    video_fps = metadata["fps"]
    meta_frames = metadata.get("total_num_frames", total_frames)
    max_frame_idx = meta_frames - 1
    duration = metadata.get("duration", round(max_frame_idx / video_fps) + 1)
    dynamic_fps_thres = {30: 3, 300: 1, 2400: 0.5}
    effective_duration = min(duration, 2400)
    if effective_duration <= 30:
        target_fps = dynamic_fps_thres[30]
    elif effective_duration <= 300:
        target_fps = dynamic_fps_thres[300]
    else:
        target_fps = dynamic_fps_thres[2400]
    temporal_patch_size = processor.get("temporal_patch_size", 1)
    extract_t = int(effective_duration * target_fps * temporal_patch_size)
    extract_t = min(extract_t, 640)
    duration_per_frame = 1 / video_fps
    timestamps = [i * duration_per_frame for i in range(meta_frames)]
    max_second = int(duration)
    if meta_frames < extract_t:
        frame_indices = np.linspace(0, meta_frames - 1, extract_t, dtype=int).tolist()
    else:
        frame_indices = []
        current_second = 0.0
        inv_fps = 1 / (temporal_patch_size * target_fps)
        for frame_index in range(meta_frames):
            if timestamps[frame_index] >= current_second:
                current_second += inv_fps
                frame_indices.append(frame_index)
                if current_second >= max_second:
                    break
    if len(frame_indices) < extract_t:
        if len(frame_indices) == 0:
            start, end = 0, max(meta_frames - 1, 0)
        else:
            start, end = frame_indices[0], frame_indices[-1]
        frame_indices = np.linspace(start, end, extract_t, dtype=int).tolist()
    elif len(frame_indices) > extract_t:
        frame_indices = np.linspace(0, meta_frames - 1, extract_t, dtype=int).tolist()
    return _second_idx(frame_indices, video_fps)


def ref_glmga(metadata, total_frames, processor):
    video_fps = metadata["fps"]
    meta_frames = metadata.get("total_num_frames", total_frames)
    max_frame_idx = meta_frames - 1
    duration = metadata.get("duration", round(max_frame_idx / video_fps) + 1)
    target_fps = 2
    max_frames = processor.get("max_frames", 640)
    extract_t = int(duration * target_fps)
    extract_t = min(extract_t, max_frames)
    duration_per_frame = 1 / video_fps
    timestamps = [i * duration_per_frame for i in range(meta_frames)]
    if meta_frames < extract_t:
        frame_indices = [math.floor(i * meta_frames / extract_t) for i in range(extract_t)]
    else:
        frame_indices = []
        current_second = 0.0
        inv_fps = 1 / target_fps
        for frame_index in range(meta_frames):
            if timestamps[frame_index] >= current_second:
                current_second += inv_fps
                frame_indices.append(frame_index)
                if current_second >= duration - inv_fps:
                    break
    if len(frame_indices) < extract_t:
        if len(frame_indices) == 0:
            start, end = 0, max(meta_frames - 1, 0)
        else:
            start, end = frame_indices[0], frame_indices[-1]
        frame_indices = np.linspace(start, end, extract_t, dtype=int).tolist()
    elif len(frame_indices) > extract_t:
        frame_indices = np.linspace(0, meta_frames - 1, extract_t, dtype=int).tolist()
    return _second_idx(frame_indices, video_fps)


REFERENCE = {"glm4v": ref_glm4v, "glm46v": ref_glm46v, "glmga": ref_glmga}


@pytest.mark.parametrize("variant", VARIANTS)
def test_sampler_matches_reference(glm, variant):
    pre, hf = glm(variant)
    processor = hf.processor.video_processor.to_dict()
    sampler = bound_sampler(pre)
    for total, fps, duration in METADATA:
        meta = {"total_num_frames": total, "fps": fps}
        if duration is not None:
            meta["duration"] = duration
        ref_indices, ref_seconds = REFERENCE[variant](meta, total, processor)
        ours = sampler(meta)
        if not ref_indices:
            # The reference samples nothing from a clip shorter than one step: its GLM-4.1V rule lacks
            # transformers' "at least one frame" (transformers: [0, 0]), and for the others transformers
            # samples nothing either. Followed here: transformers, and the first frame where it fails.
            assert ours.tolist() == [0], (total, fps, duration)
            continue
        assert even(ours) == ref_indices, (total, fps, duration)
        # The reference's timestamps are whole seconds; transformers' (followed here) are the frames'
        # own times, so they agree once truncated.
        assert ref_seconds == [int(s) for s in (ours / fps)[::2]]


def test_reference_timestamp_text_differs_from_transformers(glm):
    """For GLM-4.6V / GLMGA the reference formats whole seconds ("0.0 seconds" for a frame at 0.4 s);
    transformers formats the frame's own time ("0.4 seconds"), and the code follows transformers."""
    pre, hf = glm("glm46v")
    text = chat(VID)
    out = hf.inputs(text, videos=[video(4, 5)], fps=None)
    decoded = hf.processor.tokenizer.decode(out["input_ids"][0])
    _, ref_seconds = ref_glm46v({"total_num_frames": 20, "fps": 5.0, "duration": 4.0}, 20,
                                hf.processor.video_processor.to_dict())
    assert "0.4 seconds" in decoded and f"{ref_seconds[1]:.1f} seconds" == "0.0 seconds"
    np.testing.assert_array_equal(pre(text, [], [video(4, 5)]).input_ids, out["input_ids"][0].numpy())


# ------------------------------------------------------------------------------ resizing

@pytest.mark.parametrize("expand", [1, 2])
def test_resize_rule_matches_transformers(expand):
    """The family's rule against transformers' GLM `smart_resize` (frames padded to the temporal patch
    size; an image counts as one temporal patch; GLMGA's patch_expand_factor widens the factor)."""
    from transformers.models.glm4v.image_processing_glm4v import smart_resize

    settings = VisionSettings(min_pixels=112 * 112, max_pixels=2 * 64 * 28 * 28, patch_expand_factor=expand)
    for height, width in ((48, 64), (120, 160), (20, 90), (10, 1900), (1080, 1920), (333, 517), (27, 27)):
        for frames in (1, 2, 3, 8, 9, 90, 640):
            want = smart_resize(num_frames=max(2, frames + frames % 2), height=height, width=width,
                                temporal_factor=2, factor=28 * expand, min_pixels=settings.min_pixels,
                                max_pixels=settings.max_pixels)
            assert resize_rule(height, width, settings, frames, "x") == want, (height, width, frames)
    with pytest.raises(InvalidInput, match="aspect ratio"):
        resize_rule(28, 28 * 201, settings, 2, "images[0]")


# ------------------------------------------------------------------------------ the review's risks

@pytest.mark.parametrize("variant", VARIANTS)
def test_fps_zero_or_missing(glm, variant):
    """fps 0, missing or not finite is derived from frames / duration; with no duration either, a
    clear InvalidInput, never ZeroDivisionError."""
    sampler = bound_sampler(glm(variant)[0])
    want = sampler({"total_num_frames": 20, "fps": 5.0, "duration": 4.0}).tolist()
    for fps in (0, 0.0, None, float("nan"), float("inf"), -5.0):
        assert sampler({"total_num_frames": 20, "fps": fps, "duration": 4.0}).tolist() == want, fps
    assert sampler({"total_num_frames": 20, "duration": 4.0}).tolist() == want
    for meta in ({"total_num_frames": 20, "fps": 0}, {"total_num_frames": 20}, {"total_num_frames": 0, "fps": 5.0},
                 {"fps": 5.0, "duration": 4.0}):
        with pytest.raises(InvalidInput):
            sampler(meta)


@pytest.mark.parametrize("variant", VARIANTS)
def test_metadata_extra_keys(glm, variant):
    """Metadata with keys the rule does not know (the reference's TypeError) samples as without them."""
    sampler = bound_sampler(glm(variant)[0])
    plain = VideoMetadata(total_num_frames=90, fps=2.0, width=64, height=48, duration=45.0)
    extra = {"total_num_frames": 90, "fps": 2.0, "duration": 45.0, "width": 64, "height": 48,
             "timestamps": [0.0, 0.5], "do_sample_frames": True, "video_backend": "pyav", "frames_indices": None}
    np.testing.assert_array_equal(sampler(extra), sampler(plain))


def test_video_facts_reads_objects_and_mappings():
    meta = VideoMetadata(total_num_frames=20, fps=5.0, width=64, height=48, duration=4.0)
    assert video_facts(meta) == video_facts({"total_num_frames": 20, "fps": 5.0, "duration": 4.0}) == (20, 5.0, 4.0)
    assert video_facts({"total_num_frames": 20, "fps": 5.0}) == (20, 5.0, 5)  # transformers' round(19 / 5) + 1


@pytest.mark.parametrize("variant", VARIANTS)
def test_videos_and_placeholders_out_of_step(glm, variant):
    """The request carries no metadata list (each video's comes from its own file); what can fall out
    of step is videos against placeholders, and that is a clear InvalidInput."""
    pre, _ = glm(variant)
    with pytest.raises(InvalidInput, match="2 video placeholders but 1 videos"):
        pre(chat(VID + VID), [], [video(4, 5)])
    with pytest.raises(InvalidInput, match="1 video placeholders but 2 videos"):
        pre(chat(VID), [], [video(4, 5), video(4, 5)])


@pytest.mark.parametrize("variant", VARIANTS)
def test_prompt_limit_counts_the_real_expansion(glm, variant, tmp_path):
    """The prompt-length limit sees every token a video becomes: per temporal patch the image tokens
    of the real grid, begin/end of image and the timestamp text; never an estimate below it."""
    pre, _ = glm(variant)
    text, videos = chat(VID + "What moves?"), [video(45, 4)]
    out = pre(text, [], videos)
    n = out.input_ids.shape[0]
    t, h, w = (int(x) for x in out.grid_thw[0])
    media_tokens = t * h * w // 4
    text_tokens = len(pre.tokenizer.encode(text).ids) - 1
    timestamp_tokens = n - text_tokens - media_tokens - 2 * t
    assert timestamp_tokens >= t  # at least one id per timestamp
    checkpoint = glm(variant)[1].checkpoint
    assert Preprocessor(checkpoint, Limits(max_prompt_tokens=n))(text, [], videos).input_ids.shape[0] == n
    with pytest.raises(InvalidInput, match=f"prompt is {n} tokens after expanding media, exceeds "
                                           f"max_prompt_tokens={n - 1}"):
        Preprocessor(checkpoint, Limits(max_prompt_tokens=n - 1))(text, [], videos)


@pytest.mark.parametrize("variant", VARIANTS)
def test_num_frames_option_is_invalid(glm, variant):
    """GLM samples by time: a frame count asked for is a clear error, not silently ignored."""
    pre, _ = glm(variant)
    with pytest.raises(InvalidInput, match="videos\\[0\\]: num_frames"):
        pre(chat(VID), [], [video(4, 5)], {"num_frames": 8})


def test_high_fps_is_bounded(glm):
    """GLM-4.1V enumerates duration * fps candidates; past the last frame they are all the same, so
    enumeration stops there (same indices as transformers), and an fps that would still make it
    endless fails fast with InvalidInput."""
    processor = glm("glm4v")[1].processor.video_processor
    for total, fps, duration, want_fps in ((20, 5.0, 4.0, 50.0), (20, 5.0, 250.0, 50.0), (600, 2.0, 300.0, 7.0)):
        meta = {"total_num_frames": total, "fps": fps, "duration": duration}
        want = processor.sample_frames(hf_metadata(total, fps, duration), fps=want_fps).tolist()
        assert even(sample_frames_glm4v(meta, fps=want_fps)) == want
    with pytest.raises(InvalidInput, match="fps=1e\\+12"):
        sample_frames_glm4v({"total_num_frames": 20, "fps": 5.0, "duration": 4.0}, fps=1e12)


def test_no_assert_in_request_path():
    """Request data never meets an `assert` (stripped under -O, and an AssertionError is no answer)."""
    import triton_vlm

    root = Path(triton_vlm.__file__).parent
    files = sorted((root / "preprocessing").rglob("*.py")) + sorted((root / "media").rglob("*.py"))
    files += sorted((root / "families").rglob("*.py")) + sorted((root / "contract").rglob("*.py"))
    for path in files:
        tree = ast.parse(path.read_text())
        asserts = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Assert)]
        assert not asserts, f"{path.name}: assert at line(s) {asserts}"


def test_variants_are_told_apart(glm):
    for variant in ALL_VARIANTS:
        assert glm(variant)[0].family is get_family(variant)


@pytest.mark.parametrize("variant", VARIANTS)
def test_sizes_default_to_the_processor_classes(variant, tmp_path):
    """A processor config without `size` gets the transformers processor class's own sizes."""
    import json

    from transformers import AutoImageProcessor, AutoVideoProcessor

    from triton_vlm.families.demo import write_demo_checkpoint

    ckpt = write_demo_checkpoint(variant, tmp_path / variant, "tiny")
    config = json.loads((ckpt / "processor_config.json").read_text())
    for section in ("image_processor", "video_processor"):
        config[section].pop("size")
    (ckpt / "processor_config.json").write_text(json.dumps(config))
    pre = Preprocessor(ckpt)
    for settings, processor in ((pre.image_settings, AutoImageProcessor.from_pretrained(ckpt)),
                                (pre.video_settings, AutoVideoProcessor.from_pretrained(ckpt))):
        assert (settings.min_pixels, settings.max_pixels) == (processor.size.shortest_edge, processor.size.longest_edge)
