"""The scripted engine, writing down every Generate it gets:
`python -m tests.support.recording_engine`.

It answers as tests/support/scripted_engine.py does, and appends one JSON
line per Generate to `received.jsonl` in the model directory: the prompt's
token ids and its images (offset, grid, size, digest, and the sha256 and
length of the pixels), so router tests can check what reaches the engine.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import zmq

from protocol import EngineOptions, Generate
from tests.support.scripted_engine import ScriptedEngine, run_engine, serve

RECEIVED = "received.jsonl"


class RecordingEngine(ScriptedEngine):
    def __init__(self, model: Path, options: EngineOptions, emit_socket: zmq.Socket):
        super().__init__(model, options, emit_socket)
        self.log = model / RECEIVED

    def _start(self, request: Generate) -> None:
        images = [{"offset": image.offset, "grid": [image.grid_t, image.grid_h, image.grid_w],
                   "size": [image.width, image.height], "digest": image.digest.hex(),
                   "rgb_sha256": hashlib.sha256(image.rgb).hexdigest(), "rgb_bytes": len(image.rgb)}
                  for image in request.images]
        with self.log.open("a") as log:
            log.write(json.dumps({"request_id": request.request_id,
                                  "prompt": request.prompt_token_ids, "images": images}) + "\n")
        super()._start(request)


def received(model: Path) -> list[dict]:
    """What the engine of `model` got, oldest first."""
    path = model / RECEIVED
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


if __name__ == "__main__":
    raise SystemExit(run_engine(RecordingEngine, "tests.support.recording_engine", serve))
