"""Memory the router holds per request waiting for a lane.

    .venv/bin/python tests/perf/bench_waiting_memory.py [--waiting 500]
    .venv/bin/python tests/perf/bench_waiting_memory.py --smoke    # 5 waiting: does it run?
    .venv/bin/python tests/perf/bench_waiting_memory.py --model DIR  # script this tiny Qwen3

A router with one lane (a scripted engine, so no model memory is involved)
gets one long streamed request holding the lane, then N more that wait; the
router process's resident memory is read before and while they wait.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import psutil

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.support.scripted_models import ENGINE_ENV, QWEN3_SCRIPT, scripted_model  # noqa: E402
from tests.support.server import running_server  # noqa: E402
from tests.support.tiny_models import build_tiny_model  # noqa: E402

BODY = {"model": "m", "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 4}


def rss(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


async def measure(url: str, pid: int, waiting: int) -> dict[str, float]:
    connector = aiohttp.TCPConnector(limit=0)  # one connection per waiting request
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        for _ in range(3):  # warm the handler path
            async with session.post(url + "/v1/chat/completions", json=BODY) as response:
                await response.read()
        before = rss(pid)
        # The scripted story is about 1,200 tokens, 5 ms each: the lane is
        # held for seconds. No max_tokens: the default budget fits the context.
        hold_body = {**BODY, "messages": [{"role": "user", "content": "Tell me a long story"}],
                     "stream": True}
        hold_body.pop("max_tokens")
        hold = await session.post(url + "/v1/chat/completions", json=hold_body)
        if hold.status != 200:
            raise SystemExit(f"the request meant to hold the lane was refused: {await hold.text()}")
        await hold.content.readline()
        tasks = [asyncio.create_task(session.post(url + "/v1/chat/completions", json=BODY))
                 for _ in range(waiting)]
        deadline = time.monotonic() + 60
        while True:
            async with session.get(url + "/v1/load") as response:
                queued = (await response.json())["models"][0]["requests"]["waiting"]
            if queued >= waiting:
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"only {queued} of {waiting} requests ever waited")
            await asyncio.sleep(0.2)
        during = rss(pid)
        hold.close()
        for response in await asyncio.gather(*tasks):
            response.close()
    return {"waiting": queued, "rss_before_mib": before / 2**20, "rss_waiting_mib": during / 2**20,
            "bytes_per_waiting_request": (during - before) / max(queued, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--waiting", type=int, default=500)
    parser.add_argument("--smoke", action="store_true", help="only check that it runs: 5 waiting")
    parser.add_argument("--model", type=Path, help="a tiny Qwen3 directory (tests/support/"
                        "tiny_models.py) whose tokenizer the script uses (default: built here)")
    args = parser.parse_args()
    if args.smoke:
        args.waiting = 5
    with tempfile.TemporaryDirectory() as tmp:
        base = args.model or build_tiny_model("qwen3", Path(tmp) / "base")
        models = Path(tmp) / "models"
        models.mkdir()
        scripted_model(models / "m", base, QWEN3_SCRIPT)
        server_args = ["--models-dir", str(models), "--max-concurrency", "1",
                       "--max-pending-requests", str(args.waiting + 10), "--pending-timeout-ms", "600000"]
        with running_server(server_args, Path(tmp) / "router.log", env=ENGINE_ENV) as server:
            result = asyncio.run(measure(server.url, server.process.pid, args.waiting))
    print(json.dumps({"date": time.strftime("%Y-%m-%d"), **result}, indent=2))


if __name__ == "__main__":
    main()
