"""The vision tower of a model served with --vision, as the model runner uses it.

load_vision_encoder reads the tower's tensors (visual.* or model.visual.*,
which the text load skips) and the image processor settings from the model
directory; load_gguf_vision_encoder reads them from a llama.cpp mmproj GGUF
paired with a text GGUF (engine/loader/gguf_mmproj.py, protocol/vision_gguf.py).
encode() turns a step's new images (protocol ImageInput: RGB
already resized by the router) into the embeddings placed at their image
tokens, and Qwen3-VL's deepstack features, in batched tower passes of
bounded size.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from engine.execution.vision_memory import largest_image_grid
from engine.loader.gguf_mmproj import MmprojCheckpoint
from engine.loader.hf_weights import read_hf_config, safetensors_files
from engine.models.vision import VisionTower, build_tower, build_vision_tower
from engine.models.vision.patches import pixel_patches
from engine.models.vision.weights import load_vision_weights, vision_prefix
from protocol import ImageInput
from protocol.vision import VisionSpec, read_vision_spec
from protocol.vision_gguf import GGUFTextModel, vision_spec_from_gguf

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EncodedImage:
    """One image's tower output: [num_tokens, hidden] embeddings and, for
    Qwen3-VL, one [num_tokens, hidden] deepstack feature per listed layer."""

    embeddings: torch.Tensor
    deepstack: tuple[torch.Tensor, ...]


class VisionEncoder:
    def __init__(self, tower: VisionTower, spec: VisionSpec, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.tower = tower
        self.spec = spec
        self.device = device
        self.dtype = dtype
        # Patches a tower pass takes at most: the largest image's (vision_memory.py).
        grid_h, grid_w = largest_image_grid(spec)
        self.max_pass_patches = grid_h * grid_w

    @property
    def weights_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.tower.parameters())

    @torch.inference_mode()
    def encode(self, images: Sequence[ImageInput]) -> list[EncodedImage]:
        """The images' tower outputs, in order: in passes of at most the
        largest image's patches (engine/execution/vision_memory.py), so a
        pass never needs more memory than the profiled one."""
        encoded: list[EncodedImage] = []
        for group in self._passes(images):
            encoded.extend(self._encode_pass(group))
        return encoded

    def _passes(self, images: Sequence[ImageInput]) -> list[list[ImageInput]]:
        passes: list[list[ImageInput]] = []
        patches = 0
        for image in images:
            size = image.grid_t * image.grid_h * image.grid_w
            if not passes or patches + size > self.max_pass_patches:
                passes.append([])
                patches = 0
            passes[-1].append(image)
            patches += size
        return passes

    def _encode_pass(self, images: Sequence[ImageInput]) -> list[EncodedImage]:
        patches = torch.cat([
            pixel_patches(image.rgb, image.grid_t, image.grid_h, image.grid_w, self.spec,
                          self.dtype, self.device)
            for image in images
        ])
        grids = [(image.grid_t, image.grid_h, image.grid_w) for image in images]
        embeddings, deepstack = self.tower(patches, grids)
        counts = [image.num_tokens(self.spec.merge_size) for image in images]
        if sum(counts) != embeddings.shape[0]:
            raise RuntimeError(f"the tower gave {embeddings.shape[0]} embeddings for "
                               f"{sum(counts)} image tokens")
        per_image = embeddings.split(counts)
        per_layer = [feature.split(counts) for feature in deepstack]
        return [EncodedImage(per_image[i], tuple(layer[i] for layer in per_layer))
                for i in range(len(images))]


def _vision_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as handle:
            for name in handle.keys():
                if vision_prefix(name) is not None:
                    yield name, handle.get_tensor(name)


def load_vision_encoder(model_path: Path, device: torch.device,
                        dtype: torch.dtype) -> VisionEncoder:
    """The tower of a Hugging Face vision-language model directory, filled,
    with its image processor settings. ValueError names what is missing."""
    if not model_path.is_dir():
        raise ValueError(f"--vision on the GGUF {model_path.name} needs its vision projector: "
                         "give llama.cpp's mmproj file with --mmproj")
    spec = read_vision_spec(model_path)
    tower = build_vision_tower(read_hf_config(model_path), device, dtype)
    load_vision_weights(tower, _vision_tensors(safetensors_files(model_path)))
    return _ready(tower, spec, device, dtype, model_path.name)


def load_gguf_vision_encoder(mmproj_path: Path, text: GGUFTextModel, device: torch.device,
                             dtype: torch.dtype) -> VisionEncoder:
    """The tower of an mmproj GGUF, filled, for the text GGUF described by
    text; ValueError (VisionSpecError) naming the files when they are not a
    pair we serve."""
    mmproj = MmprojCheckpoint(mmproj_path)
    spec = vision_spec_from_gguf(text, mmproj.metadata, mmproj_path.name)
    deepstack = len(mmproj.config.deepstack_visual_indexes)
    if deepstack != text.deepstack_layers:
        raise ValueError(f"--mmproj {mmproj_path.name} has {deepstack} deepstack mergers; "
                         f"{text.source} takes {text.deepstack_layers}: they are not a pair")
    tower = build_tower(mmproj.family, mmproj.config, device, dtype)
    load_vision_weights(tower, mmproj.tensors())
    return _ready(tower, spec, device, dtype, mmproj_path.name)


def _ready(tower: VisionTower, spec: VisionSpec, device: torch.device, dtype: torch.dtype,
           source: str) -> VisionEncoder:
    tower.eval()
    encoder = VisionEncoder(tower, spec, device, dtype)
    log.info("vision tower (%s): %.1f MiB of weights (%s), patch %d, merge %d, pixels %d..%d",
             source, encoder.weights_bytes / 2**20, dtype, spec.patch_size, spec.merge_size,
             spec.min_pixels, spec.max_pixels)
    return encoder
