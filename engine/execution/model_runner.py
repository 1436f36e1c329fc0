"""Runs one scheduled step on the model: builds the flat batch, runs the
forward pass over the paged KV cache, and samples the rows that need a token.

The runner owns the engine's device state (weights, KV tensors, the decode
workspace and CUDA graphs), so putting it to sleep and waking it are its job too.

On a GPU in bf16 the model runs our kernels (engine/execution/model_ops.py);
decode steps replay CUDA graphs (engine/execution/cuda_graphs.py), and so do
steps with prompt chunks of up to a couple of thousand tokens
(engine/execution/chunk_graphs.py); longer steps run eagerly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.execution.chunk_graphs import ChunkGraphs, chunk_graph_tokens
from engine.execution.cuda_graphs import DecodeGraphs, context_bucket, context_buckets
from engine.execution.device_state import (
    DroppedWeights,
    KVCache,
    KVPageStash,
    WeightFiles,
    WeightsMode,
    WeightStash,
    device_bytes,
    release_device_memory,
)
from engine.execution.embeddings import PooledVectors, Pooler
from engine.execution.expert_cache import ExpertCache
from engine.execution.fp8_weight import Fp8Weight
from engine.execution.future_tokens import FutureTokens
from engine.execution.graph_memory import GraphMemory, collector_paused
from engine.execution.host_kv import HostKVPool
from engine.execution.model_ops import REFERENCE_OPS, CudaOps, ReferenceOps, make_ops
from engine.execution.multimodal_step import multimodal_step_inputs
from engine.execution.page_copy import copy_page_prefixes
from engine.execution.quantized_weight import QuantizedWeight
from engine.execution.recurrent_state import RecurrentStatePools, state_kernels_cover
from engine.execution.step_inputs import DeviceInputs, StepInputs, build_step_inputs
from engine.execution.vision_encoder import VisionEncoder
from engine.kv.host_tier import KVTransfers
from engine.loader import LoadedModel, load_model
from engine.models import CausalLM
from engine.models.multimodal_inputs import MultimodalStepInputs
from engine.sampling.draft_logprobs import DraftLogprobs, draft_contexts
from engine.sampling.logprobs import HostLogprobs, PromptScores, RowLogprobs
from engine.sampling.mtp_drafter import MTPDrafter
from engine.sampling.processed_logprobs import use_processed
from engine.sampling.sampler import Sampler
from engine.sampling.token_mask import TokenMask
from engine.scheduling.scheduler import SchedulerOutput
from protocol import TokenLogprobs

log = logging.getLogger(__name__)


@dataclass
class _Sleeping:
    kv: KVPageStash
    # None: the weights stayed where they were (the CPU device is host memory).
    weights: WeightStash | DroppedWeights | None
    # The vision tower's weights in host memory (a GPU engine with --vision).
    vision: WeightStash | None = None


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        *,
        model_path: Path,
        device: torch.device,
        dtype: torch.dtype,
        num_pages: int,
        page_size: int,
        sampler: Sampler,
        use_kernels: bool = False,
        max_batch: int = 0,
        max_context: int = 0,
        max_step_tokens: int = 0,
        cuda_graph: bool = False,
        host_kv_slots: int = 0,
        decode_rows: int = 0,
        expert_cache_bytes: int = 0,
        keep_hidden: bool = False,
        kv_dtype: torch.dtype | None = None,
        deterministic: bool = False,
    ):
        """Everything a step needs, built at once: the model's ops, a KV pool
        of num_pages pages and, with cuda_graph, the decode graphs.
        use_kernels: run our CUDA kernels (bf16 on a GPU); max_batch and
        max_context size their decode workspace and graphs, max_step_tokens
        (the scheduler's token budget) the graphs of steps with prompt
        chunks; host_kv_slots pages of host memory hold the host tier of the
        prefix cache (engine/execution/host_kv.py); decode_rows (max_batch
        if smaller) sizes the decode workspace and graphs: a verify step of
        up to that many tokens runs as decode rows (step_inputs.py);
        expert_cache_bytes of device memory cache host-resident experts
        (engine/execution/expert_cache.py, with our kernels); kv_dtype: the
        KV pool's element type (None: dtype; torch.float8_e4m3fn for
        --kv-dtype fp8, engine/execution/kv_dtype.py); keep_hidden: every
        step's final hidden states stay readable until the next step
        (last_hidden), for MTP drafting (set `mtp` to the drafter);
        deterministic: batch-invariant mode, every step laid out as decode
        rows on the batch-invariant ops (model_ops.py). The model keeps
        the kernel ops it was given (bootstrap sets them before measuring a
        step's memory, which sizes num_pages)."""
        if num_pages < 1:
            raise ValueError(f"a model runner needs a KV pool of at least one page, got {num_pages}")
        self.model = loaded.model
        self.config = loaded.config
        # Where a wake after Sleep(weights="disk") reads the weights again.
        self.model_path = model_path
        # Checked before a disk wake reads the files again (WeightFiles).
        self._weight_files = WeightFiles.of(Path(model_path))
        self.device = device
        self.dtype = dtype
        self.kv_dtype = kv_dtype or dtype
        self.num_pages = num_pages
        self.page_size = page_size
        self.sampler = sampler
        self.use_kernels = use_kernels
        self.max_batch = max_batch
        self.decode_rows = max(decode_rows, max_batch)
        self.max_context = max_context
        self.max_step_tokens = max_step_tokens
        self.cuda_graph = cuda_graph and use_kernels
        self.deterministic = deterministic
        self._inputs = DeviceInputs(device)
        if (use_kernels != isinstance(self.model.ops, CudaOps)
                or deterministic != self.model.ops.deterministic):
            self.model.ops = self._make_ops()
        self.kv_caches = self._allocate_kv()
        # A hybrid model's recurrent state (attached by bootstrap before the
        # step whose memory sizes the KV pool ran).
        self.state_pools: RecurrentStatePools | None = getattr(self.model, "state_pools", None)
        self.expert_cache_bytes = expert_cache_bytes
        self.expert_cache = self._make_expert_cache()
        # The host tier's pages; host memory, so it stays through a sleep.
        self.host_kv = (HostKVPool(host_kv_slots, num_layers=self.config.num_attention_layers,
                                   page_size=page_size, num_kv_heads=self.config.num_kv_heads,
                                   head_dim=self.config.head_dim, dtype=self.kv_dtype,
                                   device=device)
                        if host_kv_slots else None)
        # Tokens sampled by launched steps, for the steps launched after them.
        self.future = FutureTokens(max(max_batch, 1), device)
        # Embedding requests' vectors, and what their earlier chunks left.
        self.pooler = Pooler(device)
        # Page-locked buffers the sampled tokens reach the host through, used in
        # turn: a step samples at most twice (rows that need the step before on
        # the host go second), and at most two steps are not yet completed.
        self._host_tokens: list[torch.Tensor] = [torch.empty(0, dtype=torch.int64)] * 4
        self._host_turn = 0
        self._sleeping: _Sleeping | None = None
        self.graphs: DecodeGraphs | None = None
        self.chunk_graphs: ChunkGraphs | None = None
        self.graph_bytes = 0  # the graphs' memory pool
        # MTP drafting (engine/sampling/mtp_drafter.py) runs the head over
        # every step's rows; it reads their hidden states here.
        self.keep_hidden = keep_hidden
        self.hidden_out: torch.Tensor | None = None  # the graphs' copy of them
        self.last_hidden: torch.Tensor | None = None
        self._decode_replayed = False  # the last step's rows came from a decode graph
        self.mtp: MTPDrafter | None = None
        # The vision tower of a model served with --vision (bootstrap sets it).
        self.vision: VisionEncoder | None = None
        self.graph_seconds = self._capture_graphs()

    def _make_ops(self) -> ReferenceOps:
        return make_ops(self.config, self.device, use_kernels=self.use_kernels,
                        max_batch=self.decode_rows, max_context=self.max_context,
                        model=self.model, deterministic=self.deterministic)

    def _make_expert_cache(self) -> ExpertCache | None:
        if not (self.use_kernels and self.expert_cache_bytes):
            return None
        cache = ExpertCache(self.model, self.expert_cache_bytes, self.device)
        if cache.layers:
            log.info("expert cache: %d experts of each of %d host-resident layers on the "
                     "device, %.1f MiB", cache.slots_per_layer, len(cache.layers),
                     cache.nbytes / 2**20)
        else:
            log.warning("--expert-cache-mib %d holds not one expert of each host-resident "
                        "layer: no expert cache", self.expert_cache_bytes // 2**20)
        return cache

    def _capture_graphs(self) -> float:
        """With our kernels, set up the steps with prompt chunks that run
        padded (engine/execution/chunk_graphs.py); with graphs on, capture
        those first (their intermediates are the larger) and then the decode
        graphs. Returns the seconds taken."""
        if not self.use_kernels:
            return 0.0
        if self.config.has_recurrent_state and not state_kernels_cover(self.config):
            # The reference ops read the batch on the host: no graphs, no padded steps.
            log.info("%s: no CUDA graphs (our Gated DeltaNet kernels are not built for its "
                     "head sizes; its linear-attention layers run the torch reference)",
                     self.config.architecture)
            return 0.0
        started = time.perf_counter()
        reserved_before = torch.cuda.memory_reserved(self.device)
        memory = (GraphMemory(self.decode_rows, self.config.vocab_size, self.device)
                  if self.cuda_graph else None)
        # Batch-invariant mode lays every step out as decode rows: the decode
        # graphs serve those that fit, the rest run eagerly.
        chunk_tokens = 0 if self.deterministic else chunk_graph_tokens(self.max_step_tokens)
        if self.keep_hidden:
            self.hidden_out = torch.empty((max(self.decode_rows, chunk_tokens),
                                           self.config.hidden_size),
                                          dtype=self.dtype, device=self.device)
        if chunk_tokens:
            self.chunk_graphs = ChunkGraphs(
                self.model, self.kv_caches, self.future, memory, lanes=self.max_batch,
                max_tokens=self.max_step_tokens, max_context=self.max_context,
                page_size=self.page_size, device=self.device, hidden_out=self.hidden_out,
            )
        if memory is None:
            return 0.0
        self.graphs = DecodeGraphs(
            self.model, self.kv_caches, self.future, memory, max_batch=self.decode_rows,
            max_context=self.max_context, page_size=self.page_size, device=self.device,
            hidden_out=self.hidden_out,
        )
        with collector_paused():
            if self.chunk_graphs is not None:
                self.chunk_graphs.capture()
            self.graphs.capture()
        self.graph_bytes = torch.cuda.memory_reserved(self.device) - reserved_before
        seconds = time.perf_counter() - started
        chunk_sizes = self.chunk_graphs.sizes if self.chunk_graphs is not None else []
        log.info("captured %d CUDA graphs in %.2fs, %.1f MiB: decode batch sizes 1..%d with "
                 "context buckets %s; steps with prompt chunks of %s tokens", self.graph_count,
                 seconds, self.graph_bytes / 2**20, self.decode_rows, self.graphs.buckets,
                 f"{chunk_sizes[0]}..{chunk_sizes[-1]}" if chunk_sizes else "no")
        return seconds

    @property
    def graph_count(self) -> int:
        return sum(graphs.count for graphs in (self.graphs, self.chunk_graphs)
                   if graphs is not None)

    def _allocate_kv(self) -> list[KVCache]:
        shape = (self.num_pages, self.page_size, self.config.num_kv_heads, self.config.head_dim)
        dtype, device = self.kv_dtype, self.device
        return [(torch.zeros(shape, dtype=dtype, device=device),
                 torch.zeros(shape, dtype=dtype, device=device))
                for _ in range(self.config.num_attention_layers)]

    # ---- sleep and wake --------------------------------------------------------

    @property
    def asleep(self) -> bool:
        return self._sleeping is not None

    def device_bytes(self) -> int:
        """Device memory this process holds (CUDA: reserved by torch; CPU: 0)."""
        return device_bytes(self.device)

    def sleep(self, weights: WeightsMode, keep_pages: Sequence[int]) -> int:
        """Give the device memory back. keep_pages (the prefix cache's pages)
        are copied to host memory and return on wake(); every other page's
        contents are lost, so nothing may be running. weights="host" keeps a
        host copy of the weights (on the CPU device they already are one);
        "disk" drops them and wake() reads the model file again.
        Returns the bytes of host memory taken for the copies."""
        if self._sleeping is not None:
            raise RuntimeError("the model runner is already asleep")
        pin = self.device.type == "cuda"
        if pin:
            torch.cuda.synchronize(self.device)  # nothing may still replay a graph
        # Graphs hold the addresses of what is about to be freed (and the
        # graph objects the KV tensors: none may outlive this, not even as a
        # loop variable, or the KV pool stays reserved).
        if self.graphs is not None:
            self.graphs.release()
        if self.chunk_graphs is not None:
            self.chunk_graphs.release()
        self.graphs = self.chunk_graphs = None
        self.hidden_out = self.last_hidden = None
        if self.expert_cache is not None:
            self.expert_cache.release()
            self.expert_cache = None
        self.model.ops = REFERENCE_OPS  # drops the decode workspace
        kv = KVPageStash(self.kv_caches, keep_pages, pin=pin)
        self.kv_caches = []
        state_bytes = self.state_pools.stash() if self.state_pools is not None else 0
        stash: WeightStash | DroppedWeights | None
        if weights == "disk":
            stash = DroppedWeights(self.model)
        elif self.device.type == "cpu":
            stash = None
        else:
            stash = WeightStash(self.model, pin=pin)
        # The tower is small: kept in host memory whatever `weights` says.
        vision = (WeightStash(self.vision.tower, pin=pin)
                  if self.vision is not None and self.device.type != "cpu" else None)
        self._sleeping = _Sleeping(kv, stash, vision)
        release_device_memory(self.device)
        return (kv.nbytes + state_bytes + (vision.nbytes if vision is not None else 0)
                + (stash.nbytes if isinstance(stash, WeightStash) else 0))

    def wake(self) -> None:
        """Undo sleep(): weights and KV tensors back on the device, the kept
        pages back in their page ids. Raises on failure (a CUDA out-of-memory
        error, a model file changed meanwhile): the engine cannot go on."""
        sleeping = self._sleeping
        if sleeping is None:
            raise RuntimeError("the model runner is not asleep")
        if isinstance(sleeping.weights, DroppedWeights):
            sleeping.weights.put_back(self.model, self._reload_model())
        elif isinstance(sleeping.weights, WeightStash):
            sleeping.weights.put_back(self.model, self.device)
        if sleeping.vision is not None and self.vision is not None:
            sleeping.vision.put_back(self.vision.tower, self.device)
        self.kv_caches = self._allocate_kv()
        sleeping.kv.put_back(self.kv_caches)
        if self.state_pools is not None:
            self.state_pools.put_back()
        self.model.ops = self._make_ops()
        self.expert_cache = self._make_expert_cache()
        self._sleeping = None
        # The graphs captured before the sleep pointed at freed memory.
        self._capture_graphs()

    def _reload_model(self) -> CausalLM:
        # The kept KV pages (and the prefix-cache fingerprint) belong to the
        # weights loaded at start-up; a changed file must not be mixed in.
        # Never serve weights other than those validated at load, however
        # the file was rewritten: the engine ends and the router loads the
        # model afresh, as a new load, on its next request.
        changed = self._weight_files.changed()
        if changed:
            raise RuntimeError(
                f"{self.model_path} changed while the engine slept ({', '.join(changed[:3])}); "
                "its kept KV pages belong to the old weights: the model must be loaded again"
            )
        # Experts in host memory before the sleep go there again; FP8
        # matrices (--quantize fp8) are quantized again.
        fp8 = any(isinstance(m, Fp8Weight) for m in self.model.modules())
        loaded = load_model(self.model_path, self.device, self.dtype,
                            host_expert_layers=self.model.host_expert_layers,
                            with_mtp=getattr(self.model, "mtp", None) is not None,
                            quantize="fp8" if fp8 else None,
                            gguf_packed=any(isinstance(m, QuantizedWeight)
                                            for m in self.model.modules()))
        if loaded.config != self.config:
            raise RuntimeError(f"{self.model_path} now describes another model than it did at load")
        return loaded.model

    # ---- the host tier -----------------------------------------------------------

    def move_kv(self, transfers: KVTransfers) -> None:
        """Queue the copies between device pages and host tier slots that the
        scheduling of the next step asked for; the next forward pass runs
        after them (engine/execution/host_kv.py), and the copies of pages
        reused to the token after those (engine/execution/page_copy.py)."""
        if transfers.stores or transfers.loads:
            assert self.host_kv is not None and self.kv_caches, "host KV copies without a host tier"
            self.host_kv.run(transfers, self.kv_caches)
        if transfers.copies:
            copy_page_prefixes(transfers.copies, self.kv_caches)

    # ---- one step ----------------------------------------------------------------
    #
    # A step is launched in two calls, forward() then sample(), so the engine
    # can do host work in between (a grammar mask that needs the previous
    # step's token); neither waits for the device. SampledTokens.tolist() does.

    @torch.inference_mode()
    def forward(self, out: SchedulerOutput,
                draft_masks: Callable[[], TokenMask | None] | None = None) -> StepForward:
        """Launch the forward pass of a scheduled step; placeholder input ids
        (tokens still on the device) are read from the future-token buffer.
        A step that scores prompt tokens or pools an embedding runs eagerly:
        it needs the hidden states of those positions, which no graph keeps.
        A step that verifies drafts replays a decode graph when it fits the
        decode rows (every token a row: step_inputs.py), else runs eagerly.
        draft_masks, called once the forward pass is launched (the host fills
        grammar masks while the device runs it), gives the mask of the draft
        rows (EngineGrammar.fill_drafts), if any."""
        if self.expert_cache is not None:
            self.expert_cache.step()
        if self.state_pools is not None:
            self.state_pools.copy_rows(out.state_copies_before)
        step = self._forward_step(out, draft_masks)
        if self.state_pools is not None:
            # Queued after the forward pass: the states as this step leaves them.
            self.state_pools.copy_rows(out.state_copies_after)
        return step

    def _forward_step(self, out: SchedulerOutput,
                      draft_masks: Callable[[], TokenMask | None] | None) -> StepForward:
        inputs = build_step_inputs(out, self.page_size, self.decode_rows,
                                   every_token_a_row=self.deterministic)
        embedding = [(index, chunk) for index, chunk in enumerate(out.chunks)
                     if chunk.seq.params.pooling is not None]
        if (not embedding and not inputs.draft_rows
                and not any(chunk.scored for chunk in out.chunks)):
            return StepForward(inputs, self._logits(inputs))
        # A verify step laid out as decode rows replays a decode graph, which
        # gives every row's logits (step_inputs.py's _as_decode_rows).
        graph_logits = (self.graphs.run(inputs) if self.graphs is not None and not embedding
                        and not any(chunk.scored for chunk in out.chunks)
                        and self.graphs.handles(inputs) else None)
        hidden = self._forward(inputs) if graph_logits is None else None
        if graph_logits is not None:
            self._kept_from_graph(inputs, decode=True)
        draft_mask = draft_masks() if draft_masks is not None and inputs.draft_rows else None
        pooled = self.pooler.pool(hidden, inputs, embedding) if embedding else None
        scores: list[tuple[int, PromptScores]] = []
        for index, chunk in enumerate(out.chunks):
            if chunk.scored is None:
                continue
            first, last = chunk.scored
            row = int(inputs.chunk_starts[index]) + first - chunk.start
            targets = chunk.seq.token_ids[first + 1 : last + 1]
            # Logits a lane's worth of rows at a time: what the step's memory
            # was measured with (engine/execution/gpu_memory.py).
            scores.append((index, PromptScores.of(
                hidden[row : row + last - first], targets, chunk.seq.params.prompt_logprobs,
                max(self.max_batch, 1), self.model.compute_logits)))
        logits = None
        if inputs.sample_rows and graph_logits is not None:
            logits = graph_logits.index_select(0, self._rows(inputs.sample_rows))
        elif inputs.sample_rows:
            assert hidden is not None
            rows = hidden if len(inputs.sample_rows) == inputs.num_tokens else \
                hidden.index_select(0, self._rows(inputs.sample_rows))
            logits = self.model.compute_logits(rows)
        verified = None
        if inputs.draft_rows:
            # The target's token at a draft position is drawn from the row's
            # final distribution there, the argmax for a greedy row
            # (engine/sampling/verify.py). Logits a lane's worth of rows at a
            # time, as for prompt scores: what the step's memory was measured with.
            draft_rows = self._rows(inputs.draft_rows)
            # Copied out of the graph's buffer: the draws change them in place.
            draft_graph_logits = (graph_logits.index_select(0, draft_rows)
                                  if graph_logits is not None else None)
            draft_hidden = hidden.index_select(0, draft_rows) if hidden is not None else None
            lane_rows = max(self.max_batch, 1)
            # Penalties count the drafts before each position; log
            # probabilities are taken as plain decoding's (draft_logprobs.py).
            ahead = draft_contexts(inputs.draft_seqs, inputs.input_ids[inputs.draft_rows].tolist())
            asked = DraftLogprobs()
            targets: list[torch.Tensor] = []
            for first in range(0, len(inputs.draft_rows), lane_rows):
                block = slice(first, first + lane_rows)
                draft_logits = (draft_graph_logits[block] if draft_graph_logits is not None
                                else self.model.compute_logits(draft_hidden[block]))  # type: ignore[index]
                seqs = inputs.draft_seqs[block]
                raw = RowLogprobs.of(draft_logits, seqs)  # before draw_targets changes them
                targets.append(self.sampler.draw_targets(
                    draft_logits, seqs, inputs.draft_positions[block],
                    draft_mask.window(first, lane_rows) if draft_mask is not None else None,
                    ahead=ahead[block], resolve=self.future.resolve))
                asked.take(raw, draft_logits, seqs, targets[-1], self.sampler)
            drawn = torch.cat(targets)
            verified = self._targets_to_host(drawn, asked if asked.asked else None)
        return StepForward(inputs, logits, scores, pooled, verified,
                           drawn if inputs.draft_rows else None)

    def _targets_to_host(self, targets: torch.Tensor,
                         logprobs: DraftLogprobs | None = None) -> SampledTokens:
        """A verify step's target tokens (and the log probabilities of those
        of rows that ask) on their way to the host, through a buffer of their
        own (the sampled tokens' turns are for two steps)."""
        if self.device.type != "cuda":
            return SampledTokens(targets.tolist(), logprobs=logprobs)
        host = torch.empty(targets.numel(), dtype=torch.int64, pin_memory=True)
        host.copy_(targets, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return SampledTokens(host, done, logprobs)

    def forget(self, request_id: str) -> None:
        """A request ended: drop what the device side kept for it."""
        self.pooler.forget(request_id)

    @torch.inference_mode()
    def sample(self, step: StepForward, first_slot: int, mask: TokenMask | None = None,
               rows: list[int] | None = None) -> SampledTokens:
        """Launch the sampling of a step's sampling rows, or of some of them
        (rows: their indices among the step's sampling rows); mask, for
        grammar rows, is indexed by the rows sampled. Sampling row i's token
        goes to future slot first_slot + i and is copied to the host."""
        if step.logits is None:
            return SampledTokens([])
        logits, seqs = step.logits, step.inputs.sample_seqs
        if rows is not None:
            logits = logits.index_select(0, self._rows(rows))
            seqs = [seqs[row] for row in rows]
        # Before the sampler biases, masks and scales the logits in place.
        asked = RowLogprobs.of(logits, seqs)
        if not self.sampler.use_kernel:
            # The reference sampler draws on the host's schedule (torch
            # generators); its tokens are known at once.
            tokens = self.sampler.sample(logits, seqs, mask, self.future.resolve)
            device_tokens = torch.tensor(tokens, dtype=torch.int64).to(self.device)
            self.future.write(first_slot, device_tokens, rows)
            use_processed(asked, logits, seqs, self.sampler)
            return SampledTokens(tokens, logprobs=asked.to_host(device_tokens) if asked else None)
        device_tokens = self.sampler.sample_on_device(logits, seqs, mask, self.future.resolve)
        self.future.write(first_slot, device_tokens, rows)
        # Rows in logprobs_mode "processed": the distribution they drew from.
        use_processed(asked, logits, seqs, self.sampler)
        # Queued before the tokens' copy, so its done event covers them too.
        logprobs = asked.to_host(device_tokens) if asked else None
        return self._to_host(device_tokens, logprobs)

    def _logits(self, inputs: StepInputs) -> torch.Tensor | None:
        """float32 logits of the rows that sample, or None if none does."""
        if self.graphs is not None and self.graphs.handles(inputs):
            # The graph computes every row's logits; decode rows all sample
            # but for the rare one-token prompt chunk.
            logits = self.graphs.run(inputs)
            self._kept_from_graph(inputs, decode=True)
            if not inputs.sample_rows:
                return None
            if len(inputs.sample_rows) < inputs.num_tokens:
                logits = logits.index_select(0, self._rows(inputs.sample_rows))
            return logits
        if self.chunk_graphs is not None and self.chunk_graphs.handles(inputs):
            # The graph (or its eager twin) gathers the sampled rows' logits itself.
            logits = self.chunk_graphs.run(inputs)
            self._kept_from_graph(inputs)
            return logits if inputs.sample_rows else None
        hidden = self._forward(inputs)
        if not inputs.sample_rows:
            return None
        if len(inputs.sample_rows) < inputs.num_tokens:
            hidden = hidden.index_select(0, self._rows(inputs.sample_rows))
        return self.model.compute_logits(hidden)

    def _to_host(self, tokens: torch.Tensor, logprobs: HostLogprobs | None = None
                 ) -> SampledTokens:
        """Copy tokens into the next page-locked buffer (the others may still
        be read for the steps before) and mark when the copy is done."""
        self._host_turn = (self._host_turn + 1) % len(self._host_tokens)
        buffer = self._host_tokens[self._host_turn]
        if buffer.numel() < tokens.numel():
            buffer = torch.empty(max(tokens.numel(), 256), dtype=torch.int64,
                                 pin_memory=self.device.type == "cuda")
            self._host_tokens[self._host_turn] = buffer
        buffer[: tokens.numel()].copy_(tokens, non_blocking=True)
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        return SampledTokens(buffer[: tokens.numel()], done, logprobs)

    def _rows(self, rows: list[int]) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True)

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        bound = None
        if self.use_kernels and inputs.is_decode:
            # The decode kernel's split depends on this bound: an eager decode
            # step uses the bucket its graph would, so graphs on and off
            # compute the same numbers.
            bound = context_bucket(context_buckets(self.max_context), int(inputs.seq_lens.max()))
        input_ids, positions, meta = self._inputs.metadata(inputs, bound)
        # (Only the vision-language decoders take multimodal inputs.)
        extra = ({"multimodal": self._multimodal_inputs(inputs, positions)}
                 if inputs.media_chunks else {})
        hidden = self.model.forward(self.future.resolve(input_ids), positions, meta,
                                    self.kv_caches, **extra)
        if self.keep_hidden:
            self.last_hidden = hidden
            self._decode_replayed = False
        return hidden

    def _multimodal_inputs(self, inputs: StepInputs, positions: torch.Tensor
                           ) -> MultimodalStepInputs:
        """A step's image embeddings and multimodal RoPE table (its chunks
        that reach into prompts with images: StepInputs.media_chunks)."""
        assert self.vision is not None, "a prompt with images reached a model without vision"
        return multimodal_step_inputs(self.vision, self.model, inputs, positions)

    def _kept_from_graph(self, inputs: StepInputs, decode: bool = False) -> None:
        """A graph (decode: a decode graph) ran the step: its rows' hidden
        states are in hidden_out."""
        if self.hidden_out is not None:
            self.last_hidden = self.hidden_out[: inputs.num_tokens]
            self._decode_replayed = decode

    @torch.inference_mode()
    def after_sampling(self, out: SchedulerOutput, step: StepForward) -> None:
        """Every sampling of a step is launched: MTP drafting runs its head
        over the step's rows now, before the next step's forward pass
        overwrites their hidden states (engine/sampling/mtp_drafter.py)."""
        if self.mtp is None or self.last_hidden is None:
            return
        hidden, self.last_hidden = self.last_hidden, None
        decode = self.graphs if self._decode_replayed else None
        self._decode_replayed = False
        self.mtp.observe(out, step.inputs, hidden[: step.inputs.num_tokens], self.future,
                         step.targets, decode)


@dataclass
class StepForward:
    """A step whose forward pass is launched: its inputs and the float32
    logits of its sampling rows (None when no row samples)."""

    inputs: StepInputs
    logits: torch.Tensor | None
    # (chunk index, its prompt scores) for the chunks that score prompt tokens.
    scores: list[tuple[int, PromptScores]] = field(default_factory=list)
    # The embeddings of the requests whose prompt this step finished.
    pooled: PooledVectors | None = None
    # The target's tokens at the step's draft positions (StepInputs.draft_rows).
    verified: SampledTokens | None = None
    # The same tokens on the device (MTP drafting feeds them to its head).
    targets: torch.Tensor | None = None


class SampledTokens:
    """A step's sampled tokens (and the log probabilities of the rows that
    asked for them), on their way to the host."""

    def __init__(self, tokens: list[int] | torch.Tensor, done: torch.cuda.Event | None = None,
                 logprobs: HostLogprobs | DraftLogprobs | None = None) -> None:
        self._tokens = tokens
        self._done = done
        self._logprobs = logprobs

    def tolist(self) -> list[int]:
        """The tokens, once the device has them copied (waits for that)."""
        if isinstance(self._tokens, list):
            return self._tokens
        if self._done is not None:
            self._done.synchronize()
        return self._tokens.tolist()

    def logprobs(self) -> list[TokenLogprobs | None]:
        """Per sampled row, its log probabilities or None (after tolist())."""
        count = len(self._tokens)
        return self._logprobs.per_row(count) if self._logprobs is not None else [None] * count
