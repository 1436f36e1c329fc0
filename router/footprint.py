"""How much device memory a model will hold before it has ever loaded: the
planner's estimate (router/lifecycle/seats.py), from the checkpoint's headers
alone (no torch, no tensor data read).

- Weights: every tensor's element count (safetensors JSON headers, GGUF
  tensor infos) times the serving dtype's size, since the engine holds all
  of them in that dtype (quantized GGUF tensors are dequantized at load),
  plus the rotary table the decoder keeps for the trained context, less the
  routed experts kept in host memory (--expert-residency host, --n-cpu-moe).
- KV: 2 (K and V) x layers x KV heads x head size x dtype bytes per token,
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
    kv_layers = shape.layers if shape.attention_layers is None else shape.attention_layers
    per_token = 2 * kv_layers * shape.kv_heads * shape.head_dim * size
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
    for file in sorted(directory.glob("*.safetensors")):
        for name, count in _safetensors_elements(file):
            elements += count
            _count_expert(_HF_EXPERT, name, count, experts)
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
        **_hf_hybrid_shape(config),
    )


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


def _safetensors_elements(path: Path) -> list[tuple[str, int]]:
    """Each tensor's name and element count."""
    with open(path, "rb") as file:
        (length,) = struct.unpack("<Q", file.read(8))
        if length > 100 * MIB:
            raise ValueError(f"{path}: a {length}-byte safetensors header is not believable")
        header: dict[str, Any] = json.loads(file.read(length))
    return [(name, math.prod(info["shape"])) for name, info in header.items()
            if name != "__metadata__"]


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
        # A hybrid's MTP blocks (llama.cpp appends them after the model's
        # own) are skipped by the engine's loader: neither counted here.
        first_mtp = _first_mtp_block(meta)
        for _ in range(tensors):
            name = reader.string()
            dims = [reader.scalar("Q") for _ in range(reader.scalar("I"))]
            reader.scalar("I")  # the stored type: the engine dequantizes it anyway
            reader.scalar("Q")  # the data offset
            block = _GGUF_BLOCK.match(name)
            if block is not None and int(block.group(1)) >= first_mtp:
                continue
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
        **_gguf_hybrid_shape(meta, arch, layers),
    )


_GGUF_BLOCK = re.compile(r"blk\.(\d+)\.")


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
