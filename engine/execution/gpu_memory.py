"""Device memory on a GPU: what a step needs, what the KV pool may take, and
the ledger the startup log prints.

Automatic KV sizing (vLLM's recipe): with the weights loaded, run the largest
step the scheduler can form (a prefill of max_batched_tokens tokens, then a
decode of every lane, each sampling) on a scratch KV pool and read torch's
peak; the KV pool then takes what the device has free, less that peak, less
room for the CUDA graphs' memory pool, less the headroom the operator asked
to keep. Because the profiled steps are the largest the scheduler forms, no
step later needs more than was set aside. The penalty counts of every lane
(engine/sampling/penalty_state.py) are set aside too: they are allocated only
when a request with penalties arrives, and then must fit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from engine.execution.step_inputs import DeviceInputs, StepInputs, as_decode_rows
from engine.models import CausalLM
from engine.sampling.penalty_state import penalty_state_bytes
from engine.sampling.sampler import Sampler
from engine.scheduling.sequence import Sequence
from protocol import MemoryFacts, SamplingParams

log = logging.getLogger(__name__)

MIB = 2**20
GIB = 2**30
# The graphs' pool holds one decode step's intermediates, captured largest
# first; this much slack covers allocator rounding on top of the profiled step.
GRAPH_POOL_SLACK_BYTES = 64 * MIB
# Device memory taken after sizing outside torch's allocator: kernel modules
# loaded at graph capture, cuBLAS workspaces for new shapes.
RUNTIME_SLACK_BYTES = 64 * MIB


@dataclass(frozen=True)
class StepPeaks:
    prefill_bytes: int  # beyond the weights and KV, for the largest prefill step
    decode_bytes: int  # the same for a decode step of every lane
    # The same for the largest step with prompt chunks that replays a graph
    # (engine/execution/chunk_graphs.py); 0 when there is none.
    chunk_graph_bytes: int = 0
    # The penalty counts of every lane, allocated at the first request with
    # penalties (engine/sampling/penalty_state.py).
    penalty_bytes: int = 0
    # A step with images under --vision: its tower passes and the embeddings
    # its forward reads (engine/execution/vision_memory.py); 0 without.
    image_step_bytes: int = 0

    @property
    def activation_bytes(self) -> int:
        """The largest step's peak, plus the penalty counts that live beside it."""
        return (max(self.prefill_bytes, self.decode_bytes, self.image_step_bytes)
                + self.penalty_bytes)

    @property
    def graph_reserve_bytes(self) -> int:
        """The graphs' pool: the largest captured step's intermediates."""
        return max(self.decode_bytes, self.chunk_graph_bytes) + GRAPH_POOL_SLACK_BYTES


@torch.inference_mode()
def profile_step_peaks(
    model: CausalLM,
    sampler: Sampler,
    *,
    max_batched_tokens: int,
    max_batch: int,
    page_size: int,
    device: torch.device,
    chunk_graph_tokens: int = 0,
) -> StepPeaks:
    """The peaks of the largest prefill and decode steps, and of a step of
    chunk_graph_tokens prompt tokens (the largest one a graph captures; 0:
    none is captured)."""
    config = model.config
    pages = -(-max_batched_tokens // page_size) + max_batch + 1
    shape = (pages, page_size, config.num_kv_heads, config.head_dim)
    dtype = model.embed_tokens.dtype
    scratch = [(torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device))
               for _ in range(config.num_attention_layers)]
    inputs = DeviceInputs(device)
    try:
        prefill = _peak(model, sampler, inputs, scratch, _prefill_step(max_batched_tokens,
                                                                         max_batch, page_size))
        decode = _peak(model, sampler, inputs, scratch, _decode_step(max_batch, page_size))
        chunk = 0
        if chunk_graph_tokens:
            chunk = _peak(model, sampler, inputs, scratch,
                          _prefill_step(chunk_graph_tokens, max_batch, page_size))
    finally:
        del scratch
        torch.cuda.empty_cache()
    return StepPeaks(prefill, decode, chunk, penalty_state_bytes(max_batch, config.vocab_size))


def _peak(model: CausalLM, sampler: Sampler, device_inputs: DeviceInputs,
          kv: list[tuple[torch.Tensor, torch.Tensor]], step: StepInputs) -> int:
    device = device_inputs.device
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    if model.config.has_recurrent_state:
        # A hybrid model's sequences each need a state row (the pools are attached).
        step.state_slots = np.arange(step.num_seqs, dtype=np.int64)
        step.state_fresh = np.ones(step.num_seqs, dtype=np.bool_)
    if model.ops.deterministic:
        # Batch-invariant mode runs every token as a decode row (step_inputs.py).
        step = as_decode_rows(step)
    input_ids, positions, meta = device_inputs.metadata(step)
    hidden = model.forward(input_ids, positions, meta, kv)
    rows = torch.tensor(step.sample_rows, dtype=torch.int64, device=device)
    logits = model.compute_logits(hidden.index_select(0, rows))
    # Sampled rows take the kernel's path, the costlier one.
    sampler.sample(logits, step.sample_seqs)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def _profile_seqs(count: int) -> list[Sequence]:
    params = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.9, top_k=40)
    return [Sequence(f"profile-{i}", [1], params) for i in range(count)]


def _prefill_step(tokens: int, max_batch: int, page_size: int) -> StepInputs:
    # One sequence of all the step's tokens, as a long prompt's chunk is, and
    # as many sampled rows as there are lanes (logits are per sampled row).
    pages = -(-tokens // page_size)
    rows = list(range(tokens - max_batch, tokens)) if tokens >= max_batch else list(range(tokens))
    positions = np.arange(tokens, dtype=np.int64)
    return StepInputs(
        input_ids=np.ones(tokens, dtype=np.int64),
        positions=positions,
        slot_mapping=positions.copy(),
        query_start_loc=np.array([0, tokens], dtype=np.int32),
        seq_lens=np.array([tokens], dtype=np.int32),
        block_tables=np.arange(pages, dtype=np.int32)[None, :],
        sample_rows=rows,
        sample_seqs=_profile_seqs(len(rows)),
    )


def _decode_step(batch: int, page_size: int) -> StepInputs:
    # Every lane one token in a page of its own.
    tables = np.arange(batch, dtype=np.int32)[:, None]
    return StepInputs(
        input_ids=np.ones(batch, dtype=np.int64),
        positions=np.zeros(batch, dtype=np.int64),
        slot_mapping=tables[:, 0].astype(np.int64) * page_size,
        query_start_loc=np.arange(batch + 1, dtype=np.int32),
        seq_lens=np.ones(batch, dtype=np.int32),
        block_tables=tables,
        sample_rows=list(range(batch)),
        sample_seqs=_profile_seqs(batch),
    )


@dataclass(frozen=True)
class MemoryLedger:
    total_bytes: int
    weights_bytes: int
    kv_bytes: int
    kv_pages: int
    kv_tokens: int
    activation_bytes: int
    workspace_bytes: int
    graph_bytes: int
    graph_count: int
    headroom_bytes: int
    free_bytes: int
    # A draft model's (--spec draft): weights, KV pool and decode workspace.
    draft_weights_bytes: int = 0
    draft_kv_bytes: int = 0
    draft_workspace_bytes: int = 0
    # Routed experts kept in page-locked host memory (--expert-residency
    # host, --n-cpu-moe): not in weights_bytes, since the device lacks them.
    host_weights_bytes: int = 0

    def facts(self) -> MemoryFacts:
        """What the router's device ledger counts for this model (a draft
        model's memory under weights, KV and workspace), and beside it the
        experts in host memory."""
        return MemoryFacts(weights_bytes=self.weights_bytes + self.draft_weights_bytes,
                           kv_bytes=self.kv_bytes + self.draft_kv_bytes,
                           activation_bytes=self.activation_bytes,
                           workspace_bytes=self.workspace_bytes + self.draft_workspace_bytes,
                           graph_bytes=self.graph_bytes,
                           host_weights_bytes=self.host_weights_bytes)

    def describe(self) -> str:
        return (
            f"device memory ledger: total {self.total_bytes / GIB:.2f} GiB = "
            f"weights {self.weights_bytes / GIB:.2f} GiB + "
            f"KV {self.kv_bytes / GIB:.2f} GiB ({self.kv_pages} pages, {self.kv_tokens} tokens) + "
            f"activations {self.activation_bytes / MIB:.0f} MiB (peak of the largest step, "
            f"penalty counts included) + "
            f"decode workspace {self.workspace_bytes / MIB:.0f} MiB + "
            f"CUDA graphs {self.graph_bytes / MIB:.0f} MiB ({self.graph_count} graphs) + "
            + (f"draft model: weights {self.draft_weights_bytes / GIB:.2f} GiB, KV "
               f"{self.draft_kv_bytes / GIB:.2f} GiB, decode workspace "
               f"{self.draft_workspace_bytes / MIB:.0f} MiB + " if self.draft_weights_bytes
               else "")
            + f"headroom {self.headroom_bytes / MIB:.0f} MiB; "
            f"{self.free_bytes / GIB:.2f} GiB free now"
            + (f"; routed experts in host memory {self.host_weights_bytes / GIB:.2f} GiB "
               "(not on the device)" if self.host_weights_bytes else "")
        )


def kv_budget_bytes(peaks: StepPeaks, headroom_bytes: int, device: torch.device,
                    cuda_graph: bool, *, grant_bytes: int = 0, weights_bytes: int = 0) -> int:
    """Device bytes the KV pool may take: free memory after the weights (and
    anything other processes hold), less the largest step's activations, the
    graphs' pool and the headroom. With a grant from the router's planner
    (the most this model may hold in all), never more than the grant less
    the weights, activations and graphs: the other models planned on the
    same device keep their room."""
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    step_reserve = (peaks.activation_bytes + RUNTIME_SLACK_BYTES
                    + (peaks.graph_reserve_bytes if cuda_graph else 0))
    budget = free - step_reserve - headroom_bytes
    if grant_bytes:
        budget = min(budget, grant_bytes - weights_bytes - step_reserve)
    return budget
