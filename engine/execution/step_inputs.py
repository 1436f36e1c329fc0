"""The flat batch of one scheduled step, built on the host with numpy.

A step's inputs are a handful of small integer arrays (token ids, positions,
KV slots, sequence bounds, page tables). They are built in numpy, not in
Python lists of torch tensors, because the host CPU of our GPU machines is
slow and this runs every step; on CUDA they travel through page-locked
staging buffers, so each copy to the device is one asynchronous DMA.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.execution.attention_metadata import AttentionMetadata
from engine.scheduling.scheduler import ScheduledChunk, SchedulerOutput
from engine.scheduling.sequence import Sequence


@dataclass
class StepInputs:
    input_ids: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T]
    slot_mapping: np.ndarray  # int64 [T]
    query_start_loc: np.ndarray  # int32 [B + 1]
    seq_lens: np.ndarray  # int32 [B]
    block_tables: np.ndarray  # int32 [B, max_pages]
    sample_rows: list[int]  # flat rows whose logits are sampled, in chunk order
    sample_seqs: list[Sequence]
    # Flat rows of draft tokens (engine/sampling/verify.py), in chunk order:
    # the target's token drawn there verifies the draft. A chunk with a draft
    # samples at its first row (its newest known token), not its last.
    draft_rows: list[int] = field(default_factory=list)
    # Per draft row, its sequence and the output index of the token drawn
    # there (the key of a seeded row's random stream on the kernel path).
    draft_seqs: list[Sequence] = field(default_factory=list)
    draft_positions: list[int] = field(default_factory=list)
    # Hybrid models: each sequence's recurrent-state row, and whether it
    # starts from zero state (its first chunk); None for other models.
    state_slots: np.ndarray | None = None  # int64 [B]
    state_fresh: np.ndarray | None = None  # bool [B]
    # A verify step laid out as decode rows: each sequence's bounds for the
    # linear-attention layers (AttentionMetadata.state_query_start_loc).
    state_query_start_loc: np.ndarray | None = None  # int32 [B + 1]
    # Chunks of prompts with images that reach into the prompt: their rows
    # need multimodal RoPE's three positions and, at image tokens, the vision
    # tower's embeddings (ModelRunner builds them; such a step runs eagerly).
    media_chunks: list[MediaChunk] = field(default_factory=list)
    # Where the step is laid out as decode rows (a verify step, or any step in
    # batch-invariant mode), query_start_loc bounds single tokens; this keeps
    # each scheduled chunk's flat rows (int32 [chunks + 1]). None: the same.
    chunk_start_loc: np.ndarray | None = None

    @property
    def chunk_starts(self) -> np.ndarray:
        """int32 [chunks + 1]: the flat rows of each scheduled chunk."""
        return self.query_start_loc if self.chunk_start_loc is None else self.chunk_start_loc

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def max_query_len(self) -> int:
        return int(np.diff(self.query_start_loc).max())

    @property
    def is_decode(self) -> bool:
        """Every sequence adds exactly one token: a decode step (CUDA graphs)."""
        return self.num_tokens == self.num_seqs


@dataclass(frozen=True)
class MediaChunk:
    first_row: int  # its first row in the step's flat batch
    start: int  # its first token's index in the sequence
    num_tokens: int
    seq: Sequence


def block_tables_of(seqs: list[Sequence]) -> np.ndarray:
    """int32 [B, longest table] of the sequences' page ids; the tail is 0."""
    tables = np.zeros((len(seqs), max(len(seq.block_table) for seq in seqs)), dtype=np.int32)
    for row, seq in enumerate(seqs):
        tables[row, : len(seq.block_table)] = seq.block_table
    return tables


def slots_of(block_tables: np.ndarray, rows: np.ndarray, positions: np.ndarray,
             page_size: int) -> np.ndarray:
    """int64 cache slots of tokens at positions of the given block-table rows:
    the page's id times the page size plus the offset in the page."""
    pages = block_tables[rows, positions // page_size].astype(np.int64)
    return pages * page_size + positions % page_size


def build_step_inputs(out: SchedulerOutput, page_size: int, decode_rows: int = 0,
                      every_token_a_row: bool = False) -> StepInputs:
    """The step's flat batch. A verify step (drafts, and otherwise decode
    rows only) of at most decode_rows tokens is laid out as decode rows:
    each token its own attention row over its sequence's pages, with the
    context up to itself (see _as_decode_rows); with every_token_a_row
    (batch-invariant mode) every step is, prompt chunks included, so a
    prompt token is computed exactly as a decode step computes it."""
    chunks = out.chunks
    num_seqs = len(chunks)
    counts = np.fromiter((c.num_tokens for c in chunks), dtype=np.int64, count=num_seqs)
    starts = np.fromiter((c.start for c in chunks), dtype=np.int64, count=num_seqs)
    query_start = np.zeros(num_seqs + 1, dtype=np.int32)
    np.cumsum(counts, out=query_start[1:])
    seq_lens = (starts + counts).astype(np.int32)
    block_tables = block_tables_of([chunk.seq for chunk in chunks])
    input_ids: list[int] = []
    sample_rows: list[int] = []
    sample_seqs: list[Sequence] = []
    draft_rows: list[int] = []
    draft_seqs: list[Sequence] = []
    draft_positions: list[int] = []
    for row, chunk in enumerate(chunks):
        seq = chunk.seq
        end = chunk.start + chunk.num_tokens
        if chunk.draft:
            first = int(query_start[row])
            input_ids.append(seq.token_ids[chunk.start])
            input_ids.extend(chunk.draft)
            sample_rows.append(first)
            sample_seqs.append(seq)
            draft_rows.extend(range(first + 1, first + 1 + len(chunk.draft)))
            draft_seqs.extend([seq] * len(chunk.draft))
            # The first row draws output token num_output_tokens; draft row i the i+1th after it.
            after = seq.num_output_tokens + 1
            draft_positions.extend(range(after, after + len(chunk.draft)))
            continue
        if chunk.num_tokens == 1:
            input_ids.append(seq.token_ids[chunk.start])
        else:
            input_ids.extend(seq.token_ids[chunk.start:end])
        if chunk.samples:
            sample_rows.append(int(query_start[row + 1]) - 1)
            sample_seqs.append(seq)
    # Positions run from each chunk's start.
    row_of_token = np.repeat(np.arange(num_seqs), counts)
    positions = np.arange(len(row_of_token), dtype=np.int64) - query_start[row_of_token] + \
        starts[row_of_token]
    slots = slots_of(block_tables, row_of_token, positions, page_size)
    state_slots = state_fresh = state_query_start = None
    if num_seqs and chunks[0].state_slot >= 0:
        state_slots = np.fromiter((c.state_slot for c in chunks), dtype=np.int64, count=num_seqs)
        state_fresh = starts == 0
    # A hybrid model computes again the tokens a rejected draft's step kept
    # (the recurrent state cannot be cut back: engine/scheduling/scheduler.py);
    # as decode rows too, they come out as plain decoding computed them.
    recomputed = [state_slots is not None and chunk.num_tokens > 1 and not chunk.draft
                  and chunk.scored is None and chunk.seq.num_output_tokens > 0
                  for chunk in chunks]
    chunk_start = None
    if (draft_rows or any(recomputed)) and len(input_ids) <= decode_rows and all(
            chunk.num_tokens == 1 or chunk.draft or again
            for chunk, again in zip(chunks, recomputed, strict=True)):
        state_query_start = query_start if state_slots is not None else None
        chunk_start = query_start
        query_start, seq_lens, block_tables = _as_decode_rows(positions, block_tables,
                                                              row_of_token)
    elif every_token_a_row and len(input_ids) > num_seqs:
        chunk_start = query_start
        query_start, seq_lens, block_tables = _as_decode_rows(positions, block_tables,
                                                              row_of_token)
    media_chunks: list[MediaChunk] = []
    if any(chunk.seq.media is not None for chunk in chunks):
        positions, media_chunks = _multimodal_positions(chunks, positions, counts)
    return StepInputs(
        input_ids=np.asarray(input_ids, dtype=np.int64),
        positions=positions,
        slot_mapping=slots,
        query_start_loc=query_start,
        seq_lens=seq_lens,
        block_tables=block_tables,
        sample_rows=sample_rows,
        sample_seqs=sample_seqs,
        draft_rows=draft_rows,
        draft_seqs=draft_seqs,
        draft_positions=draft_positions,
        state_slots=state_slots,
        state_fresh=state_fresh,
        state_query_start_loc=state_query_start,
        media_chunks=media_chunks,
        chunk_start_loc=chunk_start,
    )


def as_decode_rows(inputs: StepInputs) -> StepInputs:
    """inputs with every token its own attention row (batch-invariant mode;
    a step built without build_step_inputs, such as the memory profile's)."""
    if inputs.is_decode:
        return inputs
    counts = np.diff(inputs.query_start_loc)
    row_of_token = np.repeat(np.arange(len(counts)), counts)
    query_start, seq_lens, block_tables = _as_decode_rows(inputs.positions, inputs.block_tables,
                                                          row_of_token)
    return dataclasses.replace(inputs, query_start_loc=query_start, seq_lens=seq_lens,
                               block_tables=block_tables, chunk_start_loc=inputs.query_start_loc)


def _multimodal_positions(chunks: list[ScheduledChunk], positions: np.ndarray,
                          counts: np.ndarray) -> tuple[np.ndarray, list[MediaChunk]]:
    """The positions the model's RoPE takes (the KV slots and lengths are
    computed already): a token after a prompt with images sits at its index
    plus the prompt's delta (engine/models/mrope.py); the chunks that reach
    into such a prompt get their three positions from the model runner."""
    positions = positions.copy()
    media_chunks: list[MediaChunk] = []
    first = 0
    for chunk, count in zip(chunks, counts.tolist(), strict=True):
        seq = chunk.seq
        if seq.media is not None:
            rows = positions[first:first + count]
            rows[rows >= seq.num_prompt_tokens] += seq.media.delta
            if chunk.start < seq.num_prompt_tokens:
                media_chunks.append(MediaChunk(first, chunk.start, count, seq))
        first += count
    return positions, media_chunks


def _as_decode_rows(positions: np.ndarray, block_tables: np.ndarray, row_of_token: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(query_start_loc, seq_lens, block_tables) with every token a decode
    row of its own: its context ends at itself, its page table is its
    sequence's. A layer writes every row's K and V before it attends, so a
    draft row sees the drafts before it. This runs the decode kernel and the
    decode CUDA graphs (engine/execution/cuda_graphs.py), which compute each
    position as plain decoding computes it, rather than the prefill kernel."""
    num_rows = len(positions)
    query_start = np.arange(num_rows + 1, dtype=np.int32)
    seq_lens = (positions + 1).astype(np.int32)
    return query_start, seq_lens, block_tables[row_of_token]


class DeviceInputs:
    """Moves StepInputs to the device: host arrays go through page-locked
    staging buffers on CUDA (grown as needed), straight to tensors on the CPU.

    The staging buffers are reused every step. A step that samples nothing
    (prompt chunks only) returns without waiting for the GPU, so before a
    buffer is written again, begin() waits for the copies that read it last."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pinned = device.type == "cuda"
        self._staging: dict[str, torch.Tensor] = {}
        self._copies_done: torch.cuda.Event | None = None

    def begin(self) -> None:
        """Call before a step's first tensor(): the staging buffers are free again."""
        if self._copies_done is not None:
            self._copies_done.synchronize()
            self._copies_done = None

    def end(self) -> None:
        """Call after a step's last tensor(): marks when its copies are done."""
        if self._pinned:
            self._copies_done = torch.cuda.Event()
            self._copies_done.record()

    def tensor(self, name: str, array: np.ndarray) -> torch.Tensor:
        host = torch.from_numpy(np.ascontiguousarray(array))
        if not self._pinned:
            return host
        staging = self._staging.get(name)
        if staging is None or staging.numel() < host.numel() or staging.dtype != host.dtype:
            staging = torch.empty(max(host.numel(), 1024), dtype=host.dtype, pin_memory=True)
            self._staging[name] = staging
        view = staging[: host.numel()].view(host.shape)
        view.copy_(host)
        return view.to(self.device, non_blocking=True)

    def metadata(self, inputs: StepInputs, max_seq_len: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input_ids, positions, metadata) on the device for an eager forward.
        max_seq_len: a bound for the attention kernels to use instead of the
        longest sequence (a decode step's context bucket, as its graph has)."""
        self.begin()
        meta = AttentionMetadata(
            query_start_loc=self.tensor("query_start_loc", inputs.query_start_loc),
            seq_lens=self.tensor("seq_lens", inputs.seq_lens),
            block_tables=self.tensor("block_tables", inputs.block_tables),
            slot_mapping=self.tensor("slot_mapping", inputs.slot_mapping),
            max_query_len=inputs.max_query_len,
            max_seq_len=max_seq_len or int(inputs.seq_lens.max()),
            query_start_loc_host=tuple(inputs.query_start_loc.tolist()),
            seq_lens_host=tuple(inputs.seq_lens.tolist()),
            state_slots=(None if inputs.state_slots is None
                         else self.tensor("state_slots", inputs.state_slots)),
            state_fresh=(None if inputs.state_fresh is None
                         else self.tensor("state_fresh", inputs.state_fresh)),
            state_query_start_loc=(None if inputs.state_query_start_loc is None else
                                   self.tensor("state_query_start_loc",
                                               inputs.state_query_start_loc)),
            state_query_start_loc_host=(None if inputs.state_query_start_loc is None
                                        else tuple(inputs.state_query_start_loc.tolist())),
        )
        input_ids = self.tensor("input_ids", inputs.input_ids)
        positions = self.tensor("positions", inputs.positions)
        self.end()
        return input_ids, positions, meta
