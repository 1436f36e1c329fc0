"""The flat batch a step is built from, tokens still on the device, and GPU
KV sizing: the host-side logic of the GPU path, checked without a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import protocol as p
from engine.execution.future_tokens import FutureTokens
from engine.execution.gpu_memory import MemoryLedger
from engine.execution.step_inputs import DeviceInputs, build_step_inputs
from engine.kv.kv_sizing import plan_kv
from engine.scheduling.scheduler import ScheduledChunk, SchedulerOutput
from engine.scheduling.sequence import Sequence

PAGE = 4


def sequence(request_id: str, prompt: int, output: int, pages: list[int],
             **params: object) -> Sequence:
    settings: dict[str, object] = {"max_tokens": 100, "temperature": 0.0}
    settings.update(params)
    seq = Sequence(request_id, list(range(10, 10 + prompt)), p.SamplingParams(**settings))  # type: ignore[arg-type]
    seq.token_ids.extend(range(500, 500 + output))
    seq.block_table.extend(pages)
    return seq


def decode_step(*seqs: Sequence) -> SchedulerOutput:
    return SchedulerOutput([ScheduledChunk(seq, seq.num_tokens - 1, 1) for seq in seqs])


def test_a_mixed_step_lays_out_tokens_positions_and_slots() -> None:
    prefill = sequence("a", 10, 0, [7, 3, 9])
    decode = sequence("b", 5, 2, [2, 5])
    out = SchedulerOutput([ScheduledChunk(prefill, 4, 6), ScheduledChunk(decode, 6, 1)])
    inputs = build_step_inputs(out, PAGE)
    assert inputs.input_ids.tolist() == [*range(14, 20), 501]
    assert inputs.positions.tolist() == [4, 5, 6, 7, 8, 9, 6]
    # Position 4 is page 1 of a (id 3) offset 0; position 6 of b is page 1 (id 5) offset 2.
    assert inputs.slot_mapping.tolist() == [12, 13, 14, 15, 36, 37, 22]
    assert inputs.query_start_loc.tolist() == [0, 6, 7]
    assert inputs.seq_lens.tolist() == [10, 7]
    assert inputs.block_tables.tolist() == [[7, 3, 9], [2, 5, 0]]
    assert inputs.sample_rows == [5, 6]
    assert not inputs.is_decode and inputs.max_query_len == 6


def test_device_inputs_on_the_cpu_are_the_arrays_themselves() -> None:
    seq = sequence("a", 6, 0, [1, 2])
    inputs = build_step_inputs(SchedulerOutput([ScheduledChunk(seq, 0, 6)]), PAGE)
    ids, positions, meta = DeviceInputs(torch.device("cpu")).metadata(inputs, 4096)
    assert ids.tolist() == list(range(10, 16)) and positions.tolist() == list(range(6))
    assert meta.max_seq_len == 4096 and meta.seq_lens_host == (6,)


def test_a_token_still_on_the_device_is_read_from_its_future_slot() -> None:
    future = FutureTokens(rows=4, device=torch.device("cpu"))
    first = future.next_slots()
    future.write(first, torch.tensor([77, 88]))
    seq = sequence("a", 5, 0, [4, 8])
    seq.token_ids.append(-(first + 1 + 1))  # the second token of that launch
    inputs = build_step_inputs(decode_step(seq), PAGE)
    assert inputs.input_ids.tolist() == [-(first + 2)] and seq.has_pending_token
    ids = future.resolve(torch.from_numpy(inputs.input_ids))
    assert ids.tolist() == [88]
    # Known tokens pass through; the next launch writes the other half.
    assert future.resolve(torch.tensor([5, -(first + 1), 0])).tolist() == [5, 77, 0]
    assert future.next_slots() != first and future.next_slots() == first
    with pytest.raises(ValueError, match="sampled 5 tokens"):
        future.write(first, torch.zeros(5, dtype=torch.int64))


def test_gpu_kv_plan_takes_the_budget_or_refuses_what_does_not_fit() -> None:
    common = dict(page_size=16, bytes_per_token=1000, trained_context=40960, requested_context=0,
                  max_concurrency=8)
    auto = plan_kv(**common, requested_capacity=-1, device_budget_bytes=100_000_000)
    assert auto.num_pages == 100_000_000 // 16_000 and auto.max_context == 40960
    small = plan_kv(**common, requested_capacity=0, device_budget_bytes=16_000 * 100)
    assert small.capacity_tokens == 1600 and small.max_context == 1600
    explicit = plan_kv(**common, requested_capacity=50_000, device_budget_bytes=100_000_000)
    assert explicit.num_pages == 3125
    with pytest.raises(ValueError, match=r"--kv-capacity 200000 tokens needs 0\.19 GiB"):
        plan_kv(**common, requested_capacity=200_000, device_budget_bytes=100_000_000)
    with pytest.raises(ValueError, match="no device memory is left for the KV cache"):
        plan_kv(**common, requested_capacity=0, device_budget_bytes=-5)


def test_the_memory_ledger_names_every_share() -> None:
    text = MemoryLedger(total_bytes=140 << 30, weights_bytes=16 << 30, kv_bytes=100 << 30,
                        kv_pages=10, kv_tokens=160, activation_bytes=3 << 29,
                        workspace_bytes=28 << 20, graph_bytes=300 << 20, graph_count=70,
                        headroom_bytes=1 << 30, free_bytes=2 << 30).describe()
    for part in ("weights 16.00 GiB", "KV 100.00 GiB (10 pages, 160 tokens)",
                 "activations 1536 MiB", "decode workspace 28 MiB", "CUDA graphs 300 MiB (70",
                 "headroom 1024 MiB", "2.00 GiB free"):
        assert part in text


def test_positions_are_numpy_int64() -> None:
    inputs = build_step_inputs(decode_step(sequence("a", 3, 0, [0])), PAGE)
    assert inputs.positions.dtype == np.int64 and inputs.slot_mapping.dtype == np.int64


def verify_step() -> SchedulerOutput:
    """b decodes one token; a verifies two drafts after its newest token."""
    drafted = sequence("a", 5, 1, [7, 3])  # 6 tokens: positions 0..5
    decode = sequence("b", 5, 2, [2, 5])
    chunk = ScheduledChunk(drafted, 5, 3)
    chunk.draft = [41, 42]
    return SchedulerOutput([chunk, ScheduledChunk(decode, 6, 1)])


def test_a_verify_step_runs_as_decode_rows_when_they_fit() -> None:
    inputs = build_step_inputs(verify_step(), PAGE, decode_rows=4)
    assert inputs.input_ids.tolist() == [500, 41, 42, 501]
    assert inputs.positions.tolist() == [5, 6, 7, 6]
    # Each token a row of its own, attending up to itself over its sequence's pages.
    assert inputs.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert inputs.seq_lens.tolist() == [6, 7, 8, 7]
    assert inputs.block_tables.tolist() == [[7, 3], [7, 3], [7, 3], [2, 5]]
    assert inputs.slot_mapping.tolist() == [13, 14, 15, 22]
    assert inputs.is_decode
    assert inputs.sample_rows == [0, 3] and inputs.draft_rows == [1, 2]


def test_a_verify_step_too_large_or_with_prompt_chunks_stays_in_chunks() -> None:
    inputs = build_step_inputs(verify_step(), PAGE, decode_rows=3)
    assert inputs.query_start_loc.tolist() == [0, 3, 4] and not inputs.is_decode
    out = verify_step()
    out.chunks.append(ScheduledChunk(sequence("c", 6, 0, [9, 8]), 0, 6))
    inputs = build_step_inputs(out, PAGE, decode_rows=64)
    assert inputs.query_start_loc.tolist() == [0, 3, 4, 10] and not inputs.is_decode
