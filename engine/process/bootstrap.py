"""Builds a ready engine from its config: model, KV pool, runner, scheduler."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import torch

from engine.execution.chunk_graphs import chunk_graph_tokens
from engine.execution.cuda_graphs import decode_row_capacity
from engine.execution.device_state import device_tensors, host_resident_tensors
from engine.execution.gpu_memory import MemoryLedger, StepPeaks, kv_budget_bytes, profile_step_peaks
from engine.execution.kv_dtype import check_fp8_supported, kv_torch_dtype
from engine.execution.model_ops import CudaOps, kernels_usable, make_ops
from engine.execution.model_runner import ModelRunner
from engine.execution.vision_encoder import (
    VisionEncoder,
    load_gguf_vision_encoder,
    load_vision_encoder,
)
from engine.execution.vision_memory import profile_vision_pass
from engine.kv.block_hash import kv_fingerprint
from engine.kv.block_pool import BlockPool
from engine.kv.disk_tier import DiskTier, artifact_digest, format_digest, tier_directory
from engine.kv.host_tier import HostTier
from engine.kv.kv_manager import KVManager
from engine.kv.kv_sizing import HostKvPlan, KvPlan, plan_host_kv, plan_kv
from engine.kv.state_checkpoints import StateCheckpoints
from engine.loader import LoadedModel, load_model
from engine.loader.pooling import choose_pooling
from engine.loader.vocabulary import check_same_vocabulary
from engine.process.deterministic_setup import log_mode, refuse_unsupported
from engine.process.recurrent_setup import (
    attach_recurrent_state,
    share_host_tier,
    without_disk_tier,
)
from engine.sampling.draft_model import DraftModelDrafter
from engine.sampling.drafter import Drafter, NgramDrafter
from engine.sampling.mtp_drafter import MTPDrafter
from engine.sampling.sampler import Sampler
from engine.scheduling.core import EngineCore
from engine.scheduling.scheduler import Scheduler
from protocol import (
    PROTOCOL_VERSION,
    EngineEvent,
    EngineOptions,
    KvFacts,
    MemoryFacts,
    ModelFacts,
    Ready,
)

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(config: EngineOptions) -> torch.dtype:
    if config.dtype == "auto":
        return torch.bfloat16 if config.is_cuda else torch.float32
    return _DTYPES[config.dtype]


def _device(config: EngineOptions) -> torch.device:
    """The engine's device with an explicit index ("cuda" is the current GPU)."""
    device = torch.device(config.device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def build_engine(
    model_path: Path,
    config: EngineOptions,
    progress: Callable[[float, str], None],
    emit: Callable[[EngineEvent], None],
) -> tuple[EngineCore, Ready]:
    if config.threads:
        torch.set_num_threads(config.threads)
    device = _device(config)
    if device.type == "cuda":
        # Our kernels and torch's launch on the current device's stream.
        torch.cuda.set_device(device)
    dtype = resolve_dtype(config)
    if config.draft_model:
        # Before any weights load: a draft of another vocabulary is refused at once.
        check_same_vocabulary(model_path, Path(config.draft_model))
    loaded = load_model(model_path, device, dtype, progress, with_mtp=config.spec == "mtp",
                        host_expert_layers=config.host_expert_layer_count,
                        quantize=config.quantize, gguf_packed=config.gguf_weights == "packed")
    return assemble_engine(loaded, model_path, config, progress, emit)


def assemble_engine(
    loaded: LoadedModel,
    model_path: Path,
    config: EngineOptions,
    progress: Callable[[float, str], None],
    emit: Callable[[EngineEvent], None],
) -> tuple[EngineCore, Ready]:
    """Everything after the weights: KV sizing, runner, graphs, scheduler.
    model_path names the checkpoint (a wake after Sleep(weights="disk") reads
    it again; its mtime is part of the prefix cache's fingerprint)."""
    device = _device(config)
    dtype = resolve_dtype(config)
    model = loaded.config
    # --kv-dtype fp8: one byte an element, twice the tokens in the same memory.
    kv_dtype = kv_torch_dtype(config.kv_dtype, dtype)
    # Only full-attention layers keep K and V in pages (a hybrid model's
    # linear-attention layers keep recurrent state: engine/process/recurrent_setup.py).
    bytes_per_token = (2 * model.num_attention_layers * model.num_kv_heads * model.head_dim
                       * kv_dtype.itemsize)
    use_kernels = kernels_usable(device, dtype, model)
    check_fp8_supported(config.kv_dtype, device, dtype, use_kernels)
    if device.type == "cuda" and not use_kernels:
        log.warning("our CUDA kernels need CuPy (pip install 'roundhouse[cuda13]' or "
                    "'[cuda12]'), bfloat16 and head size 64, 128 or 256 (this model: %s, %d): "
                    "running the torch reference ops, without CUDA graphs", dtype,
                    model.head_dim)
    if device.type == "cuda" and config.host_experts and not use_kernels:
        raise ValueError("host-resident experts (--expert-residency host, --n-cpu-moe) are read "
                         "by our CUDA kernels, which need CuPy and bfloat16: install "
                         "'roundhouse[cuda13]' (or [cuda12]) and serve in bfloat16")
    if config.deterministic:
        refuse_unsupported(loaded, use_kernels)
        log_mode(use_kernels)
    sampler = Sampler(device, config.seed, use_kernel=use_kernels,
                      deterministic=config.deterministic)
    served_context = config.max_context or model.max_position_embeddings
    # The ops first: the step whose memory sizes the KV pool runs on them.
    decode_rows = decode_row_capacity(config.max_concurrency,
                                      config.draft_tokens if config.spec != "none" else 0)
    loaded.model.ops = make_ops(model, device, use_kernels=use_kernels,
                                max_batch=decode_rows, max_context=served_context,
                                model=loaded.model, deterministic=config.deterministic)
    state_pools = attach_recurrent_state(loaded, config, device, dtype)
    # Before the step's memory is measured: the tower's weights are on the device.
    vision = _load_vision(config, model_path, loaded, device, dtype)
    # Walks every tensor: counted once, for the KV budget, the ledger and Ready.
    weights_bytes = loaded_weights_bytes(loaded) + (vision.weights_bytes if vision else 0)
    host_weights_bytes = _log_host_experts(loaded, device)
    # Loaded before the step is measured, so the free memory read after it
    # already leaves out the draft's weights.
    draft = _load_draft(config, device, dtype, served_context, decode_rows)
    draft_weights_bytes = loaded_weights_bytes(draft) if draft is not None else 0
    draft_bytes_per_token = (draft.config.kv_bytes_per_token(dtype) if draft is not None else 0)
    # An MTP head's attention layer keeps K/V in pages of its own, one per target page.
    if config.spec == "mtp":
        draft_bytes_per_token = MTPDrafter.kv_bytes_per_token(loaded.model, dtype)
    headroom_bytes = config.kv_headroom_mib * 2**20
    expert_cache_bytes = config.expert_cache_mib * 2**20
    if expert_cache_bytes and device.type != "cuda":
        raise ValueError("--expert-cache-mib caches host-resident experts in a GPU's memory; "
                         "on the CPU every expert is in host memory already: drop the option")
    budget = None
    cuda_graph = config.cuda_graph and use_kernels
    # Batch-invariant mode captures no graphs of prompt chunks (model_runner.py).
    chunk_tokens = (chunk_graph_tokens(config.max_batched_tokens)
                    if cuda_graph and not config.deterministic else 0)
    if device.type == "cuda":
        progress(1.0, "measuring the largest step's memory")
        peaks = profile_step_peaks(
            loaded.model, sampler, max_batched_tokens=config.max_batched_tokens,
            max_batch=config.max_concurrency, page_size=config.page_size, device=device,
            chunk_graph_tokens=chunk_tokens,
        )
        if vision is not None:
            progress(1.0, "measuring the vision tower's memory")
            image_step = profile_vision_pass(vision).image_step_bytes(
                peaks.prefill_bytes, config.max_batched_tokens)
            peaks = dataclasses.replace(peaks, image_step_bytes=image_step)
        # The expert cache (engine/execution/expert_cache.py) is allocated with
        # the model runner, after the pool is planned: its room is set aside.
        budget = kv_budget_bytes(peaks, headroom_bytes + expert_cache_bytes, device, cuda_graph,
                                 grant_bytes=config.device_memory_mib * 2**20,
                                 weights_bytes=weights_bytes + draft_weights_bytes)
    # The draft model's KV pool gets as many pages as the target's: the
    # budget is shared per token between the two.
    plan = plan_kv(
        page_size=config.page_size,
        bytes_per_token=bytes_per_token + draft_bytes_per_token,
        trained_context=model.max_position_embeddings,
        requested_context=config.max_context,
        requested_capacity=config.kv_capacity_tokens,
        max_concurrency=config.max_concurrency,
        prefix_cache_tokens=config.prefix_cache_tokens,
        device_budget_bytes=budget,
    )
    plan = dataclasses.replace(plan, bytes_per_token=bytes_per_token)
    drafter = _drafter(config, draft, plan, device, model.vocab_size, loaded)
    log.info(
        "KV pool: %d pages of %d tokens (%d tokens, %.1f MiB, %s), context %d, %d lanes",
        plan.num_pages, plan.page_size, plan.capacity_tokens, plan.total_bytes / 2**20,
        kv_dtype, plan.max_context, config.max_concurrency,
    )
    host_plan = _plan_host_tier(config, plan, device)
    no_disk = state_pools is not None and without_disk_tier(config, model.architecture)
    if state_pools is not None:
        host_plan = share_host_tier(host_plan, state_pools)
    if device.type == "cuda":
        progress(1.0, "capturing CUDA graphs" if cuda_graph else "allocating the KV pool")
    runner = ModelRunner(
        loaded, model_path=model_path, device=device, dtype=dtype, num_pages=plan.num_pages,
        page_size=plan.page_size, sampler=sampler, use_kernels=use_kernels,
        max_batch=config.max_concurrency, max_context=plan.max_context,
        max_step_tokens=config.max_batched_tokens, cuda_graph=cuda_graph,
        host_kv_slots=host_plan.num_slots, decode_rows=decode_rows,
        expert_cache_bytes=expert_cache_bytes if use_kernels else 0, kv_dtype=kv_dtype,
        keep_hidden=isinstance(drafter, MTPDrafter), deterministic=config.deterministic,
    )
    runner.vision = vision
    if isinstance(drafter, MTPDrafter):
        runner.mtp = drafter
        drafter.enable_graphs(runner.graphs)
    if cuda_graph and isinstance(drafter, DraftModelDrafter) \
            and isinstance(drafter.model.ops, CudaOps):
        _capture_draft_graphs(drafter, config, decode_rows, plan.max_context, device)
    if host_plan.num_slots:
        log.info("host memory ledger: KV host tier %.1f MiB (%d pages of %d tokens, %s), "
                 "of %.1f MiB the tier may take (host memory available less the reserve)",
                 host_plan.total_bytes / 2**20, host_plan.num_slots, plan.page_size,
                 "page-locked" if device.type == "cuda" else "plain memory",
                 host_plan.limit_bytes / 2**20)
    # The ledger's KV figure includes a hybrid model's recurrent state and checkpoints.
    state_bytes = state_pools.nbytes if state_pools is not None else 0
    if isinstance(drafter, MTPDrafter):
        state_bytes += drafter.kv_bytes
    if device.type == "cuda":
        ledger = _ledger(runner, peaks, plan.total_bytes + state_bytes, plan.num_pages,
                         plan.capacity_tokens,
                         headroom_bytes, weights_bytes, draft_weights_bytes, drafter)
        ledger = dataclasses.replace(ledger, host_weights_bytes=host_weights_bytes)
        log.info("%s", ledger.describe())
        memory = ledger.facts()
    else:
        draft_kv_bytes = drafter.kv_bytes if isinstance(drafter, DraftModelDrafter) else 0
        memory = MemoryFacts(weights_bytes=weights_bytes + draft_weights_bytes,
                             kv_bytes=plan.total_bytes + state_bytes + draft_kv_bytes,
                             host_weights_bytes=host_weights_bytes)
    fingerprint = kv_fingerprint(
        str(model_path.resolve()), os.path.getmtime(model_path), str(dtype), plan.page_size,
        # Named only when it differs, so bf16 pools keep the hashes they had.
        *(() if kv_dtype == dtype else (str(kv_dtype),)),
        # Pages another mode computed (the disk tier outlives the engine) hold
        # K/V of other arithmetic: never a hit in batch-invariant mode.
        *(("deterministic",) if config.deterministic else ()),
    )
    host_tier = (HostTier(host_plan.num_slots, plan.page_size, host_plan.page_bytes)
                 if host_plan.num_slots else None)
    disk_tier = None if no_disk else _disk_tier(config, model_path, runner, host_tier)
    kv = KVManager(BlockPool(plan.num_pages, plan.page_size), fingerprint, config.output_window,
                   plan.max_context, host=host_tier, disk=disk_tier)
    if state_pools is not None:
        # Without checkpoints (--ctx-checkpoints 0) no cached prefix is reused.
        kv.checkpoints = StateCheckpoints(state_pools.checkpoints, plan.page_size, fingerprint,
                                          host_count=state_pools.host_rows)
    scheduler = Scheduler(
        kv,
        max_concurrency=config.max_concurrency,
        max_batched_tokens=config.max_batched_tokens,
        max_context=plan.max_context,
        drafter=drafter,
        draft_tokens=config.draft_tokens,
        max_verify_rows=decode_rows,
        recurrent_state=state_pools is not None,
        checkpoint_every=max(config.checkpoint_every_n_tokens, 0),
        state_backup_row=state_pools.backup_row if state_pools is not None else -1,
        greedy_drafts_only=config.deterministic,
    )
    if config.spec == "ngram":
        log.info("speculative decoding: %s, up to %d draft tokens per step, n-grams %d..%d",
                 config.spec, config.draft_tokens, config.spec_ngram_min, config.spec_ngram_max)
    elif isinstance(drafter, MTPDrafter):
        log.info("speculative decoding: the checkpoint's MTP head, up to %d draft tokens per "
                 "step, its K/V %d pages (%.1f MiB)", config.draft_tokens, plan.num_pages,
                 drafter.kv_bytes / 2**20)
    elif draft is not None:
        log.info("speculative decoding: draft model %s (%d layers, %d hidden), up to %d draft "
                 "tokens per step, its KV pool %d pages (%.1f MiB)", config.draft_model,
                 draft.config.num_layers, draft.config.hidden_size, config.draft_tokens,
                 plan.num_pages, plan.num_pages * plan.page_size * draft_bytes_per_token / 2**20)
    core = EngineCore(runner, scheduler, sampler, vocab_size=model.vocab_size, emit=emit)
    pooling, why = choose_pooling(config.pooling, loaded.pooling)
    log.info("embeddings: %s pooling (%s), %d dimensions", pooling, why, model.hidden_size)
    ready = Ready(
        protocol_version=PROTOCOL_VERSION,
        pid=os.getpid(),
        model=ModelFacts(
            architecture=model.architecture,
            n_vocab=model.vocab_size,
            n_ctx_train=model.max_position_embeddings,
            n_embd=model.hidden_size,
            n_layer=model.num_layers,
            n_head=model.num_heads,
            n_head_kv=model.num_kv_heads,
            n_params=loaded.n_params,
            size_bytes=loaded.size_bytes,
            dtype=str(dtype).removeprefix("torch."),
            device=str(device),
            pooling=pooling,
        ),
        kv=KvFacts(
            page_size=plan.page_size,
            num_pages=plan.num_pages,
            max_context=plan.max_context,
            max_concurrency=config.max_concurrency,
            max_batched_tokens=config.max_batched_tokens,
            bytes_per_token=bytes_per_token,
        ),
        load_seconds=0.0,
        memory=memory,
    )
    return core, ready


def _load_vision(config: EngineOptions, model_path: Path, loaded: LoadedModel,
                 device: torch.device, dtype: torch.dtype) -> VisionEncoder | None:
    """The vision tower, for --vision (engine/execution/vision_encoder.py)."""
    if not config.vision:
        return None
    if config.mmproj:
        return _load_mmproj(config, model_path, loaded, device, dtype)
    if not loaded.config.mrope_section:
        raise ValueError(f"--vision: {loaded.config.architecture} is not a vision-language "
                         "model this server reads images for (Qwen2.5-VL, Qwen3-VL)")
    if config.spec == "mtp":
        raise ValueError("--vision with --spec mtp is not supported: the MTP head would draft "
                         "from image tokens' embeddings it never sees")
    return load_vision_encoder(model_path, device, dtype)


def _load_mmproj(config: EngineOptions, model_path: Path, loaded: LoadedModel,
                 device: torch.device, dtype: torch.dtype) -> VisionEncoder:
    """The tower of --mmproj, llama.cpp's vision projector GGUF, for a
    vision-language text GGUF (loaded.gguf_text: load_model reads it)."""
    assert config.mmproj is not None
    mmproj = Path(config.mmproj)
    if loaded.gguf_text is None:
        what = ("a Hugging Face directory, whose vision tower is its own: drop --mmproj"
                if model_path.is_dir() and (model_path / "config.json").is_file()
                else f"a {loaded.config.architecture} model, not a vision-language GGUF "
                     "(qwen2vl, qwen3vl)")
        raise ValueError(f"--mmproj {mmproj.name}: {model_path.name} is {what}")
    if config.spec == "mtp":
        raise ValueError("--vision with --spec mtp is not supported: the MTP head would draft "
                         "from image tokens' embeddings it never sees")
    return load_gguf_vision_encoder(mmproj, loaded.gguf_text, device, dtype)


def _load_draft(config: EngineOptions, device: torch.device, dtype: torch.dtype,
                served_context: int, decode_rows: int) -> LoadedModel | None:
    """The draft model of --spec draft, on the target's device and dtype with
    the same kind of ops (our kernels where they run), or None."""
    if config.spec != "draft" or not config.draft_model:
        return None
    draft = load_model(Path(config.draft_model), device, dtype)
    if draft.config.has_recurrent_state:
        raise ValueError(f"--draft-model {config.draft_model} is a hybrid model "
                         f"({draft.config.architecture}); a draft model must be a plain "
                         "decoder (its KV cache is paged only)")
    if draft.config.max_position_embeddings < served_context:
        raise ValueError(
            f"--draft-model {config.draft_model} was trained for {draft.config.max_position_embeddings} "
            f"tokens of context, less than the {served_context} served: lower --max-context")
    draft.model.ops = make_ops(draft.config, device,
                               use_kernels=kernels_usable(device, dtype, draft.config),
                               max_batch=decode_rows, max_context=served_context,
                               model=draft.model)
    return draft


def _capture_draft_graphs(drafter: DraftModelDrafter, config: EngineOptions,
                          decode_rows: int, max_context: int, device: torch.device) -> None:
    """The draft model's drafting rounds as CUDA graphs: a catch-up of up to
    decode_rows tokens (a verify step's worth), chains for every lane."""
    reserved = torch.cuda.memory_reserved(device)
    started = time.monotonic()
    drafter.enable_graphs(catch_up_rows=decode_rows, max_rows=config.max_concurrency,
                          max_tokens=config.draft_tokens, max_context=max_context)
    assert drafter.graphs is not None
    log.info("draft model: captured %d CUDA graphs in %.2fs, %.1f MiB", drafter.graphs.count,
             time.monotonic() - started, (torch.cuda.memory_reserved(device) - reserved) / 2**20)


def _drafter(config: EngineOptions, draft: LoadedModel | None, plan: KvPlan,
             device: torch.device, target_vocab: int, target: LoadedModel) -> Drafter | None:
    if config.spec == "ngram":
        return NgramDrafter(config.spec_ngram_min, config.spec_ngram_max)
    if config.spec == "mtp":
        if not target.config.has_recurrent_state:
            raise ValueError("--spec mtp drafts with the MTP head of Qwen3-Next and Qwen3.5 "
                             f"checkpoints; {target.config.architecture} has none")
        return MTPDrafter(target.model, num_pages=plan.num_pages, page_size=plan.page_size,
                          lanes=config.max_concurrency, max_tokens=config.draft_tokens,
                          vocab_limit=target_vocab, device=device)
    if draft is None:
        return None
    return DraftModelDrafter(draft.model, num_pages=plan.num_pages, page_size=plan.page_size,
                             max_step_tokens=config.max_batched_tokens,
                             vocab_limit=min(target_vocab, draft.config.vocab_size), device=device)


def _plan_host_tier(config: EngineOptions, plan: KvPlan, device: torch.device) -> HostKvPlan:
    """The host tier's size from --host-kv-mib and the host memory available
    now (on the CPU less the KV pool, which is about to take its share)."""
    memory = psutil.virtual_memory()
    available = memory.available - (plan.total_bytes if device.type == "cpu" else 0)
    host_plan = plan_host_kv(config.host_kv_mib, plan.bytes_per_token * plan.page_size,
                             available, memory.total)
    if config.host_kv_mib and host_plan.capped:
        log.warning("--host-kv-mib %s: only %.1f MiB of host memory may be taken (available "
                    "less a reserve of max(25%% of the total, 4 GiB)); the host tier gets %d "
                    "pages", "auto" if config.host_kv_mib < 0 else config.host_kv_mib,
                    host_plan.limit_bytes / 2**20, host_plan.num_slots)
    if config.host_kv_mib and not host_plan.num_slots:
        log.warning("--host-kv-mib: not even one KV page (%d bytes) fits; the host tier is off",
                    host_plan.page_bytes)
    return host_plan


def _disk_tier(config: EngineOptions, model_path: Path, runner: ModelRunner,
               host_tier: HostTier | None) -> DiskTier | None:
    """The disk tier under --disk-kv-path, in the subdirectory of this model's
    files and KV format (EngineOptions refuses it without a host tier)."""
    if not config.disk_kv_path:
        return None
    if host_tier is None or runner.host_kv is None:
        log.warning("--disk-kv-path: the host tier is off (no memory for it), so is the disk tier")
        return None
    model = runner.config
    kv_format = format_digest(str(runner.host_kv.dtype), host_tier.page_size,
                              model.num_attention_layers,
                              model.num_kv_heads, model.head_dim)
    directory = tier_directory(Path(config.disk_kv_path), artifact_digest(model_path), kv_format)
    tier = DiskTier(directory, kv_format=kv_format, page_size=host_tier.page_size,
                    page_bytes=host_tier.page_bytes, budget_bytes=config.disk_kv_mib * 2**20,
                    restore_seconds=config.disk_kv_restore_ms / 1000, memory=runner.host_kv)
    log.info("disk memory ledger: KV disk tier up to %d MiB in %s (%d pages held now), "
             "restores cut after %d ms", config.disk_kv_mib, directory, tier.num_cached,
             config.disk_kv_restore_ms)
    return tier


def loaded_weights_bytes(loaded: LoadedModel) -> int:
    """Device bytes of the weights and buffers (a tied lm_head once); the
    routed experts kept in host memory are not among them."""
    return sum(t.numel() * t.element_size() for t in device_tensors(loaded.model).values())


def host_weights_bytes(loaded: LoadedModel) -> int:
    """Bytes of the routed experts kept in host memory (--expert-residency
    host, --n-cpu-moe)."""
    return sum(t.numel() * t.element_size()
               for t in host_resident_tensors(loaded.model).values())


def _log_host_experts(loaded: LoadedModel, device: torch.device) -> int:
    """The host memory ledger's line for host-resident experts; their bytes."""
    nbytes = host_weights_bytes(loaded)
    if nbytes:
        layers = sum(1 for m in loaded.model.modules() if getattr(m, "host_resident", False))
        log.info("host memory ledger: routed experts of %d of %d layers %.1f MiB (%s), "
                 "read by the device from there; not in the device's weights",
                 layers, loaded.config.num_layers, nbytes / 2**20,
                 "page-locked" if device.type == "cuda" else "plain memory")
    return nbytes


def _ledger(runner: ModelRunner, peaks: StepPeaks, kv_bytes: int, kv_pages: int,
            kv_tokens: int, headroom_bytes: int, weights_bytes: int,
            draft_weights_bytes: int = 0, drafter: Drafter | None = None) -> MemoryLedger:
    device = runner.device
    free, total = torch.cuda.mem_get_info(device)
    ops = runner.model.ops
    ledger = MemoryLedger(
        total_bytes=total,
        weights_bytes=weights_bytes,
        kv_bytes=kv_bytes,
        kv_pages=kv_pages,
        kv_tokens=kv_tokens,
        activation_bytes=peaks.activation_bytes,
        workspace_bytes=(ops.workspace_bytes() if isinstance(ops, CudaOps) else 0)
        + (runner.expert_cache.nbytes if runner.expert_cache is not None else 0),
        graph_bytes=runner.graph_bytes,
        graph_count=runner.graph_count,
        headroom_bytes=headroom_bytes,
        free_bytes=free,
        draft_weights_bytes=draft_weights_bytes,
        draft_kv_bytes=drafter.kv_bytes if isinstance(drafter, DraftModelDrafter) else 0,
        draft_workspace_bytes=(drafter.workspace_bytes()
                               if isinstance(drafter, DraftModelDrafter) else 0),
    )
    return ledger
