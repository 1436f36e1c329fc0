"""Embedding requests' prompts pooled into one vector each, on the device.

An embedding request (SamplingParams.pooling) is prefilled in chunks like any
prompt, in eager steps: pooling reads the final-normed hidden states, which
no CUDA graph keeps. Each such step hands the pooler its hidden states
[T, H]; between chunks it keeps per request only what its pooling needs:
nothing for last (only the last chunk's last row counts), the first row for
cls, a running float32 sum for mean, so a long prompt never has its whole
[n, H] matrix held. A request's last chunk finishes its vector (mean:
divided by the prompt length), normalises it (embd_normalize), and the
step's finished vectors go to the host in one copy, read when the core
completes the step. Rows of many short prompts are pooled together: one
gather or one segment sum per pooling kind, not one per request.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.execution.step_inputs import StepInputs
from engine.scheduling.scheduler import ScheduledChunk
from protocol import SamplingParams

# embd_normalize 0: llama.cpp scales the largest magnitude to this (int16 range).
INT16_SCALE = 32760.0


def embedding_error(params: SamplingParams) -> str | None:
    """What is wrong with an embedding request's settings, if anything."""
    if params.max_tokens != 0:
        return "an embedding request generates nothing: max_tokens must be 0"
    if params.prompt_logprobs >= 0 or params.logprobs >= 0:
        return "an embedding request has no log probabilities to return"
    if params.embd_normalize < -1:
        return f"embd_normalize must be -1 or more, got {params.embd_normalize}"
    return None


def normalize(vectors: torch.Tensor, mode: int) -> torch.Tensor:
    """Rows of float32 vectors normalised as llama.cpp's embd_normalize says:
    -1 as they are, 0 largest magnitude 32760, 1 taxicab, 2 Euclidean, p > 2
    the p-norm. A zero vector stays zero."""
    if mode < 0:
        return vectors
    if mode == 0:
        scale = vectors.abs().amax(dim=-1, keepdim=True) / INT16_SCALE
    elif mode <= 2:
        scale = torch.linalg.vector_norm(vectors, ord=mode, dim=-1, keepdim=True)
    else:
        # |x|^p overflows float32 soon; the norm itself is small again.
        scale = torch.linalg.vector_norm(vectors.double(), ord=mode, dim=-1,
                                         keepdim=True).float()
    inverse = torch.where(scale > 0, scale.reciprocal(), torch.zeros_like(scale))
    return vectors * inverse


@dataclass
class PooledVectors:
    """A step's finished embeddings on their way to the host."""

    chunks: list[int]  # the step's chunk index of each row
    host: torch.Tensor  # float32 [n, H]
    done: torch.cuda.Event | None

    def by_chunk(self) -> dict[int, bytes]:
        """Each finished chunk's vector as little-endian float32 bytes (waits
        for the copy)."""
        if self.done is not None:
            self.done.synchronize()
        rows = self.host.numpy().astype("<f4", copy=False)
        return {chunk: rows[row].tobytes() for row, chunk in enumerate(self.chunks)}


class Pooler:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        # Request id -> what its earlier chunks left: mean's running sum, cls's
        # first row (float32 [H]).
        self._partial: dict[str, torch.Tensor] = {}

    def forget(self, request_id: str) -> None:
        """The request ended (aborted) before its last chunk."""
        self._partial.pop(request_id, None)

    def pool(self, hidden: torch.Tensor, inputs: StepInputs,
             chunks: list[tuple[int, ScheduledChunk]]) -> PooledVectors | None:
        """Pool the embedding chunks (index in the step, chunk) of a step
        whose final-normed hidden states are hidden [T, H]; returns the
        vectors of the requests this step finishes, their copy to the host
        begun (None when it finishes none)."""
        starts = inputs.chunk_starts
        # Rows taken straight from this step (last; cls of a one-chunk prompt),
        # and cls rows kept from an earlier chunk: (chunk index, mode) of each.
        rows: list[int] = []
        taken: list[tuple[int, int]] = []
        kept: list[torch.Tensor] = []
        kept_of: list[tuple[int, int]] = []
        means: list[tuple[int, ScheduledChunk]] = []
        for index, chunk in chunks:
            seq = chunk.seq
            kind, mode = seq.params.pooling, seq.params.embd_normalize
            ends = chunk.start + chunk.num_tokens == seq.num_prompt_tokens
            if kind == "mean":
                means.append((index, chunk))
            elif kind == "last":
                if ends:
                    rows.append(int(starts[index + 1]) - 1)
                    taken.append((index, mode))
            elif chunk.start == 0 and ends:  # cls, the whole prompt in this chunk
                rows.append(int(starts[index]))
                taken.append((index, mode))
            elif chunk.start == 0:  # cls: its first token is in this chunk
                # A copy: a view would keep the step's whole hidden states alive.
                self._partial[seq.request_id] = hidden[int(starts[index])].to(
                    torch.float32, copy=True)
            elif ends:
                kept.append(self._partial.pop(seq.request_id))
                kept_of.append((index, mode))
        parts: list[torch.Tensor] = []
        if rows:
            picked = torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True)
            parts.append(hidden.index_select(0, picked).float())
        if kept:
            parts.append(torch.stack(kept))
        finished = taken + kept_of
        if means:
            mean_vectors, mean_of = self._pool_means(hidden, inputs, means)
            if mean_of:
                parts.append(mean_vectors)
                finished += mean_of
        if not finished:
            return None
        vectors = parts[0] if len(parts) == 1 else torch.cat(parts)
        return self._to_host([index for index, _ in finished], vectors,
                             [mode for _, mode in finished])

    def _pool_means(self, hidden: torch.Tensor, inputs: StepInputs,
                    means: list[tuple[int, ScheduledChunk]]
                    ) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """One segment sum over the mean chunks' rows; chunks of a longer
        prompt add to or leave a running sum. Returns the finished means
        [m, H] and (chunk index, mode) of each."""
        starts = inputs.chunk_starts
        lengths = np.array([chunk.num_tokens for _, chunk in means], dtype=np.int64)
        firsts = np.array([int(starts[index]) for index, _ in means], dtype=np.int64)
        # Each chunk's rows of the step, one after another.
        offsets = np.cumsum(lengths) - lengths
        rows = np.repeat(firsts - offsets, lengths) + np.arange(int(lengths.sum()))
        segments = np.repeat(np.arange(len(means)), lengths)
        # The chunks are in step order and disjoint: as many rows as the step
        # has means all of them, in order.
        source = hidden if len(rows) == hidden.shape[0] else hidden.index_select(
            0, torch.from_numpy(rows).to(self.device, non_blocking=True))
        sums = torch.zeros((len(means), hidden.shape[1]), dtype=torch.float32, device=self.device)
        sums.index_add_(0, torch.from_numpy(segments).to(self.device, non_blocking=True),
                        source.float())
        done: list[int] = []
        divisors: list[float] = []
        finished: list[tuple[int, int]] = []
        for position, (index, chunk) in enumerate(means):
            seq = chunk.seq
            if chunk.start > 0:
                sums[position] += self._partial.pop(seq.request_id)
            if chunk.start + chunk.num_tokens < seq.num_prompt_tokens:
                self._partial[seq.request_id] = sums[position].clone()
                continue
            done.append(position)
            divisors.append(float(seq.num_prompt_tokens))
            finished.append((index, seq.params.embd_normalize))
        if not done:
            return sums[:0], []
        if len(done) < len(means):
            sums = sums.index_select(0, torch.tensor(done, dtype=torch.int64).to(self.device))
        divisor = torch.tensor(divisors, dtype=torch.float32).to(self.device, non_blocking=True)
        return sums / divisor.unsqueeze(1), finished

    def _to_host(self, chunks: list[int], vectors: torch.Tensor, modes: list[int]
                 ) -> PooledVectors:
        """Normalise each row as its request asks and start the copy to the host."""
        if len(set(modes)) == 1:
            vectors = normalize(vectors, modes[0])
        else:
            for mode in set(modes):
                picked = torch.tensor([row for row, m in enumerate(modes) if m == mode],
                                      dtype=torch.int64).to(self.device)
                vectors.index_copy_(0, picked, normalize(vectors.index_select(0, picked), mode))
        if self.device.type != "cuda":
            return PooledVectors(chunks, vectors, None)
        host = torch.empty(vectors.shape, dtype=torch.float32, pin_memory=True)
        host.copy_(vectors, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return PooledVectors(chunks, host, done)
