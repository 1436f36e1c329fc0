"""The prefix cache's disk tier through a real server (CPU engine): a prompt
served before a restart gets its prefix back from the disk after it, and says
so in usage.prompt_tokens_details.cached_tokens, /v1/load and /metrics."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.e2e.test_host_kv_tier import chat, counters, message
from tests.support.server import running_server, wait_until


def serve(model: Path, directory: Path, log_path: Path) -> Any:
    # 16 device pages of 8 tokens, a host tier of 1 MiB, a disk tier of 64 MiB.
    return running_server([str(model), "--device", "cpu", "--threads", "1", "--page-size", "8",
                           "--kv-capacity", "128", "--max-concurrency", "2",
                           "--output-window", "8", "--host-kv-mib", "1",
                           "--disk-kv-path", str(directory), "--disk-kv-mib", "64"], log_path)


def test_a_restart_serves_the_prefix_from_the_disk_tier(
        tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    turn = [{"role": "user", "content": message(11, 40)}]
    with serve(tiny_qwen3_dir, tmp_path / "kv", tmp_path / "first.log") as server:
        first = chat(server, turn)
        assert first["usage"]["prompt_tokens"] > 40
        (load,) = server.load().values()
        assert load["occupancy"]["disk_kv_capacity_bytes"] == 64 * 2**20
        # Other prompts push the first one's pages off the device.
        for seed in range(12, 16):
            chat(server, [{"role": "user", "content": message(seed, 40)}])
    # SIGTERM: the engine wrote the cached pages on its way out.
    log = (tmp_path / "first.log").read_text()
    assert "disk KV tier: wrote" in log, log[-3000:]
    assert list((tmp_path / "kv").glob("*/*/*"))

    with serve(tiny_qwen3_dir, tmp_path / "kv", tmp_path / "second.log") as server:
        again = chat(server, turn)
        assert again["choices"][0]["message"] == first["choices"][0]["message"]
        cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == (first["usage"]["prompt_tokens"] - 1) // 8 * 8
        wait_until(lambda: counters(server)["disk_kv_hit_tokens"] > 0, 10,
                   "the disk tier's hits to be published", server)
        after: dict[str, int] = counters(server)
        assert after["disk_kv_hit_tokens"] == cached == after["cached_prompt_tokens"]
        # Right after the restart nothing is measured: the restore went ahead.
        assert after["disk_kv_corrupt_pages"] == after["disk_kv_skipped"] == 0
        metrics = server.get("/metrics").text
        assert (f'roundhouse:disk_kv_hit_tokens_total{{model="tiny-qwen3"}} '
                f"{float(cached)}") in metrics
        assert 'roundhouse:disk_kv_pages{model="tiny-qwen3"}' in metrics
        assert 'roundhouse:disk_kv_skipped_total{model="tiny-qwen3"} 0.0' in metrics


