"""A draft model: a smaller model of the target's vocabulary guesses each
row's next tokens greedily, in the engine's own process and on its device.

Greedy drafts are one-hot proposals, so engine/sampling/verify.py's exact
rule applies unchanged, to greedy and sampled rows alike.

The draft model keeps its own paged KV pool, a page list per request, and the
tokens whose K/V it holds. Each call catches every row up on the tokens it
has not seen (after the longest prefix it shares with what it saw last: the
target's rejections rewind a sequence), then decodes the rows' drafts one
position at a time, all rows in one forward pass per position. A request's
pages are freed when it ends (forget); when the pool runs short, the least
recently drafted requests outside the call give theirs up, and a row that
still does not fit gets no draft this step.

On a GPU with graphs (enable_graphs), a round whose catch-up is a few
tokens per row (the usual case: what the target accepted last step) replays
CUDA graphs end to end and reads the draft back once
(engine/execution/draft_graphs.py); a round with a long catch-up (a new
request's prompt) runs eagerly, our kernels on CUDA or the torch reference on
the CPU, one forward pass per position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.execution.device_state import WeightStash
from engine.execution.draft_graphs import DraftGraphs
from engine.execution.model_ops import CudaOps
from engine.execution.step_inputs import DeviceInputs, StepInputs, slots_of
from engine.models import CausalLM
from engine.sampling.drafter import DraftRow


@dataclass
class _DraftCache:
    """One request's state in the draft model."""

    tokens: list[int] = field(default_factory=list)  # K/V held for positions 0..len-1
    pages: list[int] = field(default_factory=list)
    last_used: int = 0
    # The sequence's length at the last call: those tokens were all known, so
    # they never change (only the guesses after them may be rejected).
    known: int = 0


@dataclass
class _Segment:
    """Tokens of one row fed to one forward pass, from position start."""

    cache: _DraftCache
    token_ids: list[int]
    start: int


class DraftModelDrafter:
    def __init__(self, model: CausalLM, *, num_pages: int, page_size: int,
                 max_step_tokens: int, vocab_limit: int, device: torch.device) -> None:
        """model: the draft, loaded on device with its ops set; num_pages of
        page_size tokens for its KV; a forward pass feeds at most
        max_step_tokens tokens; drafts are ids below vocab_limit (the
        smaller of the two embedding sizes, which may differ by padding)."""
        self.model = model
        self.page_size = page_size
        self.num_pages = num_pages
        self.max_step_tokens = max_step_tokens
        self.vocab_limit = vocab_limit
        self.device = device
        self.kv_caches = self._allocate_kv()
        self._free_pages = list(range(num_pages - 1, -1, -1))
        self._caches: dict[str, _DraftCache] = {}
        self._inputs = DeviceInputs(device)
        self._calls = 0
        self._stash: WeightStash | None = None  # the weights while asleep on a GPU
        self._graph_shape: dict[str, int] | None = None  # enable_graphs' arguments
        self.graphs: DraftGraphs | None = None
        self.graph_rounds = 0  # rounds drafted through the graphs (the rest ran eagerly)

    def enable_graphs(self, *, catch_up_rows: int, max_rows: int, max_tokens: int,
                      max_context: int) -> None:
        """Capture CUDA graphs for drafting rounds of up to max_rows rows of
        up to max_tokens guesses, whose catch-up feeds at most catch_up_rows
        tokens (the model's ops must be our kernels, workspace sized for
        that many rows); captured again after every wake."""
        self._graph_shape = {"catch_up_rows": catch_up_rows, "max_rows": max_rows,
                             "max_tokens": max_tokens, "max_context": max_context}
        self._capture()

    def _capture(self) -> None:
        assert self._graph_shape is not None
        self.graphs = DraftGraphs(self.model, self.kv_caches, page_size=self.page_size,
                                  vocab_limit=self.vocab_limit, device=self.device,
                                  **self._graph_shape)
        self.graphs.capture()

    def _allocate_kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = self.model.config.kv_cache_shape(self.num_pages, self.page_size)
        dtype = self.model.embed_tokens.dtype
        return [(torch.zeros(shape, dtype=dtype, device=self.device),
                 torch.zeros(shape, dtype=dtype, device=self.device))
                for _ in range(self.model.config.num_layers)]

    def sleep(self) -> None:
        """Give the device memory up with the engine's (nothing is running):
        every request's draft KV is dropped, the weights wait in pinned host
        memory (the draft is small; a wake copies them back)."""
        for key in list(self._caches):
            self.forget(key)
        if self.device.type != "cuda" or self._stash is not None:
            return  # on the CPU the weights and the pool are host memory already
        self.graphs = None  # they point at the pool and the weights' addresses
        self.kv_caches = []
        self._stash = WeightStash(self.model, pin=True)

    def wake(self) -> None:
        if self._stash is None:
            return
        self._stash.put_back(self.model, self.device)
        self._stash = None
        self.kv_caches = self._allocate_kv()
        if self._graph_shape is not None:
            self._capture()

    @property
    def kv_bytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size()
                   for k, v in self.kv_caches)

    def workspace_bytes(self) -> int:
        ops = self.model.ops
        return ops.workspace_bytes() if isinstance(ops, CudaOps) else 0

    def propose(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """A draft for an anonymous sequence (the Drafter protocol); its K/V is
        freed at once. The engine calls propose_batch."""
        key = f"\0anonymous-{self._calls}"
        try:
            return self.propose_batch([DraftRow(key, token_ids, max_tokens)])[0]
        finally:
            self.forget(key)

    def forget(self, key: str) -> None:
        cache = self._caches.pop(key, None)
        if cache is not None:
            self._free_pages.extend(cache.pages)

    @property
    def num_free_pages(self) -> int:
        return len(self._free_pages)

    @torch.inference_mode()
    def propose_batch(self, rows: list[DraftRow]) -> list[list[int]]:
        """Up to row.max_tokens greedy guesses after each row's tokens."""
        self._calls += 1
        drafts: list[list[int]] = [[] for _ in rows]
        keys = {row.key for row in rows}
        active: list[tuple[int, _DraftCache, DraftRow]] = []
        segments: list[_Segment] = []
        for index, row in enumerate(rows):
            if row.max_tokens < 1 or not row.token_ids:
                continue
            cache = self._caches.setdefault(row.key, _DraftCache())
            cache.last_used = self._calls
            tokens = list(row.token_ids)
            settled = min(cache.known, len(cache.tokens), len(tokens))
            shared = settled + _common_prefix(cache.tokens[settled:], tokens[settled:])
            # The newest token is always fed: its logits give the first guess.
            keep = min(shared, len(tokens) - 1)
            del cache.tokens[keep:]
            # K/V is written for every position but the last guess's.
            if not self._fit(cache, len(tokens) + row.max_tokens - 1, keys):
                continue
            if max(tokens[keep:]) >= self.vocab_limit:
                continue  # a padding id the draft's embedding lacks
            active.append((index, cache, row))
            segments.append(_Segment(cache, tokens[keep:], keep))
        if not active:
            return drafts
        catch_up = sum(len(segment.token_ids) for segment in segments)
        pages = max(len(cache.pages) for _, cache, _ in active)
        span = max(len(row.token_ids) + row.max_tokens for _, _, row in active)
        if (self.graphs is not None and self.graphs.handles(catch_up, len(active), pages, span)
                and all(row.max_tokens <= self.graphs.max_tokens for _, _, row in active)):
            return self._draft_from_graphs(drafts, active, segments)
        guesses = self._catch_up(segments)
        for (index, cache, row), guess in zip(active, guesses, strict=True):
            cache.tokens = list(row.token_ids)
            cache.known = len(cache.tokens)
            drafts[index].append(guess)
        for position in range(1, max(row.max_tokens for _, _, row in active)):
            going = [(index, cache) for index, cache, row in active if row.max_tokens > position]
            feed = [_Segment(cache, [drafts[index][-1]], len(cache.tokens))
                    for index, cache in going]
            for (index, cache), guess in zip(going, self._forward(feed), strict=True):
                cache.tokens.append(drafts[index][-1])
                drafts[index].append(guess)
        return drafts

    def _draft_from_graphs(self, drafts: list[list[int]],
                           active: list[tuple[int, _DraftCache, DraftRow]],
                           segments: list[_Segment]) -> list[list[int]]:
        """The round through DraftGraphs: the catch-up tokens as decode rows,
        then the chain of guesses, read back once."""
        assert self.graphs is not None
        self.graph_rounds += 1
        counts = np.array([len(segment.token_ids) for segment in segments], dtype=np.int64)
        starts = np.array([segment.start for segment in segments], dtype=np.int64)
        tables = np.zeros((len(segments), max(len(s.cache.pages) for s in segments)),
                          dtype=np.int32)
        for row, segment in enumerate(segments):
            tables[row, : len(segment.cache.pages)] = segment.cache.pages
        row_of_token = np.repeat(np.arange(len(segments)), counts)
        first_token = np.concatenate([[0], np.cumsum(counts)[:-1]])
        positions = np.arange(len(row_of_token), dtype=np.int64) - first_token[row_of_token] \
            + starts[row_of_token]
        catch_up = StepInputs(
            input_ids=np.fromiter((t for s in segments for t in s.token_ids), dtype=np.int64,
                                  count=int(counts.sum())),
            positions=positions,
            slot_mapping=slots_of(tables, row_of_token, positions, self.page_size),
            query_start_loc=np.arange(len(row_of_token) + 1, dtype=np.int32),
            seq_lens=(positions + 1).astype(np.int32),
            block_tables=tables[row_of_token],
            sample_rows=[],
            sample_seqs=[],
        )
        lengths = [row.max_tokens for _, _, row in active]
        guesses = self.graphs.draft(
            catch_up, last_rows=(first_token + counts - 1).tolist(),
            starts=[len(row.token_ids) for _, _, row in active], lengths=lengths,
            tables=torch.from_numpy(tables))
        for (index, cache, row), guess in zip(active, guesses, strict=True):
            # K/V is now held for the row's tokens and every guess but the last.
            cache.tokens = list(row.token_ids) + guess[:-1]
            cache.known = len(row.token_ids)
            drafts[index] = guess
        return drafts

    def _fit(self, cache: _DraftCache, positions: int, keep: set[str]) -> bool:
        """Give cache pages for positions tokens (releasing any beyond),
        taking them from the least recently used requests not in keep when
        the pool is short. False (cache unchanged past its tokens) if they do
        not fit."""
        need = -(-positions // self.page_size)
        if need > self.num_pages:
            return False
        while len(cache.pages) > need:
            self._free_pages.append(cache.pages.pop())
        missing = need - len(cache.pages)
        while len(self._free_pages) < missing:
            victims = [key for key in self._caches if key not in keep and self._caches[key].pages]
            if not victims:
                return False
            self.forget(min(victims, key=lambda key: self._caches[key].last_used))
        cache.pages.extend(self._free_pages.pop() for _ in range(missing))
        return True

    def _catch_up(self, segments: list[_Segment]) -> list[int]:
        """Feed every segment, at most max_step_tokens tokens per forward pass
        (a long prompt over several), and return each one's guess after its
        last token."""
        guesses: dict[int, int] = {}
        pending = list(enumerate(segments))
        while pending:
            batch: list[tuple[int, _Segment, bool]] = []  # (index, part, ends here)
            rest: list[tuple[int, _Segment]] = []
            budget = self.max_step_tokens
            for index, segment in pending:
                count = min(len(segment.token_ids), budget)
                if count < 1:
                    rest.append((index, segment))
                    continue
                budget -= count
                ends = count == len(segment.token_ids)
                batch.append((index, _Segment(segment.cache, segment.token_ids[:count],
                                              segment.start), ends))
                if not ends:
                    rest.append((index, _Segment(segment.cache, segment.token_ids[count:],
                                                 segment.start + count)))
            result = self._forward([part for _, part, _ in batch])
            for (index, _, ends), guess in zip(batch, result, strict=True):
                if ends:
                    guesses[index] = guess
            pending = rest
        return [guesses[index] for index in range(len(segments))]

    def _forward(self, segments: list[_Segment]) -> list[int]:
        """One forward pass of the draft over the segments (each row's K/V
        before its start already cached); the greedy token after each
        segment's last one."""
        counts = np.array([len(segment.token_ids) for segment in segments], dtype=np.int64)
        starts = np.array([segment.start for segment in segments], dtype=np.int64)
        query_start = np.zeros(len(segments) + 1, dtype=np.int32)
        np.cumsum(counts, out=query_start[1:])
        tables = np.zeros((len(segments), max(len(s.cache.pages) for s in segments)),
                          dtype=np.int32)
        for row, segment in enumerate(segments):
            tables[row, : len(segment.cache.pages)] = segment.cache.pages
        row_of_token = np.repeat(np.arange(len(segments)), counts)
        positions = (np.arange(len(row_of_token), dtype=np.int64)
                     - query_start[row_of_token] + starts[row_of_token])
        inputs = StepInputs(
            input_ids=np.fromiter((t for s in segments for t in s.token_ids), dtype=np.int64,
                                  count=int(counts.sum())),
            positions=positions,
            slot_mapping=slots_of(tables, row_of_token, positions, self.page_size),
            query_start_loc=query_start,
            seq_lens=(starts + counts).astype(np.int32),
            block_tables=tables,
            sample_rows=[],
            sample_seqs=[],
        )
        input_ids, positions_t, meta = self._inputs.metadata(inputs)
        hidden = self.model.forward(input_ids, positions_t, meta, self.kv_caches)
        last = torch.from_numpy(query_start[1:].astype(np.int64) - 1).to(self.device)
        logits = self.model.compute_logits(hidden.index_select(0, last))
        return logits[:, : self.vocab_limit].argmax(dim=-1).tolist()


def _common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share."""
    length = min(len(a), len(b))
    if length == 0:
        return 0
    differ = np.flatnonzero(np.asarray(a[:length]) != np.asarray(b[:length]))
    return int(differ[0]) if differ.size else length
