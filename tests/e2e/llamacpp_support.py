"""What the llama.cpp API tests share: reading llama.cpp's server-sent events
and a text-only model that asks for a BOS token."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import requests

from tests.support.server import Server


def stream_events(server: Server, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """Every `data:` event of a streamed answer; fails on anything that is not
    a JSON object (llama.cpp sends no [DONE])."""
    events = []
    with requests.post(server.url + path, json=body, stream=True, timeout=300) as response:
        assert response.status_code == 200, response.text
        assert response.headers["Content-Type"].startswith("text/event-stream")
        for raw in response.iter_lines():
            line = raw.decode()
            if not line:
                continue
            assert line.startswith("data: "), line
            events.append(json.loads(line[len("data: "):]))
    return events


def bos_model(target: Path, base: Path) -> Path:
    """`base` (a Hugging Face directory) whose tokenizer puts <|endoftext|> in
    front of every prompt: a model that wants a BOS token."""
    target.mkdir(parents=True)
    for source in base.iterdir():
        if source.name != "tokenizer_config.json":
            (target / source.name).symlink_to(source)
    config = json.loads((base / "tokenizer_config.json").read_text())
    config.update(add_bos_token=True, bos_token="<|endoftext|>")
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    return target
