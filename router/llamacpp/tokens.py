"""POST /tokenize and POST /detokenize.

Both read the model's text side only (ModelManager.text_for): they never
load or wake a model and do not count as its use.
"""

from __future__ import annotations

from aiohttp import web

from router.http.errors import decode_body, invalid
from router.http.keys import MANAGER
from router.llamacpp.pieces import pieces_for
from router.llamacpp.schemas import DetokenizeRequest, TokenizeRequest


async def tokenize(request: web.Request) -> web.Response:
    req = decode_body(await request.read(), TokenizeRequest)
    manager = request.app[MANAGER]
    text = await manager.text_for(manager.resolve(req.model))
    tokenizer = text.tokenizer
    if req.parse_special:
        ids = await tokenizer.encode_async(req.content, add_special_tokens=req.add_special)
    else:
        ids = await pieces_for(tokenizer).encode_plain(req.content)
        if req.add_special and tokenizer.add_bos_token:
            assert tokenizer.bos_token_id is not None
            ids.insert(0, tokenizer.bos_token_id)
    if not req.with_pieces:
        return web.json_response({"tokens": ids})
    pieces = pieces_for(tokenizer)
    return web.json_response({"tokens": [{"id": i, "piece": pieces.piece(i)} for i in ids]})


async def detokenize(request: web.Request) -> web.Response:
    req = decode_body(await request.read(), DetokenizeRequest)
    bad = next((t for t in req.tokens if t < 0), None)
    if bad is not None:
        raise invalid(f"token id {bad} in 'tokens' is negative", "tokens")
    manager = request.app[MANAGER]
    text = await manager.text_for(manager.resolve(req.model))
    # Special tokens are written out, as llama.cpp's detokenizer writes them.
    return web.json_response({"content": text.tokenizer.decode(req.tokens, skip_special_tokens=False)})
