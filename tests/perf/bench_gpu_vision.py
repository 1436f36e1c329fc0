"""Images through the engine on the H200 (issue 21's benchmarks).

    python tests/perf/bench_gpu_vision.py [--arch qwen2_5_vl[,qwen3_vl]] [--repeats 5]
                                          [--out PATH] [--smoke]

Random weights at the real shapes (bfloat16; Qwen2.5-VL-7B-Instruct, and
Qwen3-VL-8B-Instruct with --arch qwen3_vl), served as `--vision` serves them:
the text model is built on the device in the engine's own structures (as
tests/perf/gpu_models.py does), and the vision tower is written with the
released config.json and preprocessor_config.json into a temporary model
directory, from which the engine loads it itself (engine/execution/
vision_encoder.py). A whole random transformers checkpoint would take
minutes to initialise, write and read back on the GPU host's slow CPU.

1. The tower: images/s (and vision tokens/s) through the engine's
   VisionEncoder.encode, the call a prefill step makes, for router-resized
   448 x 448 and 1024 x 1024 images, one and --batch a call; the median of
   --rounds CUDA-synchronised calls after a warm-up.
2. Time to first token in the engine (its own step loop in-process, CUDA
   graphs on): one 448 x 448 image with 100 text tokens around it, against
   a text-only prompt of the same token count; then a follow-up turn (the
   first prompt plus 50 new tokens, the same image) whose image comes from
   the prefix cache, against the first turn. Every first turn is a fresh
   image and fresh text (no prefix hit: checked), the median of --repeats
   after a warm-up.

--smoke runs the same code on the CPU with tiny towers in seconds
(tests/test_perf_smoke.py). Writes every figure to --out (default
$OUT/bench_gpu_vision.json when $OUT is set) and prints a table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import protocol as p  # noqa: E402
from engine.execution.vision_encoder import VisionEncoder  # noqa: E402
from engine.loader import LoadedModel  # noqa: E402
from engine.loader.hf_weights import text_model_config  # noqa: E402
from engine.models import ModelConfig, build_model  # noqa: E402
from engine.models.vision import build_vision_tower  # noqa: E402
from engine.process.bootstrap import assemble_engine  # noqa: E402
from engine.scheduling.core import EngineCore  # noqa: E402
from protocol.vision import VisionSpec, read_vision_spec  # noqa: E402
from router.media.loader import image_digest  # noqa: E402
from router.media.placement import image_input  # noqa: E402
from router.media.resize import smart_resize  # noqa: E402
from router.media.types import PreparedImage  # noqa: E402
from tests.perf.vision_shapes import vision_language_config  # noqa: E402

TEXT_TOKENS = 100  # text around the image in a first turn (issue 21)
TEXT_BEFORE = 20  # of those, before the image (a system prompt's and a turn's start)
FOLLOW_UP_TOKENS = 50  # the answer and the next question of a follow-up turn


def fill_random(named: dict[str, torch.Tensor], generator: torch.Generator) -> None:
    """Norm weights 1, norm biases 0, everything else N(0, 0.02): activations
    stay finite through every layer (the speed does not depend on values)."""
    for name, tensor in named.items():
        norm = "norm" in name or ".ln_" in name
        if norm and name.endswith(".bias"):
            tensor.zero_()
        elif norm:
            tensor.fill_(1.0)
        else:
            tensor.normal_(0.0, 0.02, generator=generator)


@torch.inference_mode()
def write_model_dir(cfg: dict[str, Any], processor: dict[str, Any], directory: Path,
                    device: torch.device, dtype: torch.dtype) -> None:
    """config.json, preprocessor_config.json and the tower's random weights
    under the checkpoint's own names (the text model's are not written)."""
    (directory / "config.json").write_text(json.dumps(cfg, indent=1))
    (directory / "preprocessor_config.json").write_text(json.dumps(processor, indent=1))
    tower = build_vision_tower(cfg, device, dtype)
    prefix = "visual" if cfg["model_type"] == "qwen2_5_vl" else "model.visual"
    named = tower.weight_destinations(prefix)
    fill_random(named, torch.Generator(device=device).manual_seed(1))
    # Copies: safetensors refuses tensors sharing storage (a view of a weight).
    save_file({name: t.to("cpu", copy=True).contiguous() for name, t in named.items()},
              str(directory / "model.safetensors"))


@torch.inference_mode()
def random_text_model(cfg: dict[str, Any], device: torch.device,
                      dtype: torch.dtype) -> LoadedModel:
    """The checkpoint's text model, built on the device with random weights."""
    config = ModelConfig.from_hf_config(text_model_config(cfg))
    model = build_model(config, device, dtype)
    fill_random(dict(model.named_parameters()), torch.Generator(device=device).manual_seed(0))
    n_params = sum(param.numel() for param in model.parameters())
    return LoadedModel(config, model, n_params, n_params * dtype.itemsize)


def vision_engine(loaded: LoadedModel, directory: Path, device: torch.device, dtype: str,
                  max_context: int) -> tuple[EngineCore, list[p.EngineEvent]]:
    events: list[p.EngineEvent] = []
    # A KV pool for a few lanes and every turn's cached pages (about 8k
    # tokens in all), so no first turn is evicted before its follow-up.
    options = p.EngineOptions(device=device.type, dtype=dtype, vision=True, max_concurrency=4,
                              max_batched_tokens=2048, max_context=max_context,
                              kv_capacity_tokens=16 * max_context)
    core, _ = assemble_engine(loaded, directory, options, lambda fraction, message: None,
                              events.append)
    return core, events


def make_image(spec: VisionSpec, side: int, seed: int) -> PreparedImage:
    """What the router makes of a side x side photo: its resized RGB (random
    pixels here), grid and digest."""
    height, width = smart_resize(side, side, spec.patch_size * spec.merge_size, spec.min_pixels,
                                 spec.max_pixels)
    rgb = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    grid_h, grid_w = height // spec.patch_size, width // spec.patch_size
    return PreparedImage(rgb=rgb.tobytes(), width=width, height=height, grid_t=1, grid_h=grid_h,
                         grid_w=grid_w, num_tokens=grid_h * grid_w // spec.merge_size**2,
                         digest=image_digest(width, height, 1, grid_h, grid_w, rgb.tobytes()))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def warm_up_peak_mib(encoder: VisionEncoder, images: list[p.ImageInput]) -> float | None:
    """Two warm-up calls; on a GPU, the device memory a call took beyond
    what was allocated before it (the room the tower's activations need)."""
    cuda = encoder.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(encoder.device)
        torch.cuda.reset_peak_memory_stats(encoder.device)
        before = torch.cuda.memory_allocated(encoder.device)
    for _ in range(2):
        encoder.encode(images)
    if not cuda:
        return None
    torch.cuda.synchronize(encoder.device)
    return (torch.cuda.max_memory_allocated(encoder.device) - before) / 2**20


def bench_tower(encoder: VisionEncoder, sides: list[int], batches: list[int], rounds: int
                ) -> list[dict[str, Any]]:
    rows = []
    for side in sides:
        for batch in batches:
            images = [image_input(make_image(encoder.spec, side, 1000 + i), 0)
                      for i in range(batch)]
            peak_mib = warm_up_peak_mib(encoder, images)
            times = []
            for _ in range(rounds):
                _sync(encoder.device)
                started = time.perf_counter()
                encoder.encode(images)
                _sync(encoder.device)
                times.append(time.perf_counter() - started)
            seconds = statistics.median(times)
            image = images[0]
            tokens = image.num_tokens(encoder.spec.merge_size)
            row = {"side": side, "resized": f"{image.width}x{image.height}", "batch": batch,
                   "patches": image.grid_h * image.grid_w, "tokens": tokens,
                   "ms_per_call": seconds * 1e3, "images_s": batch / seconds,
                   "vision_tok_s": batch * tokens / seconds, "peak_activation_mib": peak_mib}
            print("tower", json.dumps(row), flush=True)
            rows.append(row)
    return rows


class TurnTimer:
    """Serves one prompt at a time through the engine's step loop: the
    seconds to its first token and how many of its tokens were cached."""

    def __init__(self, core: EngineCore, events: list[p.EngineEvent], device: torch.device
                 ) -> None:
        self.core, self.events, self.device = core, events, device
        self.served = 0

    def first_token(self, prompt: list[int], images: list[p.ImageInput]) -> tuple[float, int]:
        self.events.clear()
        self.served += 1
        request_id = f"turn-{self.served}"
        params = p.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        _sync(self.device)
        started = time.perf_counter()
        self.core.handle(p.Generate(request_id, prompt, params, images=images))
        while self.core.has_work:
            self.core.step()
        seconds = time.perf_counter() - started
        errors = [e for e in self.events if isinstance(e, p.RequestError)]
        if errors:
            raise RuntimeError(f"the engine refused {request_id}: {errors[0].message}")
        outputs = [o for e in self.events if isinstance(e, p.StepOutputs) for o in e.outputs]
        if not outputs or not outputs[0].token_ids:
            raise RuntimeError(f"{request_id} gave no token")
        return seconds, outputs[0].num_cached_tokens or 0


def image_prompt(spec: VisionSpec, image: PreparedImage, rng: random.Random
                 ) -> tuple[list[int], list[p.ImageInput]]:
    """TEXT_BEFORE tokens, the image's block, the rest of TEXT_TOKENS."""
    before = random_text(rng, TEXT_BEFORE)
    offset = len(before) + 1
    prompt = (before + [spec.vision_start_token_id] + [spec.image_token_id] * image.num_tokens
              + [spec.vision_end_token_id] + random_text(rng, TEXT_TOKENS - TEXT_BEFORE))
    return prompt, [image_input(image, offset)]


def random_text(rng: random.Random, count: int) -> list[int]:
    # Ordinary vocabulary ids (Qwen's special tokens start at 151643).
    return [rng.randrange(1000, 150_000) for _ in range(count)]


def bench_ttft(timer: TurnTimer, spec: VisionSpec, side: int, repeats: int) -> dict[str, Any]:
    rng = random.Random(7)
    samples: dict[str, list[float]] = {"text_only": [], "image_first": [], "image_follow_up": []}
    for repeat in range(-2, repeats):  # two warm-up rounds first
        image = make_image(spec, side, repeat + 10)  # a new image (digest) every turn
        prompt, images = image_prompt(spec, image, rng)
        turns = {"text_only": (random_text(rng, len(prompt)), []),
                 "image_first": (prompt, images),
                 "image_follow_up": (prompt + random_text(rng, FOLLOW_UP_TOKENS), images)}
        cached: dict[str, int] = {}
        for key, (tokens, pictures) in turns.items():
            seconds, cached[key] = timer.first_token(tokens, pictures)
            if repeat >= 0:
                samples[key].append(seconds)
        if cached["text_only"] or cached["image_first"]:
            raise RuntimeError(f"a fresh prompt hit the prefix cache ({cached}): the first "
                               "turns' figures would be wrong")
        if cached["image_follow_up"] < len(prompt) // 2:
            raise RuntimeError(f"the follow-up turn reused only {cached['image_follow_up']} of "
                               f"its first turn's {len(prompt)} tokens")
    result: dict[str, Any] = {"side": side, "resized": f"{image.width}x{image.height}",
                              "image_tokens": image.num_tokens, "text_tokens": TEXT_TOKENS,
                              "prompt_tokens": len(prompt),
                              "follow_up_tokens": len(prompt) + FOLLOW_UP_TOKENS,
                              "repeats": repeats}
    for key, times in samples.items():
        result[key] = {"ttft_ms": statistics.median(times) * 1e3,
                       "all_ms": [t * 1e3 for t in times], "cached_tokens": cached[key]}
    print("ttft", json.dumps(result), flush=True)
    return result


def bench_arch(arch: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg, processor = vision_language_config(arch, tiny=args.smoke)
    directory = Path(tempfile.mkdtemp(prefix=f"roundhouse-vision-{arch}-"))
    result: dict[str, Any] = {"arch": arch, "config": cfg, "preprocessor": processor}
    try:
        started = time.perf_counter()
        write_model_dir(cfg, processor, directory, device, dtype)
        result["tower_write_s"] = time.perf_counter() - started
        started = time.perf_counter()
        loaded = random_text_model(cfg, device, dtype)
        _sync(device)
        result["text_build_s"] = time.perf_counter() - started
        started = time.perf_counter()
        core, events = vision_engine(loaded, directory, device, str(dtype).removeprefix("torch."),
                                     max_context=4096)
        result["engine_build_s"] = time.perf_counter() - started
        encoder = core.runner.vision
        assert encoder is not None, "the engine loaded no vision tower"
        result["use_kernels"] = core.runner.use_kernels
        result["cuda_graphs"] = core.runner.cuda_graph
        result["text_params"] = loaded.n_params
        result["tower_params"] = sum(t.numel() for t in encoder.tower.parameters())
        spec = read_vision_spec(directory)
        result["tower"] = bench_tower(encoder, args.sides, [1, args.batch], args.rounds)
        result["ttft"] = bench_ttft(TurnTimer(core, events, device), spec, args.sides[0],
                                    args.repeats)
        del core, events, encoder, loaded
    finally:
        shutil.rmtree(directory, ignore_errors=True)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return result


def print_table(results: dict[str, Any]) -> None:
    print(f"\n{results['device']}, {results['date']}")
    for run in results["archs"]:
        print(f"{run['arch']}: tower {run['tower_params'] / 1e6:.0f}M params, text "
              f"{run['text_params'] / 1e9:.2f}B; built in {run['tower_write_s']:.1f} s (tower "
              f"written) + {run['text_build_s']:.1f} s (text) + {run['engine_build_s']:.1f} s "
              f"(engine); kernels {run['use_kernels']}, graphs {run['cuda_graphs']}")
        print(f"  {'tower':>5}  {'resized':>11}  {'batch':>5}  {'tokens':>6}  {'ms/call':>7}  "
              f"{'images/s':>8}  {'vision tok/s':>12}  {'peak MiB':>8}")
        for row in run["tower"]:
            peak = row["peak_activation_mib"]
            print(f"  {row['side']:>4}²  {row['resized']:>11}  {row['batch']:>5}  "
                  f"{row['tokens']:>6}  {row['ms_per_call']:>7.1f}  {row['images_s']:>8.1f}  "
                  f"{row['vision_tok_s']:>12.0f}  {'-' if peak is None else f'{peak:.0f}':>8}")
        ttft = run["ttft"]
        print(f"  TTFT, median of {ttft['repeats']} ({ttft['resized']} image, "
              f"{ttft['image_tokens']} image + {ttft['text_tokens']} text tokens = "
              f"{ttft['prompt_tokens']}; follow-up {ttft['follow_up_tokens']})")
        for key in ("text_only", "image_first", "image_follow_up"):
            print(f"    {key:<16} {ttft[key]['ttft_ms']:8.1f} ms  "
                  f"(cached {ttft[key]['cached_tokens']} tokens)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="qwen2_5_vl", help="qwen2_5_vl, qwen3_vl or both, "
                        "comma-separated")
    parser.add_argument("--repeats", type=int, default=5, help="TTFT turns of each kind")
    parser.add_argument("--rounds", type=int, default=5, help="timed tower calls")
    parser.add_argument("--batch", type=int, default=8, help="images a tower call")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny, on the CPU, seconds")
    args = parser.parse_args()
    # Sides of the square photos before the router's resize.
    args.sides = [448, 1024]
    if args.smoke:
        args.sides, args.repeats, args.rounds, args.batch = [112, 224], 2, 2, 2
    device = torch.device("cpu" if args.smoke else "cuda")
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"), "command": " ".join(["python3", *sys.argv]),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "archs": []}
    out = args.out
    if out is None and os.environ.get("OUT") and not args.smoke:
        out = Path(os.environ["OUT"], "bench_gpu_vision.json")
    for arch in args.arch.split(","):
        results["archs"].append(bench_arch(arch, args, device))
        if out is not None:  # after each model: a run cut short keeps what it measured
            out.write_text(json.dumps(results, indent=2))
    print_table(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
