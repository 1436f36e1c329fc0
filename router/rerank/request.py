"""A rerank request as llama.cpp, Jina and Cohere send it, checked.

    {"model": "judge", "query": "What is panda?", "top_n": 2,
     "documents": ["hi", {"text": "it is a bear"}], "return_documents": true,
     "instruction": "Given a question, retrieve passages that answer it"}

`documents` are strings or, as Cohere and Jina also accept, objects with a
`text`. `instruction` (optional) replaces the judge's default task line, as
hosted Qwen3-Reranker APIs take it. Fields of other servers (Cohere's
`rank_fields`, `max_tokens_per_doc`) are ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from router.errors import invalid
from router.rerank.judge import DEFAULT_INSTRUCTION

# The most documents one request may rank (as hosted rerank APIs bound it):
# each becomes an engine request.
MAX_DOCUMENTS = 1000


class TextDocument(msgspec.Struct):
    text: str


class RerankRequest(msgspec.Struct, kw_only=True):
    query: str
    documents: list[str | TextDocument]
    model: str | None = None
    top_n: int | None = None
    return_documents: bool = False
    instruction: str | None = None


@dataclass(frozen=True)
class RerankJob:
    """What the request asks, checked: the documents' texts, how many results
    to return, and the judge's task line."""

    query: str
    documents: list[str]
    top_n: int
    return_documents: bool
    instruction: str


def checked(req: RerankRequest) -> RerankJob:
    """The job, or a 400 naming the field at fault."""
    if not req.query:
        raise invalid("'query' is empty; send the text the documents are ranked against", "query")
    if not req.documents:
        raise invalid("'documents' is empty; send at least one document", "documents")
    if len(req.documents) > MAX_DOCUMENTS:
        raise invalid(f"'documents' holds {len(req.documents)} documents; at most "
                      f"{MAX_DOCUMENTS} per request", "documents")
    if req.top_n is not None and req.top_n < 1:
        raise invalid(f"'top_n' must be at least 1, got {req.top_n}", "top_n")
    if req.instruction is not None and not req.instruction.strip():
        raise invalid("'instruction' is empty; leave it out for the default", "instruction")
    texts = [document if isinstance(document, str) else document.text
             for document in req.documents]
    top_n = len(texts) if req.top_n is None else min(req.top_n, len(texts))
    return RerankJob(req.query, texts, top_n, req.return_documents,
                     req.instruction if req.instruction is not None else DEFAULT_INSTRUCTION)
