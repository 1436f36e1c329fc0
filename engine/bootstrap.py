"""Builds a ready engine from its config: model, KV pool, runner, scheduler."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch

from engine.core import EngineCore
from engine.kv.block_hash import kv_fingerprint
from engine.kv.block_pool import BlockPool
from engine.kv.kv_manager import KVManager
from engine.kv_sizing import plan_kv
from engine.loader import load_model
from engine.model_runner import ModelRunner
from engine.sampler import Sampler
from engine.scheduler import Scheduler
from protocol import PROTOCOL_VERSION, EngineEvent, EngineOptions, KvFacts, ModelFacts, Ready

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(config: EngineOptions) -> torch.dtype:
    if config.dtype == "auto":
        return torch.bfloat16 if config.is_cuda else torch.float32
    return _DTYPES[config.dtype]


def build_engine(
    model_path: Path,
    config: EngineOptions,
    progress: Callable[[float, str], None],
    emit: Callable[[EngineEvent], None],
) -> tuple[EngineCore, Ready]:
    if config.threads:
        torch.set_num_threads(config.threads)
    device = torch.device(config.device)
    dtype = resolve_dtype(config)
    loaded = load_model(model_path, device, dtype, progress)
    model = loaded.config
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    bytes_per_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim * dtype_bytes
    plan = plan_kv(
        page_size=config.page_size,
        bytes_per_token=bytes_per_token,
        trained_context=model.max_position_embeddings,
        requested_context=config.max_context,
        requested_capacity=config.kv_capacity_tokens,
        max_concurrency=config.max_concurrency,
    )
    log.info(
        "KV pool: %d pages of %d tokens (%d tokens, %.1f MiB, %s), context %d, %d lanes",
        plan.num_pages, plan.page_size, plan.capacity_tokens, plan.total_bytes / 2**20,
        dtype, plan.max_context, config.max_concurrency,
    )
    sampler = Sampler(device, config.seed)
    runner = ModelRunner(
        loaded, model_path=model_path, device=device, dtype=dtype, num_pages=plan.num_pages,
        page_size=plan.page_size, sampler=sampler,
    )
    fingerprint = kv_fingerprint(
        str(model_path.resolve()), os.path.getmtime(model_path), str(dtype), plan.page_size
    )
    kv = KVManager(BlockPool(plan.num_pages, plan.page_size), fingerprint, config.output_window, plan.max_context)
    scheduler = Scheduler(
        kv,
        max_concurrency=config.max_concurrency,
        max_batched_tokens=config.max_batched_tokens,
        max_context=plan.max_context,
        stop_token_ids=model.eos_token_ids,
    )
    core = EngineCore(runner, scheduler, sampler, vocab_size=model.vocab_size, emit=emit)
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
            eos_token_ids=list(model.eos_token_ids),
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
    )
    return core, ready
