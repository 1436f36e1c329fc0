"""Hybrid models (Qwen3-Next, Qwen3.5) through the GPU path (bf16, CudaOps).

Tiny random checkpoints with head size 128 so our kernels run: the
linear-attention layers run kernels/gated_delta.py, the gated attention our
paged attention, inside the CUDA graphs. Checks: the first tokens of a batch
are among transformers' best (float32 on the same GPU); graphs on give the
tokens of graphs off; a repeated prompt resumed from its
recurrent-state checkpoint gives bit for bit the tokens of its first run
(the same steps after the same state: the checkpoint copy is exact); the
next turn of a conversation resumes and stays among transformers' best.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import protocol as p
from engine.scheduling.core import EngineCore
from tests.engine import in_process
from tests.engine.in_process import run_to_completion, step_outputs
from tests.support import fixtures

pytestmark = pytest.mark.gpu

_COMMON = dict(
    vocab_size=151936, hidden_size=256, intermediate_size=512, num_attention_heads=4,
    num_key_value_heads=2, head_dim=128, max_position_embeddings=4096, rms_norm_eps=1e-6,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, initializer_range=0.05,
    tie_word_embeddings=False,
)


def _build(family: str, target: Path) -> Path:
    torch.manual_seed(0)
    if family == "qwen3_next":
        from transformers import Qwen3NextConfig
        from transformers import Qwen3NextForCausalLM as HFModel

        config = Qwen3NextConfig(**_COMMON, num_hidden_layers=4, num_experts=8,
                                 num_experts_per_tok=2, moe_intermediate_size=128,
                                 shared_expert_intermediate_size=256)
    else:
        from transformers.models.qwen3_5 import Qwen3_5TextConfig
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM as HFModel

        config = Qwen3_5TextConfig(**_COMMON, num_hidden_layers=4)
    model = HFModel(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn(param.shape) * 0.2)
    model.save_pretrained(target, safe_serialization=True)
    source = fixtures.qwen3_tokenizer()
    for name in fixtures.QWEN3_TOKENIZER_FILES:
        (target / name).write_bytes((source / name).read_bytes())
    return target


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5"])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> tuple[Path, torch.nn.Module]:
    import transformers

    directory = _build(request.param, tmp_path_factory.mktemp(request.param))
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    return directory, hf.to("cuda").eval()


def _engine(directory: Path, cuda_graph: bool = True) -> tuple[EngineCore, list[p.EngineEvent]]:
    return in_process.make_engine(directory, device="cuda", dtype="bfloat16", page_size=16,
                                  max_concurrency=4, max_batched_tokens=96,
                                  kv_capacity_tokens=8192, cuda_graph=cuda_graph)


def _run(core: EngineCore, events: list[p.EngineEvent],
         prompts: dict[str, list[int]], count: int = 12) -> dict[str, tuple[list[int], int]]:
    params = p.SamplingParams(max_tokens=count, temperature=0.0, ignore_eos=True)
    outputs = step_outputs(run_to_completion(core, events, {rid: (ids, params)
                                                            for rid, ids in prompts.items()}))
    result: dict[str, tuple[list[int], int]] = {}
    for rid in prompts:
        mine = [o for o in outputs if o.request_id == rid]
        result[rid] = ([t for o in mine for t in o.token_ids], mine[-1].num_cached_tokens)
    return result


def _prompt(seed: int, length: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 151000, (length,), generator=generator).tolist()


def _assert_first_tokens_among_best(hf: torch.nn.Module, tokens: list[int],
                                    produced: list[int], count: int = 3) -> None:
    """Each of the first `count` tokens is among transformers' top 5 after
    the tokens before it (bf16 against float32: ties may reorder)."""
    context = list(tokens)
    with torch.inference_mode():
        for token in produced[:count]:
            logits = hf(torch.tensor([context], device="cuda"), use_cache=False).logits[0, -1]
            assert token in logits.topk(5).indices.tolist()
            context.append(token)


def test_batched_first_tokens_are_among_transformers_best(served) -> None:
    directory, hf = served
    core, events = _engine(directory)
    assert core.runner.state_pools is not None
    prompts = {"a": _prompt(1, 150), "b": _prompt(2, 40), "c": _prompt(3, 9)}
    results = _run(core, events, prompts)
    for rid, tokens in prompts.items():
        _assert_first_tokens_among_best(hf, tokens, results[rid][0])


def test_graphs_on_give_the_tokens_of_graphs_off(served) -> None:
    """Decode steps replay graphs and steps with prompt chunks of up to the
    step budget replay chunk graphs, with their state rows staged; off, the
    same padded steps run eagerly."""
    directory, _ = served
    prompts = {"a": _prompt(6, 70), "b": _prompt(7, 33), "c": _prompt(8, 5)}
    with_graphs, events = _engine(directory)
    assert with_graphs.runner.graphs is not None and with_graphs.runner.chunk_graphs is not None
    on = _run(with_graphs, events, prompts, count=20)
    del with_graphs
    without, events = _engine(directory, cuda_graph=False)
    assert without.runner.graphs is None
    assert _run(without, events, prompts, count=20) == on


def test_a_resumed_prompt_gives_its_first_runs_tokens_and_a_next_turn_resumes(served) -> None:
    directory, hf = served
    core, events = _engine(directory)
    first = _prompt(4, 120)
    tokens, cached = _run(core, events, {"first": first})["first"]
    assert cached == 0
    again, cached = _run(core, events, {"again": first})["again"]
    assert cached == len(first) - 1 and again == tokens
    second = first + tokens + _prompt(5, 20)
    turn2, cached = _run(core, events, {"turn2": second})["turn2"]
    assert cached == len(first) + len(tokens) - 1
    _assert_first_tokens_among_best(hf, second, turn2)


def test_speculative_decoding_gives_plain_decodings_tokens_bit_for_bit(served) -> None:
    """Verify steps replay the decode graphs (every token an attention row,
    each sequence's tokens together for the recurrent kernels); drafts cut
    short restore the lane's state and compute the kept tokens again. The
    recurrent kernels do not depend on how tokens are split into steps, so
    the output is plain decoding's exactly."""
    from tests.engine.test_hybrid_serving import OracleDrafter

    directory, _ = served
    prompts = {"a": _prompt(9, 60), "b": _prompt(10, 17)}
    plain, events = _engine(directory)
    want = _run(plain, events, prompts, count=30)
    del plain
    core, events = in_process.make_engine(
        directory, device="cuda", dtype="bfloat16", page_size=16, max_concurrency=4,
        max_batched_tokens=96, kv_capacity_tokens=8192, spec="ngram", draft_tokens=3)
    core.scheduler.drafter = OracleDrafter([prompts[rid] + want[rid][0] for rid in prompts])
    got = _run(core, events, prompts, count=30)
    for rid in prompts:
        mine, plain = got[rid][0], want[rid][0]
        first = next((i for i, (x, y) in enumerate(zip(mine, plain, strict=True)) if x != y), None)
        assert first is None, f"{rid}: differs from token {first} on: {mine[first:]} {plain[first:]}"
    assert core._stats.draft_accepted_tokens_total > 8 and core.scheduler.num_state_rollbacks > 3


def test_a_checkpoint_moved_to_host_memory_resumes_bit_for_bit(served) -> None:
    """One device checkpoint: the rest move to page-locked host rows
    (asynchronous copies on the step's stream) and come back into a lane."""
    directory, _ = served
    core, events = in_process.make_engine(
        directory, device="cuda", dtype="bfloat16", page_size=16, max_concurrency=1,
        max_batched_tokens=96, kv_capacity_tokens=8192, ctx_checkpoints=1, host_kv_mib=256)
    first = _prompt(11, 100)
    tokens, _ = _run(core, events, {"first": first})["first"]
    _run(core, events, {"other": _prompt(12, 70)})
    again, cached = _run(core, events, {"again": first})["again"]
    assert cached == len(first) - 1 and again == tokens
    counters = core.scheduler.kv.checkpoints.counters  # type: ignore[union-attr]
    assert counters.restored_from_host == 1


def test_mtp_drafting_gives_plain_decodings_tokens_and_graphs_draft_as_eager(
        served, tmp_path: Path) -> None:
    """--spec mtp on the GPU: the head runs after every step (its hidden
    states copied out of the decode and chunk graphs), its drafts verified
    in decode-graph replays; the output is plain decoding's bit for bit, and
    the drafts with graphs on are those of graphs off."""
    import shutil

    from tests.engine.test_hybrid_gguf import _write_mtp_head
    from tests.engine.test_mtp_drafting import _recording

    source, _ = served
    directory = tmp_path / "with-head"
    shutil.copytree(source, directory)
    _write_mtp_head(directory)
    prompts = {"a": _prompt(11, 70), "b": _prompt(12, 21)}
    plain, events = _engine(directory)
    want = _run(plain, events, prompts, count=24)
    del plain
    drafts: dict[bool, list[tuple[list[int], list[int]]]] = {}
    for graphs in (True, False):
        core, events = in_process.make_engine(
            directory, device="cuda", dtype="bfloat16", page_size=16, max_concurrency=4,
            max_batched_tokens=96, kv_capacity_tokens=8192, spec="mtp", draft_tokens=3,
            cuda_graph=graphs)
        assert core.runner.hidden_out is not None and core.runner.mtp is not None
        drafts[graphs] = _recording(core.scheduler.drafter)  # type: ignore[arg-type]
        got = _run(core, events, prompts, count=24)
        assert {rid: got[rid][0] for rid in prompts} == {rid: want[rid][0] for rid in prompts}
        del core
    assert sum(1 for _, draft in drafts[True] if draft) >= 4
    assert drafts[True] == drafts[False]
