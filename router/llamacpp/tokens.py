"""POST /tokenize and POST /detokenize.

Both read the model's text side only (ModelManager.text_for): they never
load or wake a model and do not count as its use.

Both are bounded and kept off the event loop, so that a big one cannot stall
the other routes: `content` is at most MAX_TOKENIZE_CHARS characters and
`tokens` at most MAX_DETOKENIZE_TOKENS ids (a 400 naming the field past
that); long encodes and decodes and the pieces of `with_pieces` (a chunk at
a time, sent as they come) run on the text pool (router/text/offload.py). How many requests run at once is bounded by
--max-token-count-requests (router/http/token_count_gate.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
from aiohttp import web

from router.http.errors import decode_body, invalid
from router.http.keys import MANAGER
from router.llamacpp.schemas import DetokenizeRequest, TokenizeRequest
from router.text.offload import off_loop
from router.text.token_pieces import TokenPieces, pieces_for
from router.text.tokenizer import Tokenizer

# About 250,000 tokens of English; several MB of JSON with pieces.
MAX_TOKENIZE_CHARS = 1 << 20
MAX_DETOKENIZE_TOKENS = 1 << 20
# Ids whose pieces are worked out in one go on the text pool: a few ms each.
PIECES_CHUNK = 4096
# Below this many ids the work is done in place (well under a millisecond).
INLINE_IDS = 4096


async def tokenize(request: web.Request) -> web.StreamResponse:
    req = decode_body(await request.read(), TokenizeRequest)
    if len(req.content) > MAX_TOKENIZE_CHARS:
        raise invalid(f"'content' may be at most {MAX_TOKENIZE_CHARS} characters, got "
                      f"{len(req.content)}", "content", "too_large")
    manager = request.app[MANAGER]
    text = await manager.text_for(manager.resolve(req.model))
    tokenizer = text.tokenizer
    if req.parse_special:
        ids = await tokenizer.encode_async(req.content, add_special_tokens=req.add_special)
    else:
        ids = await (await _pieces(tokenizer)).encode_plain(req.content)
        if req.add_special and tokenizer.add_bos_token:
            assert tokenizer.bos_token_id is not None
            ids.insert(0, tokenizer.bos_token_id)
    if req.with_pieces:
        return await _with_pieces(request, await _pieces(tokenizer), ids)
    # msgspec writes a million ids in a few ms, holding the GIL on any thread.
    return _json(msgspec.json.encode({"tokens": ids}))


async def detokenize(request: web.Request) -> web.Response:
    req = decode_body(await request.read(), DetokenizeRequest)
    if len(req.tokens) > MAX_DETOKENIZE_TOKENS:
        raise invalid(f"'tokens' may hold at most {MAX_DETOKENIZE_TOKENS} ids, got "
                      f"{len(req.tokens)}", "tokens", "too_large")
    manager = request.app[MANAGER]
    text = await manager.text_for(manager.resolve(req.model))
    tokenizer = text.tokenizer
    if len(req.tokens) <= INLINE_IDS:
        content = _decode(tokenizer, req.tokens)
    else:
        content = await off_loop(_decode, tokenizer, req.tokens)
    return _json(msgspec.json.encode({"content": content}))


def _decode(tokenizer: Tokenizer, ids: list[int]) -> str:
    _check_ids(ids, tokenizer.id_limit)
    # Special tokens are written out, as llama.cpp's detokenizer writes them.
    return tokenizer.decode(ids, skip_special_tokens=False)


def _check_ids(ids: Sequence[int], n_vocab: int) -> None:
    if not ids or (min(ids) >= 0 and max(ids) < n_vocab):
        return
    index, bad = next((i, t) for i, t in enumerate(ids) if not 0 <= t < n_vocab)
    if bad < 0:
        raise invalid(f"token id {bad} (tokens[{index}]) in 'tokens' is negative", "tokens")
    raise invalid(f"token id {bad} (tokens[{index}]) in 'tokens' is outside the vocabulary "
                  f"(0..{n_vocab - 1})", "tokens")


async def _pieces(tokenizer: Tokenizer) -> TokenPieces:
    # Made on first use per tokenizer, from its added tokens and perhaps its
    # whole vocabulary: not on the event loop.
    return await off_loop(pieces_for, tokenizer)


async def _with_pieces(request: web.Request, pieces: TokenPieces,
                       ids: list[int]) -> web.StreamResponse:
    """{"tokens": [{"id": ..., "piece": ...}, ...]}, worked out a chunk at a
    time on the text pool and sent as it comes: several MB of JSON are never
    joined (nor copied) in one go on the event loop, and a slow reader holds
    back the work instead of the server buffering its answer."""
    if len(ids) <= INLINE_IDS:
        return _json(b'{"tokens":[' + _pieces_json(pieces, ids) + b"]}")
    response = web.StreamResponse(headers={"Content-Type": "application/json"})
    await response.prepare(request)
    await response.write(b'{"tokens":[')
    for start in range(0, len(ids), PIECES_CHUNK):
        part = await off_loop(_pieces_json, pieces, ids[start:start + PIECES_CHUNK])
        await response.write(part if start == 0 else b"," + part)
    await response.write(b"]}")
    await response.write_eof()
    return response


class _Piece(msgspec.Struct, gc=False):
    # Untracked by the garbage collector: a million dicts would set off full
    # collections, each a pause of every thread, the event loop's included.
    id: int
    piece: str | list[int]


def _pieces_json(pieces: TokenPieces, ids: list[int]) -> bytes:
    # The items of a JSON array, without its brackets.
    return msgspec.json.encode([_Piece(i, pieces.piece(i)) for i in ids])[1:-1]


def _json(body: bytes) -> web.Response:
    return web.Response(body=body, content_type="application/json")
