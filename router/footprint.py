"""How much device memory a model will hold before it has ever loaded: the
planner's estimate (router/lifecycle/seats.py), from the checkpoint's headers
alone (no torch, no tensor data read).

- Weights: every tensor's element count (safetensors JSON headers, GGUF
  tensor infos) times the serving dtype's size, since the engine holds all
  of them in that dtype (quantized GGUF tensors are dequantized at load),
  plus the rotary table the decoder keeps for the trained context, less the
  routed experts kept in host memory (--expert-residency host, --n-cpu-moe).
  With --gguf-weights packed, on a GPU in bfloat16, the engine keeps a
  GGUF's Q4_0/Q8_0/Q4_K/Q5_K/Q6_K projection matrices in their blocks
  (engine/loader/packing.py): those count their stored bytes instead
  (packed_matrices below mirrors the rule).
  Likewise a Hugging Face FP8 checkpoint's FP8 projections (one byte an
  element plus float32 block scales), and with --quantize fp8 a float
  checkpoint's projections but lm_head (FP8_BLOCK_BYTES an element: the
  value and its share of a 128x128 block's scale). Only the dense decoder's
  q/k/v/o/gate/up/down projections are counted so (hybrid layers' and
  experts' count in the serving dtype: the estimate errs high).
- KV: 2 (K and V) x layers x KV heads x head size x KV dtype bytes per token
  (the serving dtype's, or 1 with --kv-dtype fp8),
  times the tokens the pool will hold (engine/kv/kv_sizing.py's rule: lanes x
  context + prefix-cache tokens, or the explicit capacity), in whole pages.
- Activations, CUDA graphs and workspaces: an allowance that errs high, as
  the engine measures the real peaks only once loaded; the device cache of
  host-resident experts (--expert-cache-mib) in full.
- On a GPU, the CUDA context every engine process creates.

After a model's first load the planner uses what its engine reported
(Ready.memory) instead.
"""

from __future__ import annotations

import json
import math
import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protocol import EngineOptions

MIB = 2**20
GIB = 2**30
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# The allowance for one step's intermediates: per token of the largest step,
# this many copies of the widest rows (hidden states, q/k/v, the MLP's
# gate/up) alive at once. The engine's measured peak is about half of it.
ACTIVATION_COPIES = 4
# Logits are float32; the sampler keeps a few same-sized temporaries per
# sampled row (probabilities, masks, the kernel's histograms).
LOGIT_COPIES = 4
# Allocator rounding, the decode attention's split-K workspace and the CUDA
# graphs' pool slack (engine/execution/gpu_memory.py sets aside 64 MiB for the last).
FIXED_SLACK_BYTES = 256 * MIB
# What a CUDA context (torch's, plus cuBLAS's workspaces and CuPy's modules)
# costs each engine process on the device, outside anything it reports.
CUDA_CONTEXT_BYTES = 768 * MIB


@dataclass(frozen=True)
class ModelShape:
    """The facts the estimate needs, read from config.json or GGUF metadata."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    trained_context: int
    # Elements of every tensor in the checkpoint.
    weight_elements: int
    # Elements of the routed experts, per layer that has them: (layer, elements).
    expert_elements: tuple[tuple[int, int], ...] = ()
    # A GGUF's matrices that a GPU engine keeps packed: their elements (among
    # weight_elements) and their stored bytes.
    packed_elements: int = 0
    packed_bytes: int = 0
    # Whether those are a GGUF's blocks (packed only with --gguf-weights
    # packed) rather than an FP8 checkpoint's matrices (always kept in FP8).
    packed_gguf: bool = False
    # A float Hugging Face checkpoint's projections that --quantize fp8 puts
    # in FP8 (elements, among weight_elements).
    fp8_quantizable_elements: int = 0
    # Hybrid models (Qwen3-Next, Qwen3.5): the layers that keep KV pages
    # (None: all), and the recurrent state of one sequence over the
    # linear-attention layers: conv elements (serving dtype), state
    # elements (float32). See engine/execution/recurrent_state.py.
    attention_layers: int | None = None
    conv_state_elements: int = 0
    recurrent_state_elements: int = 0

    def host_expert_elements(self, host_expert_layers: int) -> int:
        """Elements of the experts of the first host_expert_layers layers
        (-1: all), which the engine keeps in host memory."""
        return sum(count for layer, count in self.expert_elements
                   if host_expert_layers < 0 or layer < host_expert_layers)


@dataclass(frozen=True)
class Footprint:
    """A model's planned device memory by kind (bytes)."""

    weights_bytes: int
    kv_bytes: int
    # Activations of the largest step, CUDA graphs, workspaces (an allowance).
    activation_bytes: int
    # The engine process's CUDA context (0 on the CPU).
    runtime_bytes: int
    kv_tokens: int
    context: int

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.activation_bytes + self.runtime_bytes

    @property
    def grant_bytes(self) -> int:
        """What the engine itself may hold (its device_memory_mib): all but
        the CUDA context, which it does not count."""
        return self.total_bytes - self.runtime_bytes

    def describe(self) -> str:
        return (f"weights {self.weights_bytes / GIB:.2f} GiB, KV {self.kv_bytes / GIB:.2f} GiB "
                f"({self.kv_tokens} tokens), activations and graphs "
                f"{self.activation_bytes / GIB:.2f} GiB, CUDA context "
                f"{self.runtime_bytes / GIB:.2f} GiB")


def dtype_bytes(engine: EngineOptions, cuda: bool) -> int:
    """The serving dtype's size: the dtype option, or bfloat16 on CUDA and
    float32 on the CPU (engine/process/bootstrap.py resolve_dtype)."""
    if engine.dtype == "auto":
        return 2 if cuda else 4
    return _DTYPE_BYTES[engine.dtype]


def served_context(shape: ModelShape, engine: EngineOptions) -> int:
    if engine.max_context:
        return min(engine.max_context, shape.trained_context)
    return shape.trained_context


def planned_kv_tokens(shape: ModelShape, engine: EngineOptions, *, fill: bool = False) -> int:
    """The tokens the KV pool is planned for, in whole pages. With `fill`
    (the pool takes all it is given) the least it needs: one full context."""
    context = served_context(shape, engine)
    if engine.kv_capacity_tokens > 0:
        tokens = engine.kv_capacity_tokens
    elif fill or engine.kv_capacity_tokens < 0:
        tokens = context
    else:
        tokens = engine.max_concurrency * context + engine.prefix_cache_tokens
    pages = -(-tokens // engine.page_size)
    return pages * engine.page_size


def estimate_footprint(shape: ModelShape, engine: EngineOptions, *, cuda: bool,
                       fill: bool = False) -> Footprint:
    size = dtype_bytes(engine, cuda)
    rope_elements = shape.trained_context * shape.head_dim
    on_host = shape.host_expert_elements(engine.host_expert_layer_count)
    weights = (shape.weight_elements - on_host + rope_elements) * size
    if cuda and size == 2 and shape.head_dim in PACKED_HEAD_DIMS:
        if not shape.packed_gguf or engine.gguf_weights == "packed":
            weights += shape.packed_bytes - shape.packed_elements * size
        if engine.quantize == "fp8":
            weights -= round(shape.fp8_quantizable_elements * (size - FP8_ELEMENT_BYTES))
    kv_layers = shape.layers if shape.attention_layers is None else shape.attention_layers
    # --kv-dtype fp8: one byte an element (engine/execution/kv_dtype.py).
    kv_size = 1 if engine.kv_dtype == "fp8" else size
    per_token = 2 * kv_layers * shape.kv_heads * shape.head_dim * kv_size
    kv_tokens = planned_kv_tokens(shape, engine, fill=fill)
    # A hybrid model's state rows: one per lane and its checkpoints (the
    # engine may keep fewer checkpoints; this is the most it plans for).
    state_rows = engine.max_concurrency * (1 + engine.ctx_checkpoints)
    state_bytes = state_rows * (shape.conv_state_elements * size
                                + shape.recurrent_state_elements * 4)
    activations = 0
    runtime = 0
    if cuda:
        qkv = (shape.heads + 2 * shape.kv_heads) * shape.head_dim
        row = max(shape.hidden, qkv, 2 * shape.intermediate)
        step = engine.max_batched_tokens * row * size * ACTIVATION_COPIES
        logits = engine.max_concurrency * shape.vocab * 4 * LOGIT_COPIES
        # The graphs' pool holds a decode step of every lane: its rows and logits again.
        graphs = engine.max_concurrency * (row * size * ACTIVATION_COPIES + shape.vocab * 4 * 2)
        # The device cache of host-resident experts (--expert-cache-mib) is
        # set aside whole, as a workspace.
        cache = engine.expert_cache_mib * MIB
        activations = step + logits + graphs + FIXED_SLACK_BYTES + cache
        runtime = CUDA_CONTEXT_BYTES
    return Footprint(weights, kv_tokens * per_token + state_bytes, activations, runtime,
                     kv_tokens, served_context(shape, engine))


# ---- reading the checkpoint ---------------------------------------------------------


def read_shape(path: Path, format: str) -> ModelShape:
    """ValueError when the files cannot be read as the format says."""
    try:
        if format == "gguf":
            return _gguf_shape(path)
        return _hf_shape(path)
    except (OSError, KeyError, TypeError, struct.error, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {path}'s tensor shapes: {exc!r}") from exc


def _hf_shape(directory: Path) -> ModelShape:
    config = json.loads((directory / "config.json").read_text())
    config = config.get("text_config", config)
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    elements = 0
    experts: dict[int, int] = {}
    infos: dict[str, tuple[list[int], str]] = {}
    for file in sorted(directory.glob("*.safetensors")):
        for name, info in _safetensors_header(file).items():
            count = math.prod(info["shape"])
            elements += count
            _count_expert(_HF_EXPERT, name, count, experts)
            infos[name] = (info["shape"], info["dtype"])
    return ModelShape(
        layers=int(config["num_hidden_layers"]),
        heads=heads,
        kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        hidden=hidden,
        intermediate=int(config.get("intermediate_size") or 4 * hidden),
        vocab=int(config["vocab_size"]),
        trained_context=int(config.get("max_position_embeddings") or 2048),
        weight_elements=elements,
        expert_elements=tuple(sorted(experts.items())),
        **_hf_fp8_shape(infos),
        **_hf_hybrid_shape(config),
    )


# The dense decoder's projections, which the engine can keep in FP8
# (engine/loader/packing.py plan_fp8), lm_head apart.
_HF_PROJECTION = re.compile(r"model\.layers\.\d+\.(?:self_attn|mlp)\."
                            r"(?:q|k|v|o|gate|up|down)_proj\.weight")
FP8_BLOCK = 128
# Bytes per element of an FP8 matrix: the value and a float32 scale per block.
FP8_ELEMENT_BYTES = 1 + 4 / FP8_BLOCK**2


def _hf_fp8_shape(infos: dict[str, tuple[list[int], str]]) -> dict[str, int]:
    """An FP8 checkpoint's projections (and lm_head) stored in FP8 with a
    scale: packed elements and bytes; a float checkpoint's projections that
    --quantize fp8 would put in FP8 (K a multiple of 128, as the kernels need)."""
    packed_elements = packed_bytes = quantizable = 0
    for name, (shape, dtype) in infos.items():
        if len(shape) != 2 or shape[1] % FP8_BLOCK:
            continue
        projection = _HF_PROJECTION.fullmatch(name) is not None
        base = name.removesuffix(".weight")
        scale = next((infos[s] for s in (base + ".weight_scale_inv", base + ".weight_scale")
                      if s in infos), None)
        if dtype == "F8_E4M3" and scale is not None and (projection or name == "lm_head.weight"):
            scale_elements = math.prod(scale[0])
            packed_elements += math.prod(shape) + scale_elements
            packed_bytes += math.prod(shape) + 4 * math.ceil(shape[0] / FP8_BLOCK) * (
                shape[1] // FP8_BLOCK)
        elif projection and dtype in ("BF16", "F16", "F32"):
            quantizable += math.prod(shape)
    return {"packed_elements": packed_elements, "packed_bytes": packed_bytes,
            "fp8_quantizable_elements": quantizable}


def _hf_hybrid_shape(config: dict[str, Any]) -> dict[str, Any]:
    """A hybrid config's attention layers and recurrent state per sequence
    ({} for any other model)."""
    if "linear_num_value_heads" not in config:
        return {}
    return _hybrid_state(config)


def _hybrid_state(config: dict[str, Any]) -> dict[str, Any]:
    layers = int(config["num_hidden_layers"])
    interval = int(config.get("full_attention_interval") or 4)
    types = config.get("layer_types") or [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention"
        for i in range(layers)]
    linear = sum(1 for kind in types if kind == "linear_attention")
    key_heads = int(config["linear_num_key_heads"])
    value_heads = int(config["linear_num_value_heads"])
    key_dim, value_dim = int(config["linear_key_head_dim"]), int(config["linear_value_head_dim"])
    channels = 2 * key_heads * key_dim + value_heads * value_dim
    return {
        "attention_layers": layers - linear,
        "conv_state_elements": linear * channels * (int(config["linear_conv_kernel_dim"]) - 1),
        "recurrent_state_elements": linear * value_heads * key_dim * value_dim,
    }


# Routed expert tensors and their layer: Hugging Face's model.layers.N.<block>.experts.E.*
# (not the block's router), llama.cpp's blk.N.ffn_{gate,up,down}_exps (and
# old Mixtral files' ffn_{gate,up,down}.E).
_HF_EXPERT = re.compile(r"model\.layers\.(\d+)\.[^.]+\.experts\.")
_GGUF_EXPERT = re.compile(r"blk\.(\d+)\.ffn_(?:gate|up|down)(?:_exps|\.\d+)\.")


def _count_expert(pattern: re.Pattern[str], name: str, count: int,
                  experts: dict[int, int]) -> None:
    match = pattern.match(name)
    if match:
        layer = int(match[1])
        experts[layer] = experts.get(layer, 0) + count


def _safetensors_header(path: Path) -> dict[str, dict[str, Any]]:
    """Each tensor's header entry (dtype, shape, offsets) by name."""
    with open(path, "rb") as file:
        (length,) = struct.unpack("<Q", file.read(8))
        if length > 100 * MIB:
            raise ValueError(f"{path}: a {length}-byte safetensors header is not believable")
        header: dict[str, Any] = json.loads(file.read(length))
    header.pop("__metadata__", None)
    return header


# GGUF value types (gguf's GGUFValueType) and their sizes; 8 is a string, 9 an array.
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?",
                 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


class _GgufReader:
    """Walks a GGUF header: the key-value section (scalars kept, arrays
    skipped but counted) and then the tensor infos. Tensor data is never read."""

    def __init__(self, buf: mmap.mmap):
        self.buf = buf
        (raw_version,) = struct.unpack_from("<I", buf, 4)
        # A big-endian file's small version number lands in the high bytes.
        self.endian = "<" if raw_version & 0xFFFF else ">"
        self.pos = 8

    def scalar(self, code: str) -> Any:
        fmt = self.endian + code
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.scalar("Q")
        start, self.pos = self.pos, self.pos + length
        if self.pos > len(self.buf):
            raise ValueError("a GGUF string runs past the end of the file")
        return self.buf[start:self.pos].decode("utf-8")

    def value(self, vtype: int) -> Any:
        if vtype == _GGUF_STRING:
            return self.string()
        if vtype == _GGUF_ARRAY:
            item = self.scalar("I")
            count = self.scalar("Q")
            if item in _GGUF_SCALARS:
                self.pos += count * struct.calcsize(self.endian + _GGUF_SCALARS[item])
            else:
                for _ in range(count):
                    self.value(item)
            return count  # only an array's length is kept
        if vtype in _GGUF_SCALARS:
            return self.scalar(_GGUF_SCALARS[vtype])
        raise ValueError(f"unknown GGUF value type {vtype}")


def _gguf_shape(path: Path) -> ModelShape:
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        reader = _GgufReader(buf)
        tensors = reader.scalar("Q")
        pairs = reader.scalar("Q")
        meta: dict[str, Any] = {}
        for _ in range(pairs):
            key = reader.string()
            meta[key] = reader.value(reader.scalar("I"))
        elements = 0
        experts: dict[int, int] = {}
        embedding_rows = 0
        quantized: dict[str, tuple[int, int]] = {}
        # A hybrid's MTP blocks (llama.cpp appends them after the model's
        # own) are skipped by the engine's loader: neither counted here.
        first_mtp = _first_mtp_block(meta)
        for _ in range(tensors):
            name = reader.string()
            dims = [reader.scalar("Q") for _ in range(reader.scalar("I"))]
            stored = reader.scalar("I")
            reader.scalar("Q")  # the data offset
            block = _GGUF_BLOCK.match(name)
            if block is not None and int(block.group(1)) >= first_mtp:
                continue
            if stored in _PACKED_BLOCKS and len(dims) == 2:
                quantized[name] = (math.prod(dims), _packed_size(stored, dims))
            elements += math.prod(dims)
            _count_expert(_GGUF_EXPERT, name, math.prod(dims), experts)
            if name == "token_embd.weight" and len(dims) == 2:
                embedding_rows = dims[1]  # GGUF lists dimensions innermost first
    arch = meta["general.architecture"]

    def arch_value(suffix: str, default: Any = None) -> Any:
        found = meta.get(f"{arch}.{suffix}", default)
        if found is None:
            raise KeyError(f"{arch}.{suffix}")
        return found

    heads = int(arch_value("attention.head_count"))
    hidden = int(arch_value("embedding_length"))
    layers = min(int(arch_value("block_count")), first_mtp)
    packed = packed_matrices(quantized, arch)
    return ModelShape(
        layers=layers,
        heads=heads,
        kv_heads=int(arch_value("attention.head_count_kv", heads)),
        head_dim=int(arch_value("attention.key_length", hidden // heads)),
        hidden=hidden,
        intermediate=int(arch_value("feed_forward_length", 4 * hidden)),
        vocab=int(arch_value("vocab_size", embedding_rows or meta.get("tokenizer.ggml.tokens", 0))),
        trained_context=int(arch_value("context_length", 2048)),
        weight_elements=elements,
        expert_elements=tuple(sorted(experts.items())),
        packed_elements=sum(quantized[name][0] for name in packed),
        packed_bytes=sum(quantized[name][1] for name in packed),
        packed_gguf=True,
        **_gguf_hybrid_shape(meta, arch, layers),
    )


_GGUF_BLOCK = re.compile(r"blk\.(\d+)\.")

# The GGUF types the engine's GPU kernels read packed (gguf type id ->
# elements, bytes per block) and the head sizes its kernels serve.
_PACKED_BLOCKS = {2: (32, 18), 8: (32, 34), 12: (256, 144), 13: (256, 176), 14: (256, 210)}
PACKED_HEAD_DIMS = (64, 128, 256)
# The projections that fill one fused matrix of the engine together: packed
# only when every one of them is (engine/loader/packing.py).
_FUSED = ({"attn_q", "attn_k", "attn_v"}, {"ffn_gate", "ffn_up"},
          {"ffn_gate_shexp", "ffn_up_shexp"})
_PACKED_ALONE = {"attn_output", "ffn_down", "ffn_down_shexp"}
_PROJECTION = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def _packed_size(qtype: int, dims: list[int]) -> int:
    block, size = _PACKED_BLOCKS[qtype]
    return dims[0] // block * size * math.prod(dims[1:])


def packed_matrices(quantized: dict[str, tuple[int, int]], arch: str = "") -> set[str]:
    """The names among a GGUF's packable-typed matrices that a GPU engine
    keeps packed: output.weight, and each layer's projections whose fused
    partners are all packable too (Qwen3-Next's ssm_out too: its loader
    leaves it as stored)."""
    packed = {"output.weight"} & quantized.keys()
    kinds: dict[str, set[str]] = {}
    for name in quantized:
        match = _PROJECTION.fullmatch(name)
        if match is not None:
            kinds.setdefault(match[1], set()).add(match[2])
    for layer, present in kinds.items():
        alone = _PACKED_ALONE | ({"ssm_out"} if arch == "qwen3next" else set())
        groups = [{kind} for kind in alone] + list(_FUSED)
        packed.update(f"blk.{layer}.{kind}.weight" for group in groups
                      if group <= present for kind in group)
    return packed


def _first_mtp_block(meta: dict[str, Any]) -> int:
    """The first block of a hybrid GGUF's MTP head (none: past every block)."""
    arch = meta.get("general.architecture", "")
    blocks = int(meta.get(f"{arch}.block_count", 0))
    return blocks - int(meta.get(f"{arch}.nextn_predict_layers", 0)) if blocks else 1 << 30


def _gguf_hybrid_shape(meta: dict[str, Any], arch: str, layers: int) -> dict[str, Any]:
    """_hf_hybrid_shape from llama.cpp's keys (the ones
    engine/models/qwen3_next.py's gguf_hybrid reads); {} for other models."""
    if f"{arch}.ssm.time_step_rank" not in meta:
        return {}
    interval = int(meta.get(f"{arch}.full_attention_interval", 4))
    value_heads = int(meta[f"{arch}.ssm.time_step_rank"])
    return _hybrid_state({
        "num_hidden_layers": layers,
        "layer_types": ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                        for i in range(layers)],
        "linear_num_key_heads": meta[f"{arch}.ssm.group_count"],
        "linear_num_value_heads": value_heads,
        "linear_key_head_dim": meta[f"{arch}.ssm.state_size"],
        "linear_value_head_dim": int(meta[f"{arch}.ssm.inner_size"]) // value_heads,
        "linear_conv_kernel_dim": meta[f"{arch}.ssm.conv_kernel"],
    })
