"""MiniCPM-V 4.5 vision path in torch (issue #27, in part): the official `SiglipVisionTransformer`
(`modeling_navit_siglip.py`, NaViT position ids) and `Resampler` (`resampler.py`, the 4.5 one with
temporal ids: a video's packed frames resampled together), slice by slice. Not yet a `Tower` (no
ONNX export, no batching): the reference the exported tower will be checked against.

Input convention as `triton_vlm.vision.minicpmv`: one `pixel_values` row per 14 x 14 patch in the
Conv2d weight's (channel, dy, dx) order, each slice's patches row-major, `grid_thw` rows `[1, h, w]`
(the processor's `tgt_sizes`). Each slice gives `query_num` rows (the resampler's learned queries
attending over the slice), in the slices' order: the rows of its `<unk>` run.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from triton_vlm.weights import read_safetensors

LAYER_NORM_EPS = 1e-6  # SigLIP's, and the resampler's LayerNorms (`partial(nn.LayerNorm, eps=1e-6)`)


def navit_position_ids(h: int, w: int, side: int) -> np.ndarray:
    """`SiglipVisionEmbeddings.forward`'s position ids of an h x w slice on the `side` x `side`
    table: each axis's fractional coordinates (a float32 `arange(0, 1 - 1e-6, 1 / n)`) bucketised
    on `arange(1 / side, 1, 1 / side)`, right-closed."""
    boundaries = torch.arange(1 / side, 1.0, 1 / side)
    rows = torch.bucketize(torch.arange(0, 1 - 1e-6, 1 / h), boundaries, right=True)
    cols = torch.bucketize(torch.arange(0, 1 - 1e-6, 1 / w), boundaries, right=True)
    return (rows[:, None] * side + cols).flatten().numpy()


def sincos_1d(dim: int, pos: np.ndarray) -> torch.Tensor:
    """[len(pos), dim]: sin then cos of pos * 10000^(-2i / dim) (`get_1d_sincos_pos_embed_from_*`)."""
    omega = np.arange(dim // 2, dtype=np.float32)
    omega /= dim / 2.0
    omega = 1.0 / 10000 ** omega
    out = np.einsum("...,d->...d", pos, omega)
    return torch.from_numpy(np.concatenate([np.sin(out), np.cos(out)], axis=-1)).float()


def sincos_2d(dim: int, h: int, w: int) -> torch.Tensor:
    """The resampler's 2-D sin-cos table [h, w, dim] (`get_2d_sincos_pos_embed`): the first half
    encodes the column, the second the row (`np.meshgrid(grid_w, grid_h)`), each half sin then cos."""
    grid_w, grid_h = np.meshgrid(np.arange(w, dtype=np.float32), np.arange(h, dtype=np.float32))
    return torch.cat([sincos_1d(dim // 2, grid_w), sincos_1d(dim // 2, grid_h)], dim=-1)


class MiniCPMV45Vision:
    """The vision weights of a MiniCPM-V 4.5 checkpoint (`vpm.*`, `resampler.*`) and their forward."""

    def __init__(self, checkpoint: str | Path) -> None:
        import json

        root = Path(checkpoint)
        config = json.loads((root / "config.json").read_text())
        vision = config["vision_config"]
        self.patch, self.heads = int(vision["patch_size"]), int(vision["num_attention_heads"])
        self.side = int(vision["image_size"]) // self.patch
        self.layers = int(vision["num_hidden_layers"])
        self.embed_dim = int(config["hidden_size"])
        self.resampler_heads = self.embed_dim // 128
        self.w = read_safetensors(root, lambda k: k if k.startswith(("vpm.", "resampler.")) else None,
                                  dtype=torch.float32)

    def tower(self, rows: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """`vpm` on one slice: rows [h * w, 3 * 14 * 14] -> last_hidden_state [h * w, Dv]."""
        wt = self.w
        conv = wt["vpm.embeddings.patch_embedding.weight"]
        x = rows @ conv.reshape(conv.shape[0], -1).t() + wt["vpm.embeddings.patch_embedding.bias"]
        x = x + wt["vpm.embeddings.position_embedding.weight"][torch.from_numpy(navit_position_ids(h, w, self.side))]
        for i in range(self.layers):
            p = f"vpm.encoder.layers.{i}."
            y = F.layer_norm(x, x.shape[-1:], wt[p + "layer_norm1.weight"], wt[p + "layer_norm1.bias"], LAYER_NORM_EPS)
            q, k, v = (F.linear(y, wt[p + f"self_attn.{n}_proj.weight"], wt[p + f"self_attn.{n}_proj.bias"])
                       .view(len(y), self.heads, -1).transpose(0, 1) for n in "qkv")
            attn = torch.softmax((q @ k.transpose(1, 2)) * q.shape[-1] ** -0.5, dim=-1) @ v
            x = x + F.linear(attn.transpose(0, 1).reshape(len(y), -1), wt[p + "self_attn.out_proj.weight"],
                             wt[p + "self_attn.out_proj.bias"])
            y = F.layer_norm(x, x.shape[-1:], wt[p + "layer_norm2.weight"], wt[p + "layer_norm2.bias"], LAYER_NORM_EPS)
            y = F.gelu(F.linear(y, wt[p + "mlp.fc1.weight"], wt[p + "mlp.fc1.bias"]), approximate="tanh")
            x = x + F.linear(y, wt[p + "mlp.fc2.weight"], wt[p + "mlp.fc2.bias"])
        return F.layer_norm(x, x.shape[-1:], wt["vpm.post_layernorm.weight"], wt["vpm.post_layernorm.bias"],
                            LAYER_NORM_EPS)

    def resample(self, frames: list[tuple[torch.Tensor, int, int]], temporal_ids: list[int] | None = None
                 ) -> torch.Tensor:
        """The resampler on one image slice, or on a video's packed group of frames: each
        (vpm rows [h * w, Dv], h, w) gives keys (with its 2-D sin-cos, and the 1-D sin-cos of its
        temporal id where one is given: `Resampler4_5`) and values; the learned queries attend
        over all of them at once -> [query_num, D]."""
        wt, d = self.w, self.embed_dim
        keys, values = [], []
        for i, (x, h, w) in enumerate(frames):
            x = F.layer_norm(x @ wt["resampler.kv_proj.weight"].t(), (d,), wt["resampler.ln_kv.weight"],
                             wt["resampler.ln_kv.bias"], LAYER_NORM_EPS)
            key = x + sincos_2d(d, h, w).reshape(h * w, d)
            if temporal_ids is not None and temporal_ids[i] >= 0:
                key = key + sincos_1d(d, np.array([temporal_ids[i]], dtype=np.float32))
            keys.append(key)
            values.append(x)
        q = F.layer_norm(wt["resampler.query"], (d,), wt["resampler.ln_q.weight"], wt["resampler.ln_q.bias"],
                         LAYER_NORM_EPS)
        out, _ = F.multi_head_attention_forward(
            q[:, None], torch.cat(keys)[:, None], torch.cat(values)[:, None], d, self.resampler_heads,
            wt["resampler.attn.in_proj_weight"], wt["resampler.attn.in_proj_bias"], None, None, False, 0.0,
            wt["resampler.attn.out_proj.weight"], wt["resampler.attn.out_proj.bias"], training=False,
            need_weights=False)
        out = F.layer_norm(out[:, 0], (d,), wt["resampler.ln_post.weight"], wt["resampler.ln_post.bias"],
                           LAYER_NORM_EPS)
        return out @ wt["resampler.proj"]

    @torch.inference_mode()
    def __call__(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor,
                 temporal_ids: list[list[int]] | None = None) -> torch.Tensor:
        """[groups * query_num, D]: each slice on its own, or (`temporal_ids`, the processor's:
        one list per group of grid rows, [-1] for an image slice) each group's frames together."""
        frames, start = [], 0
        for _, h, w in grid_thw.tolist():
            frames.append((self.tower(pixel_values[start:start + h * w], h, w), h, w))
            start += h * w
        groups = temporal_ids or [[-1]] * len(frames)
        out, i = [], 0
        for ids in groups:
            out.append(self.resample(frames[i:i + len(ids)], ids))
            i += len(ids)
        return torch.cat(out)
