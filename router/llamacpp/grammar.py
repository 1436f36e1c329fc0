"""/completion's `grammar` (GBNF) and `json_schema`, as the engine's GrammarSpec.

As in llama.cpp, `grammar` wins when both are sent. The engine enforces them
with xgrammar token masks; it needs the tokenizer's vocabulary first, which
the router sends once per engine (EngineClient.send_vocab_once).
"""

from __future__ import annotations

import json

from protocol import GrammarSpec
from router.llamacpp.schemas import CompletionRequest
from router.supervisor import EngineProcess
from router.text.grammar_vocab import grammar_vocab
from router.text.model_text import ModelText


def grammar_spec(req: CompletionRequest) -> GrammarSpec | None:
    if req.grammar:
        # xgrammar reads GBNF, llama.cpp's grammar format, as its EBNF.
        return GrammarSpec("ebnf", req.grammar)
    if req.json_schema is not None:
        return GrammarSpec("json_schema", json.dumps(req.json_schema))
    return None


def prepare_engine(engine: EngineProcess, text: ModelText) -> None:
    """Make sure the engine has the vocabulary grammars are compiled against."""
    engine.client.send_vocab_once(lambda: grammar_vocab(text))
