"""How the router asks an engine to run: one typed struct, passed as JSON on
the engine's command line (`python -m engine --options '{...}'`)."""

from __future__ import annotations

import msgspec

DTYPES = ("auto", "float32", "bfloat16", "float16")
# What --pooling may say (unset: the model's own choice, engine/loader/pooling.py).
POOLINGS = ("mean", "cls", "last")
# What --spec may say: speculative decoding off, n-gram (prompt lookup) drafts,
# a draft model's (draft_model), or the checkpoint's own MTP head's.
SPEC_KINDS = ("none", "ngram", "draft", "mtp")
# Where a mixture-of-experts model's routed experts stay: on the device, or in
# page-locked host memory that the device reads them from.
EXPERT_RESIDENCIES = ("device", "host")
# How the KV pool stores keys and values: "bf16", the model's own dtype
# (bfloat16 on a GPU; float32 on the CPU by default), or "fp8": float8 e4m3,
# one byte an element, half the bytes of bf16 (engine/execution/kv_dtype.py).
KV_DTYPES = ("bf16", "fp8")
# What --quantize may say: quantize a float checkpoint's projection matrices
# at load to float8 e4m3 with 128x128 block scales (engine/loader/packing.py).
QUANTIZE_KINDS = ("fp8",)
# How a GGUF file's quantized matrices are served on a GPU: dequantized to the
# model dtype at load (as llama.cpp users' files always were here), or kept
# in their blocks (about the file's bytes on the device; kernels/gguf_quant.py).
GGUF_WEIGHTS = ("dequantized", "packed")


class EngineOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    device: str = "cpu"
    # "auto": float32 on the CPU (fast there, and exact against the
    # reference) and bfloat16 on CUDA.
    dtype: str = "auto"
    page_size: int = 16
    # Lanes: requests decoded together; more wait in arrival order.
    max_concurrency: int = 8
    # Tokens one step may compute: all decode rows plus prefill chunks.
    max_batched_tokens: int = 512
    # 0: the model's trained context.
    max_context: int = 0
    # KV pool size in tokens. 0: what the lanes can use (max_concurrency x
    # context, plus prefix_cache_tokens), within the device memory given;
    # -1: all the device memory given (engine/kv/kv_sizing.py).
    kv_capacity_tokens: int = 0
    # KV kept beyond what the lanes can use at once, for the prefix cache.
    prefix_cache_tokens: int = 0
    # Host memory (MiB) for the prefix cache's host tier: pages the device
    # evicts are kept there and copied back on a hit. 0: off; -1 (auto): the
    # host memory available less a reserve (engine/kv/kv_sizing.py). Never
    # more than that, whatever is asked.
    host_kv_mib: int = 0
    # The prefix cache's disk tier: a directory for the pages the host tier
    # evicts (None: off; it needs the host tier), the most it may hold there
    # (MiB, least recently used out), and how long one admission may spend
    # reading pages back before it computes the rest (ms).
    disk_kv_path: str | None = None
    disk_kv_mib: int = 0
    disk_kv_restore_ms: int = 300
    # Device memory (MiB) this model may hold in all: weights, KV, the largest
    # step's activations, CUDA graphs. Granted by the router's planner; 0: what
    # the device has free, less the headroom.
    device_memory_mib: int = 0
    # Automatic sizing on a GPU leaves this much device memory free.
    kv_headroom_mib: int = 1024
    # Decode steps replay CUDA graphs (GPU path only).
    cuda_graph: bool = True
    # Admission reserves KV for the prompt plus up to this many output tokens,
    # so admitted requests rarely need to be preempted.
    output_window: int = 256
    # CPU threads for torch; 0: torch's default.
    threads: int = 0
    # Seeds the shared generator of requests that bring no seed.
    seed: int = 0
    # How embedding requests pool (llama.cpp's --pooling): mean, cls or last;
    # None: the model's own sentence-transformers or GGUF setting, else last.
    pooling: str | None = None
    # Speculative decoding (engine/sampling/drafter.py): "none", "ngram"
    # (prompt lookup: the continuation of the sequence's last n tokens found
    # earlier in its own prompt and output, n from spec_ngram_max down to
    # spec_ngram_min), "draft" (draft_model's greedy guesses) or "mtp" (the
    # checkpoint's multi-token-prediction head's, engine/sampling/mtp_drafter.py);
    # up to draft_tokens guesses verified per step.
    spec: str = "none"
    draft_tokens: int = 4
    spec_ngram_min: int = 1
    spec_ngram_max: int = 3
    # With spec "draft": the draft model's checkpoint (a GGUF file or a Hugging
    # Face directory with the target's vocabulary), run greedily beside the
    # target on its device (engine/sampling/draft_model.py).
    draft_model: str | None = None
    # Where the routed experts of a mixture-of-experts model stay: "device",
    # or "host" (every layer's in page-locked host memory, read by the device
    # from there; attention, dense layers, norms, embeddings and routers stay
    # on the device). host_expert_layers N (llama.cpp's --n-cpu-moe): only the
    # first N layers' experts on the host, with expert_residency "device";
    # 0: none. A model without experts refuses both at load.
    expert_residency: str = "device"
    host_expert_layers: int = 0
    # Device memory (MiB) for a cache of recently used host-resident experts;
    # 0: none (every selected expert is read from host memory).
    expert_cache_mib: int = 0
    # Hybrid models (recurrent state): state checkpoints kept per lane, and
    # one every N prompt tokens of a long prefill (<= 0: none along the way);
    # engine/kv/state_checkpoints.py. Other models ignore both: they resume
    # any cached prefix from its KV pages alone.
    ctx_checkpoints: int = 4
    checkpoint_every_n_tokens: int = 8192
    # The KV pool's element type (KV_DTYPES): "fp8" stores K and V in float8
    # e4m3 with a per-tensor scale, twice the tokens in the same memory.
    kv_dtype: str = "bf16"
    # QUANTIZE_KINDS or None (the checkpoint's own types): "fp8" keeps the
    # projections in FP8, one byte an element (our CUDA kernels only).
    quantize: str | None = None
    # GGUF_WEIGHTS: "packed" keeps a GGUF's Q8_0/Q4_0/Q4_K/Q5_K/Q6_K matrices
    # in their blocks on the device (our CUDA kernels only).
    gguf_weights: str = "dequantized"
    # Images in (issue 21): vision loads the model's vision tower and lets
    # requests carry images; off, the router refuses them (400
    # vision_disabled). mmproj: the vision projector GGUF of a GGUF model,
    # as llama.cpp ships them in pairs (llama.cpp's --mmproj; the router
    # writes here the mmproj*.gguf it found in the model's directory); None:
    # the checkpoint's own tower (a Hugging Face directory).
    vision: bool = False
    mmproj: str | None = None
    # Batch-invariant mode (docs/architecture.md, "Batch-invariant mode"): a
    # request's tokens do not depend on what shares its steps, how its
    # prompt was chunked or which of its prefix came from the cache; every
    # token is computed as a decode row with fixed reduction orders. Slower.
    deterministic: bool = False

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page size must be a power of two, got {self.page_size}")
        if self.max_concurrency < 1:
            raise ValueError(f"max concurrency must be at least 1, got {self.max_concurrency}")
        if self.max_batched_tokens < self.max_concurrency:
            raise ValueError(
                f"max batched tokens ({self.max_batched_tokens}) must be at least the max "
                f"concurrency ({self.max_concurrency}) so every lane can decode each step"
            )
        if min(self.max_context, self.kv_headroom_mib, self.output_window, self.threads,
               self.prefix_cache_tokens, self.device_memory_mib) < 0:
            raise ValueError(
                "max context, KV headroom, output window, threads, prefix cache tokens and "
                "device memory must be >= 0"
            )
        if self.host_kv_mib < -1:
            raise ValueError("host KV must be a size in MiB, 0 (off) or -1 (auto), "
                             f"got {self.host_kv_mib}")
        if self.disk_kv_mib < 0 or self.disk_kv_restore_ms < 1:
            raise ValueError("disk KV must be a size in MiB >= 0 and its restore deadline at "
                             f"least 1 ms, got {self.disk_kv_mib} and {self.disk_kv_restore_ms}")
        if self.disk_kv_path and not self.host_kv_mib:
            raise ValueError("--disk-kv-path needs the host tier (--host-kv-mib N or auto): "
                             "pages reach the disk through it, and come back through it")
        if self.disk_kv_path and not self.disk_kv_mib:
            raise ValueError("--disk-kv-path needs --disk-kv-mib N, the most the tier may "
                             "keep on disk")
        if self.kv_capacity_tokens < -1:
            raise ValueError("KV capacity must be a token count, 0 (what the lanes use) or -1 "
                             f"(all the memory given), got {self.kv_capacity_tokens}")
        if self.pooling is not None and self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)} (or unset), "
                             f"got {self.pooling!r}")
        if self.spec not in SPEC_KINDS:
            raise ValueError(f"spec must be one of {', '.join(SPEC_KINDS)}, got {self.spec!r}")
        if (self.spec == "draft") != bool(self.draft_model):
            raise ValueError("--spec draft and --draft-model go together: a draft model "
                             f"drafts only with --spec draft (got spec {self.spec!r} and "
                             f"draft model {self.draft_model!r})")
        if self.draft_tokens < 1:
            raise ValueError(f"draft tokens must be at least 1, got {self.draft_tokens}")
        if not 1 <= self.spec_ngram_min <= self.spec_ngram_max:
            raise ValueError("n-gram sizes must satisfy 1 <= spec-ngram-min <= spec-ngram-max, "
                             f"got {self.spec_ngram_min} and {self.spec_ngram_max}")
        if self.expert_residency not in EXPERT_RESIDENCIES:
            raise ValueError(f"expert residency must be one of {', '.join(EXPERT_RESIDENCIES)}, "
                             f"got {self.expert_residency!r}")
        if self.ctx_checkpoints < 0:
            raise ValueError(f"--ctx-checkpoints must be 0 or more, got {self.ctx_checkpoints}")
        if self.host_expert_layers < 0 or self.expert_cache_mib < 0:
            raise ValueError("host expert layers and the expert cache must be >= 0, got "
                             f"{self.host_expert_layers} and {self.expert_cache_mib}")
        if self.expert_residency == "host" and self.host_expert_layers:
            raise ValueError(
                "--expert-residency host (--cpu-moe) keeps every layer's experts on the host, "
                f"--n-cpu-moe {self.host_expert_layers} only the first "
                f"{self.host_expert_layers} layers': give one of them")
        if self.expert_cache_mib and not self.host_experts:
            raise ValueError(f"--expert-cache-mib {self.expert_cache_mib} caches host-resident "
                             "experts on the device: it needs --expert-residency host "
                             "(--cpu-moe) or --n-cpu-moe N")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.gguf_weights not in GGUF_WEIGHTS:
            raise ValueError(f"--gguf-weights must be one of {', '.join(GGUF_WEIGHTS)}, "
                             f"got {self.gguf_weights!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"--kv-dtype must be one of {', '.join(KV_DTYPES)}, "
                             f"got {self.kv_dtype!r}")
        if self.mmproj is not None and not self.vision:
            raise ValueError("--mmproj names the vision projector of a model served with "
                             "--vision: add --vision (or drop --mmproj)")
        if self.quantize is not None and self.quantize not in QUANTIZE_KINDS:
            raise ValueError(f"--quantize must be one of {', '.join(QUANTIZE_KINDS)} (or unset), "
                             f"got {self.quantize!r}")
        if self.deterministic:
            self._check_deterministic()

    def _check_deterministic(self) -> None:
        """What --deterministic cannot promise, refused before any engine starts
        (the model's own kind, MoE or hybrid, is checked at load)."""
        refused = [
            (self.spec == "mtp", "--spec mtp: the MTP head comes with hybrid models, "
                                 "which the mode cannot serve"),
            (self.vision, "--vision: the vision tower's batched encoder has no "
                          "batch-invariant form"),
            (self.quantize is not None, f"--quantize {self.quantize}: FP8 projections have no "
                                        "batch-invariant kernel (serve the bf16 weights)"),
            (self.gguf_weights == "packed", "--gguf-weights packed: packed GGUF matrices have "
                                            "no batch-invariant kernel (dequantized, the "
                                            "default, is served as bf16)"),
        ]
        for refuse, why in refused:
            if refuse:
                raise ValueError(f"--deterministic cannot be combined with {why}")

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def host_experts(self) -> bool:
        """Whether any layer's routed experts stay in host memory."""
        return self.expert_residency == "host" or self.host_expert_layers > 0

    @property
    def host_expert_layer_count(self) -> int:
        """How many of the first layers keep their routed experts in host
        memory: -1 for every layer (expert_residency host), else
        host_expert_layers (0: none); what engine.models.build_model takes."""
        return -1 if self.expert_residency == "host" else self.host_expert_layers

    def to_json(self) -> str:
        return msgspec.json.encode(self).decode()

    @classmethod
    def from_json(cls, text: str) -> EngineOptions:
        return msgspec.json.decode(text, type=cls)
