"""transformers as the oracle: the same checkpoint through the Hugging Face processor and model."""
from __future__ import annotations

import io
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from transformers.video_utils import VideoMetadata


def decode_frames(video: bytes) -> tuple[np.ndarray, "VideoMetadata"]:
    """All frames and their metadata, decoded with PyAV the way transformers' pyav loader does."""
    import av
    from transformers.video_utils import VideoMetadata

    with av.open(io.BytesIO(video)) as container:
        stream = container.streams.video[0]
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(stream)])
        fps = float(stream.average_rate)
    metadata = VideoMetadata(total_num_frames=len(frames), fps=fps, duration=len(frames) / fps,
                             video_backend="pyav", height=frames.shape[1], width=frames.shape[2])
    return frames, metadata


def feature_rows(features) -> list[torch.Tensor]:
    """Each item's vision rows from `get_image_features` / `get_video_features`: its pooler output,
    followed by its DeepStack maps where the model gives them (the contract's `embedding_width`)."""
    maps = getattr(features, "deepstack_features", None) or ()
    return [torch.cat([item, *item_maps], dim=-1) if item_maps else item
            for item, *item_maps in zip(features.pooler_output, *maps)]


def rows_in_prompt_order(kinds: list[str], out) -> tuple[np.ndarray, np.ndarray]:
    """The HF processor's pixel rows and grids (images and videos kept apart in `out`) in the order
    of `kinds` ("image" or "video" per media item of the prompt), as the contract has them."""
    sources = {"image": ("pixel_values", "image_grid_thw"), "video": ("pixel_values_videos", "video_grid_thw")}
    done = {"image": (0, 0), "video": (0, 0)}
    rows, grids = [], []
    for kind in kinds:
        pixels_key, grid_key = sources[kind]
        item, row = done[kind]
        grid = out[grid_key][item]
        n = int(grid.prod())
        rows.append(out[pixels_key][row:row + n].numpy())
        grids.append(grid.numpy())
        done[kind] = (item + 1, row + n)
    return np.concatenate(rows), np.stack(grids)


class Oracle:
    def __init__(self, checkpoint: Path) -> None:
        self.checkpoint = Path(checkpoint)

    @cached_property
    def processor(self):
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(self.checkpoint)

    @cached_property
    def model(self):
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText.from_pretrained(self.checkpoint).eval()

    def inputs(self, prompt: str, images: list[bytes] = (), videos: list[bytes] = (),
               fps: float | None = 2.0, sample: bool = True, **kwargs) -> dict:
        """The HF processor's output: fps-2 sampling of every video, as our server does by default
        (`fps=None`: the video processor's own rate; `sample=False`: its own choice whether to sample,
        its config's `do_sample_frames`); `kwargs`: more processor options."""
        from PIL import Image

        if images:
            kwargs["images"] = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
        if videos:
            decoded = [decode_frames(v) for v in videos]
            kwargs.update(videos=[f for f, _ in decoded], video_metadata=[m for _, m in decoded])
            if sample:
                kwargs["do_sample_frames"] = True
            if fps is not None:
                kwargs["fps"] = fps
        return self.processor(text=[prompt], return_tensors="pt", **kwargs)

    def rope_index(self, inputs: dict) -> tuple[np.ndarray, int]:
        position_ids, deltas = self.model.model.get_rope_index(
            inputs["input_ids"], inputs["mm_token_type_ids"], image_grid_thw=inputs.get("image_grid_thw"),
            video_grid_thw=inputs.get("video_grid_thw"), second_per_grid_ts=inputs.get("second_per_grid_ts"))
        return position_ids[:, 0].numpy(), int(deltas[0, 0])

    @torch.no_grad()
    def vision(self, pixel_values: np.ndarray, grid_thw: np.ndarray) -> np.ndarray:
        out = self.model.model.visual(torch.from_numpy(pixel_values), grid_thw=torch.from_numpy(grid_thw))
        return out.pooler_output.numpy()

    @torch.no_grad()
    def generate(self, inputs: dict, max_new_tokens: int = 16) -> list[int]:
        out = self.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        return out[0, inputs["input_ids"].shape[1]:].tolist()


class EncoderOracle(Oracle):
    """Reference vision-tower outputs for named cases, `cases[name] = (image sizes, with_video)`:
    the checkpoint's own image / video processors, then `get_image_features` / `get_video_features`.
    A case gives (pixel_values rows, grid_thw, embeddings), images first, then a 4 s video.
    Subclasses say where a family keeps its grids and how its pixels become rows."""

    image_grid_key, video_grid_key = "image_grid_thw", "video_grid_thw"

    def __init__(self, checkpoint: Path, cases: dict) -> None:
        super().__init__(checkpoint)
        self.cases = cases
        self._cache: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def rows(self, pixel_values: torch.Tensor) -> np.ndarray:
        return pixel_values.numpy()

    def grid(self, grid: torch.Tensor) -> np.ndarray:
        return grid.numpy().astype(np.int64)

    @torch.no_grad()
    def __call__(self, case: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if case not in self._cache:
            from PIL import Image

            from triton_vlm.media import samples

            sizes, with_video = self.cases[case]
            pixels, grids, refs = [], [], []
            if sizes:
                images = [Image.open(io.BytesIO(samples.image_bytes(w, h, seed=float(i)))).convert("RGB")
                          for i, (w, h) in enumerate(sizes)]
                out = self.processor.image_processor(images=images, return_tensors="pt")
                feats = self.model.model.get_image_features(out["pixel_values"], out[self.image_grid_key])
                pixels.append(self.rows(out["pixel_values"]))
                grids.append(self.grid(out[self.image_grid_key]))
                refs.extend(feature_rows(feats))
            if with_video:
                frames, metadata = decode_frames(samples.video_bytes(seconds=4.0, fps=2))
                out = self.processor.video_processor(videos=[frames], video_metadata=[metadata], return_tensors="pt")
                feats = self.model.model.get_video_features(out["pixel_values_videos"], out[self.video_grid_key])
                pixels.append(self.rows(out["pixel_values_videos"]))
                grids.append(self.grid(out[self.video_grid_key]))
                refs.extend(feature_rows(feats))
            self._cache[case] = (np.concatenate(pixels), np.concatenate(grids), torch.cat(refs).numpy())
        return self._cache[case]
