"""The flat batch a step is built from, the step launched ahead of the host,
and GPU KV sizing: the host-side logic of the GPU path, checked without a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import protocol as p
from engine.execution.decode_lookahead import inputs_key, next_decode_inputs, scheduled_key
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


def test_the_step_after_a_decode_step_moves_every_row_one_token_on() -> None:
    a = sequence("a", 5, 1, [4, 8])  # 6 tokens, the newest at position 5
    b = sequence("b", 3, 0, [6])  # 3 tokens, the newest at position 2
    current = build_step_inputs(decode_step(a, b), PAGE)
    following = next_decode_inputs(current, PAGE, max_context=64)
    assert following is not None
    assert following.positions.tolist() == [6, 3]
    assert following.seq_lens.tolist() == [7, 4]
    assert following.slot_mapping.tolist() == [8 * PAGE + 2, 6 * PAGE + 3]
    assert following.sample_seqs == [a, b]
    # The scheduler's next decode step is exactly that one once both have grown.
    a.token_ids.append(1)
    b.token_ids.append(1)
    assert scheduled_key(decode_step(a, b)) == inputs_key(following)
    assert scheduled_key(decode_step(b, a)) != inputs_key(following)


@pytest.mark.parametrize(
    ("seq", "why"),
    [
        (sequence("page", 3, 0, [6]), "position 4 needs a second page"),
        (sequence("long", 5, 99, [1] * 27), "this step's token is its 100th of 100"),
        (sequence("grammar", 2, 0, [1], grammar=p.GrammarSpec(kind="json_schema", source="{}")),
         "a grammar masks the logits on the host"),
        (sequence("penalty", 2, 0, [1], presence_penalty=0.5), "penalties read the tokens"),
    ],
)
def test_no_step_is_launched_ahead_when_a_row_cannot_simply_go_on(seq: Sequence, why: str) -> None:
    if seq.request_id == "page":
        seq.token_ids.append(1)  # 4 tokens fill page 0; the next needs page 1
    inputs = build_step_inputs(decode_step(seq), PAGE)
    assert next_decode_inputs(inputs, PAGE, max_context=4096) is None, why


def test_no_step_is_launched_ahead_past_the_context_or_after_a_prefill() -> None:
    seq = sequence("a", 6, 1, [1, 2])
    assert next_decode_inputs(build_step_inputs(decode_step(seq), PAGE), PAGE, 8) is None
    prefill = build_step_inputs(SchedulerOutput([ScheduledChunk(seq, 0, 7)]), PAGE)
    assert scheduled_key(SchedulerOutput([ScheduledChunk(seq, 0, 7)])) is None
    assert next_decode_inputs(prefill, PAGE, 4096) is None


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
