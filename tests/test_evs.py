"""Issue #17: EVS video pruning (`video_pruning_rate`) for Qwen2.5-VL, against oracles run here.

- The mask: transformers' own `compute_retention_mask` (models/nemotron_h_omni), applied to the
  Hugging Face Qwen2.5-VL tower's embeddings of the same pixels; our server's `vision_encoder`
  must keep the same rows, and `preprocess` must write as many placeholders as the mask keeps.
- The positions: transformers has no rule for pruned videos, so the reference's (vLLM
  `compute_mrope_for_media` + `recompute_mrope_positions`, whole prompt at once) is ported below.
  One difference is kept on purpose: vLLM truncates `second_per_grid_ts` to an integer in its
  pruned path; the issue asks for the unpruned coordinates, so the port keeps the float. The
  videos here are sampled at whole seconds per temporal patch, where the two agree.
- End to end: HF's tower, the mask, then HF's forward with `inputs_embeds` and explicit 3-D
  `position_ids`, greedy, against our server's tokens.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.test_e2e import chat, infer_direct, media_values
from triton_vlm.clients.client import generate
from triton_vlm.errors import InvalidInput
from triton_vlm.families.qwen2_5_vl import QWEN2_5_VL
from triton_vlm.media import samples
from triton_vlm.media.evs import retained_tokens
from triton_vlm.media.mrope import MediaSpan, complete_positions, pruned_mrope_positions

IMG, VID = QWEN2_5_VL.image_placeholder, QWEN2_5_VL.video_placeholder
RATES = (0.25, 0.5, 0.9)
# 2 frames at 2 fps: one temporal patch; 8: four; 31: fps sampling keeps 30 (15 patches), and
# without sampling the odd count is padded to 32 (16 patches) as the processor pads it.
FRAMES = (2, 8, 31)
NEW_TOKENS = 12


def _video(frames: int) -> bytes:
    return samples.video_bytes(seconds=frames / 2, fps=2, width=160, height=120)


def oracle_mask(embeddings: np.ndarray, grid: np.ndarray, q: float) -> np.ndarray:
    """transformers' `compute_retention_mask` on one video's merged rows (grid before the merge).
    The grid goes in as Python ints, as vLLM passes it, so the kept count is computed in float64."""
    from transformers.models.nemotron_h_omni.modeling_nemotron_h_omni import compute_retention_mask

    thw = tuple(int(v) for v in grid)
    return compute_retention_mask(video_embeds=torch.from_numpy(embeddings), thw=thw, spatial_merge_size=2,
                                  q=q).numpy()


def _rows(grid: np.ndarray) -> list[int]:
    return [int(t * h * w) // 4 for t, h, w in grid]


# ---------------------------------------------------------------------------------------- the reference's positions

def reference_pruned_positions(input_ids: np.ndarray, media: list[np.ndarray], config: dict) -> tuple[np.ndarray, int]:
    """vLLM's `recompute_mrope_positions` for a whole prompt (num_computed_tokens 0): `media` holds
    each item's kept rows of `compute_mrope_for_media` ([4, K]: t, h, w, grid_w), prompt order."""
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    n = ids.numel()
    positions = torch.arange(n).expand(3, n).clone()  # the text before the first item is all that stays
    text_mask = ~(ids.eq(config["image_token_id"]) | ids.eq(config["video_token_id"]))
    starts = (ids == config["vision_start_token_id"]).nonzero(as_tuple=True)[0]
    for mm_pos, start in zip(media, starts):
        mm_pos = torch.as_tensor(mm_pos)
        base = positions[-1, start] + 1
        local_start = start + 1
        local_end = local_start + mm_pos.shape[1]
        positions[:, local_start:local_end] = mm_pos[0:3] + base
        offset = mm_pos[3, 0] + base
        positions[:, local_end:n] = torch.cumsum(text_mask[local_end:].long(), dim=0) + offset - 1
    return positions.numpy(), int(positions.max() + 1 - n)


def reference_media_positions(grid: np.ndarray, t_factor: float) -> np.ndarray:
    """vLLM's `compute_mrope_for_media` ([4, T*H'*W']: t, h, w and grid_w), merge 2."""
    t, h, w = int(grid[0]), int(grid[1]) // 2, int(grid[2]) // 2
    t_index = (torch.arange(t).view(-1, 1).expand(-1, h * w) * t_factor).long().flatten()
    h_index = torch.arange(h).view(1, -1, 1).expand(t, -1, w).flatten()
    w_index = torch.arange(w).view(1, 1, -1).expand(t, h, -1).flatten()
    return torch.stack([t_index, h_index, w_index, torch.full_like(t_index, w)]).numpy()


def test_pruned_positions_equal_the_reference(ckpt_config):
    """preprocess's positions with pruning on, completed with any kept set, are the reference's:
    an image taller than wide (text after it at base + W', not max + 1), a long video whose
    temporal positions pass the text after it, text between and after."""
    rng = np.random.default_rng(0)
    tps = ckpt_config["vision_config"]["tokens_per_second"]
    items = [(np.array([1, 12, 6]), 1.0, False), (np.array([20, 4, 8]), 1.0 * tps, True),
             (np.array([4, 6, 6]), 2.0 * tps, True)]
    ids, spans, media, kept_all = [100, 101], [], [], []
    for grid, t_factor, video in items:
        t, h, w = int(grid[0]), int(grid[1]) // 2, int(grid[2]) // 2
        k = retained_tokens(t, h * w, 0.6) if video else t * h * w
        kept = np.sort(rng.choice(t * h * w, size=k, replace=False))
        ids += [ckpt_config["vision_start_token_id"]]
        spans.append(MediaSpan(len(ids), t, h, w, t_factor, tokens=None if k == t * h * w else k))
        ids += [ckpt_config["video_token_id" if video else "image_token_id"]] * k + [102, 103]
        media.append(reference_media_positions(grid, t_factor)[:, kept])
        kept_all.append(kept + sum(s.grid_size for s in spans[:-1]))
    ids = np.array(ids + [104, 105, 106])
    positions, _, table = pruned_mrope_positions(len(ids), spans)
    mask = np.isin(ids, (ckpt_config["image_token_id"], ckpt_config["video_token_id"]))
    ours, delta = complete_positions(positions, mask, table, np.concatenate(kept_all))
    want, want_delta = reference_pruned_positions(ids, media, ckpt_config)
    np.testing.assert_array_equal(ours, want)
    assert delta == want_delta
    assert table[0].max() > ours[:, -1].max()  # the long video's last frame lies past the final text


# ---------------------------------------------------------------------------------------- the mask, counts

@pytest.fixture(scope="module")
def unsampled(hf):
    """Per frame count: HF video processor rows and grid of every frame (no sampling: the odd count
    padded), and the HF tower's embeddings."""
    from tests.oracle import decode_frames

    table = {}
    for n in FRAMES:
        frames, metadata = decode_frames(_video(n))
        out = hf.processor.video_processor(videos=[frames], video_metadata=[metadata], do_sample_frames=False,
                                           return_tensors="pt")
        pixels, grid = out["pixel_values_videos"].numpy(), out["video_grid_thw"].numpy().astype(np.int64)
        table[n] = (pixels, grid, hf.vision(pixels, grid))
    return table


@pytest.mark.parametrize("frames", FRAMES)
@pytest.mark.parametrize("q", RATES)
def test_encoder_keeps_the_oracles_rows(server, unsampled, frames, q):
    pixels, grid, hf_embeddings = unsampled[frames]
    assert grid[0, 0] == -(-frames // 2)
    want = oracle_mask(hf_embeddings, grid[0], q)
    values = {"pixel_values": (pixels, "FP32"), "grid_thw": (grid, "INT64"),
              "video_pruning_rate": (np.array([q], np.float64), "FP64")}
    out = infer_direct(server, "vision_encoder", values, ["embeddings", "kept_rows"])
    np.testing.assert_array_equal(out["kept_rows"], np.flatnonzero(want))
    full = infer_direct(server, "vision_encoder", {k: values[k] for k in ("pixel_values", "grid_thw")},
                        ["embeddings", "kept_rows"])
    np.testing.assert_array_equal(full["kept_rows"], np.arange(hf_embeddings.shape[0]))
    np.testing.assert_array_equal(out["embeddings"], full["embeddings"][want])


@pytest.mark.parametrize("frames", FRAMES)
@pytest.mark.parametrize("q", RATES)
def test_preprocess_writes_the_oracles_count(server, hf, frames, q):
    """As many video placeholders as the oracle keeps of HF's own sampled video; the rest of the
    prompt is HF's."""
    prompt = chat(VID + "What moves?")
    inputs = hf.inputs(prompt, [], [_video(frames)])
    grid = inputs["video_grid_thw"].numpy()
    hf_embeddings = hf.vision(inputs["pixel_values_videos"].numpy(), grid)
    kept = int(oracle_mask(hf_embeddings, grid[0], q).sum())
    values = {**media_values(prompt, [], [_video(frames)]), "mm_options": _options(q)}
    out = infer_direct(server, "preprocess", values, ["input_ids", "grid_thw", "video_pruning_rate"])
    hf_ids = inputs["input_ids"][0].numpy()
    video = hf.processor.video_token_id
    assert int((out["input_ids"] == video).sum()) == kept == retained_tokens(int(grid[0, 0]), _rows(grid)[0] //
                                                                               int(grid[0, 0]), q)
    np.testing.assert_array_equal(out["input_ids"][out["input_ids"] != video], hf_ids[hf_ids != video])
    np.testing.assert_array_equal(out["grid_thw"], grid)
    assert out["video_pruning_rate"][0] == q


def _options(q: float):
    import json

    return (np.array([json.dumps({"video_pruning_rate": q}).encode()], np.object_), "BYTES")


# ---------------------------------------------------------------------------------------- end to end

IMAGE_TALL = samples.image_bytes(120, 200, seed=2.0)
E2E = {
    "video": (chat(VID + "What moves?"), [], [_video(8)]),
    # 40 frames at 2 fps: 20 temporal patches, positions past the text after the video
    "long video": (chat(VID + "What moves?"), [], [samples.video_bytes(seconds=20, fps=2, width=112, height=84)]),
    "image+video": (chat(IMG + "and" + VID + "compare."), [IMAGE_TALL], [_video(8)]),
}


@torch.no_grad()
def oracle_pruned_tokens(hf, ckpt_config, prompt: str, images, videos, q: float) -> list[int]:
    """HF's tower, the oracle's mask per video, the reference's positions, then HF's forward
    (`inputs_embeds`, 3-D `position_ids`), greedy, one full forward per new token."""
    inputs = hf.inputs(prompt, images, videos)
    model, ids = hf.model, inputs["input_ids"][0].numpy()
    image_token, video_token = ckpt_config["image_token_id"], ckpt_config["video_token_id"]
    rows, media, keep_ids = [], [], np.ones(ids.shape[0], bool)
    kinds = {"image": ("pixel_values", "image_grid_thw"), "video": ("pixel_values_videos", "video_grid_thw")}
    per_kind = {}
    for kind, (pixel_key, grid_key) in kinds.items():
        if grid_key in inputs:
            grid = inputs[grid_key].numpy()
            emb = hf.vision(inputs[pixel_key].numpy(), grid)
            per_kind[kind] = list(zip(grid, np.split(emb, np.cumsum(_rows(grid))[:-1])))
    second_per_grid = iter(inputs.get("second_per_grid_ts", []))
    tps = ckpt_config["vision_config"]["tokens_per_second"]
    runs = np.flatnonzero(np.isin(ids, (image_token, video_token)) & ~np.isin(np.roll(ids, 1), (image_token, video_token)))
    for start in runs:
        kind = "video" if ids[start] == video_token else "image"
        grid, emb = per_kind[kind].pop(0)
        t_factor = float(next(second_per_grid)) * tps if kind == "video" else 1.0
        mask = oracle_mask(emb, grid, q) if kind == "video" else np.ones(emb.shape[0], bool)
        keep_ids[start:start + emb.shape[0]] = mask
        rows.append(emb[mask])
        media.append(reference_media_positions(grid, t_factor)[:, mask])
    ids = ids[keep_ids]
    positions, delta = reference_pruned_positions(ids, media, ckpt_config)
    embeds = model.get_input_embeddings()(torch.as_tensor(ids)[None]).clone()
    embeds[0, torch.as_tensor(np.isin(ids, (image_token, video_token)))] = torch.from_numpy(np.concatenate(rows))
    position_ids = torch.as_tensor(positions)[:, None]
    eos = set(hf.processor.tokenizer.convert_tokens_to_ids(list(QWEN2_5_VL.prompt.eos_tokens)))
    tokens = []
    for _ in range(NEW_TOKENS):
        logits = model(inputs_embeds=embeds, position_ids=position_ids).logits[0, -1]
        token = int(logits.argmax())
        tokens.append(token)
        if token in eos:
            break
        embeds = torch.cat([embeds, model.get_input_embeddings()(torch.tensor([[token]]))], dim=1)
        step = position_ids.shape[-1] + delta
        position_ids = torch.cat([position_ids, torch.full((3, 1, 1), step)], dim=-1)
    return tokens


@pytest.mark.parametrize("q", (0.5, 0.9))
@pytest.mark.parametrize("kind", E2E)
def test_greedy_tokens_equal_the_oracle(server, hf, ckpt_config, kind, q):
    prompt, images, videos = E2E[kind]
    want = oracle_pruned_tokens(hf, ckpt_config, prompt, images, videos, q)
    got = generate(server.grpc_url, prompt, images, videos, max_tokens=NEW_TOKENS, stream=True,
                   mm_options={"video_pruning_rate": q})
    assert got.output_ids == want


@pytest.mark.parametrize("kind", E2E)
def test_rate_zero_is_todays_output(server, hf, kind):
    """q = 0 given explicitly: the tokens and the preprocess outputs of a request without it, and
    HF `generate`'s tokens."""
    prompt, images, videos = E2E[kind]
    names = ["input_ids", "pixel_values", "grid_thw", "mrope_position_ids", "mrope_position_delta"]
    plain = infer_direct(server, "preprocess", media_values(prompt, images, videos), names)
    zero = infer_direct(server, "preprocess", {**media_values(prompt, images, videos), "mm_options": _options(0.0)},
                        names)
    for name in names:
        np.testing.assert_array_equal(zero[name], plain[name])
    want = hf.generate(hf.inputs(prompt, images, videos), NEW_TOKENS)
    for options in (None, {"video_pruning_rate": 0.0}):
        assert generate(server.grpc_url, prompt, images, videos, max_tokens=NEW_TOKENS,
                        mm_options=options).output_ids == want


# ---------------------------------------------------------------------------------------- options

def test_build_default_reaches_preprocess(tiny_checkpoint, tmp_path):
    import json

    from triton_vlm.contract.params import PreprocessOptions
    from triton_vlm.families import detect_family
    from triton_vlm.preprocessing.preprocessor import Preprocessor
    from triton_vlm.repository.configs import model_configs
    from triton_vlm.tools.cli import build_options, parser

    args = parser().parse_args(["build", "--checkpoint", str(tiny_checkpoint), "--repo", "r",
                                "--video-pruning-rate", "0.5"])
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    params = model_configs(detect_family(tiny_checkpoint), config, build_options(args))["preprocess"].parameters
    options = PreprocessOptions.from_params({k: v.string_value for k, v in params.items()})
    assert options.video_pruning_rate == 0.5
    pre = Preprocessor(tiny_checkpoint, options=options)
    video = _video(8)
    default = pre(VID, [], [video])
    assert default.video_pruning_rate == 0.5
    np.testing.assert_array_equal(default.input_ids, pre(VID, [], [video], {"video_pruning_rate": 0.5}).input_ids)
    assert pre(VID, [], [video], {"video_pruning_rate": 0}).media_position_ids.shape == (3, 0)
    for bad in (1.0, -0.1, "0.5", True):
        with pytest.raises(InvalidInput, match=r"^mm_options: video_pruning_rate must be a number in \[0, 1\)"):
            pre(VID, [], [video], {"video_pruning_rate": bad})


@pytest.fixture(scope="module")
def glm_checkpoint(tmp_path_factory):
    from triton_vlm.families.demo import write_demo_checkpoint

    return write_demo_checkpoint("glm4v", tmp_path_factory.mktemp("glm4v"), "tiny")


def test_other_families_refuse_it(glm_checkpoint, tmp_path):
    from triton_vlm.contract.params import PreprocessOptions
    from triton_vlm.preprocessing.preprocessor import Preprocessor
    from triton_vlm.repository.build import build_repository
    from triton_vlm.repository.options import BuildOptions

    pre = Preprocessor(glm_checkpoint)
    with pytest.raises(InvalidInput, match=r"^mm_options: video_pruning_rate does not apply: glm4v"):
        pre("<|begin_of_video|><|video|><|end_of_video|>", [], [_video(8)], {"video_pruning_rate": 0.5})
    with pytest.raises(ValueError, match=r"^--video-pruning-rate does not apply: glm4v"):
        build_repository(glm_checkpoint, tmp_path / "repo", BuildOptions(video_pruning_rate=0.5))
    with pytest.raises(ValueError, match="video_pruning_rate does not apply"):
        Preprocessor(glm_checkpoint, options=PreprocessOptions(video_pruning_rate=0.5))
