"""Grammar masks on CUDA: the bitmask travels from page-locked host memory to
the device and xgrammar's CUDA kernel masks bfloat16-model logits there; a
JSON schema holds for greedy and sampled requests sharing a batch with an
unconstrained one, which keeps its solo tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import protocol as p
from router.text.grammar_vocab import grammar_vocab
from router.text.model_text import ModelText
from tests.engine.test_grammar import IM_END, USER, decode, is_user, make_engine, params, run

pytestmark = pytest.mark.gpu


def test_json_schema_on_cuda(tiny_qwen3_dir: Path) -> None:
    text = ModelText.load(tiny_qwen3_dir)
    core, events = make_engine(tiny_qwen3_dir, device="cuda", dtype="bfloat16")
    core.handle(grammar_vocab(text))
    assert core.grammar._host.is_pinned() or core.grammar._host.numel() == 0
    prompt = text.encode_prompt(text.render_chat([{"role": "user", "content": "A user, as JSON."}]))
    spec = p.GrammarSpec("json_schema", json.dumps(USER))
    plain = {"plain": (prompt, params(max_tokens=16, ignore_eos=True))}
    alone = run(core, events, plain)["plain"]
    results = run(core, events, {
        **plain,
        "greedy": (prompt, params(spec)),
        **{f"seed{seed}": (prompt, params(spec, temperature=1.0, seed=seed)) for seed in (1, 2)},
    })
    assert results["plain"].tokens == alone.tokens
    for request_id in ("greedy", "seed1", "seed2"):
        result = results[request_id]
        assert result.finish_reason == "stop" and result.tokens[-1] == IM_END, request_id
        assert is_user(json.loads(decode(text, result))), decode(text, result)
