"""What the router tells its operators, wired up in one place: the request
lines and the throughput line on the operational log (always), and the
request log when --request-log-jsonl names a file.

    logs = OperatorLogs.open(config, catalog, sys.argv)  # server_start; OSError if unwritable
    logs.attach(manager)                                 # observers, the periodic throughput task
    ...
    await logs.close(exit_status)                        # server_stop, flushed
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from router.catalog import Catalog
from router.config import ServeConfig
from router.observability.log_lines import RequestLogLines, ThroughputLines
from router.observability.request_log import RequestLog
from router.observability.throughput import ModelThroughput, report_throughput

if TYPE_CHECKING:
    from router.lifecycle import ModelManager

MIB = 1 << 20


class OperatorLogs:
    def __init__(self, config: ServeConfig, request_log: RequestLog | None):
        self.config = config
        self.request_log = request_log
        self.lines = RequestLogLines()

    @classmethod
    def open(cls, config: ServeConfig, catalog: Catalog, argv: Sequence[str]) -> OperatorLogs:
        """Open the request log (if any) and write server_start; raises
        OSError when the file cannot be written, before anything runs."""
        request_log = None
        if config.request_log_jsonl is not None:
            request_log = RequestLog(config.request_log_jsonl,
                                     max(int(config.request_log_max_mib * MIB), 1),
                                     config.request_log_keep)
            request_log.server_started(config, catalog, argv)
        return cls(config, request_log)

    def attach(self, manager: ModelManager) -> None:
        """Hear the manager's requests and models; report throughput every
        --log-stats-interval-ms (a task the manager cancels at shutdown)."""
        manager.observers.requests.append(self.lines)
        sinks: list[Callable[[list[ModelThroughput]], None]] = [ThroughputLines()]
        if self.request_log is not None:
            self.request_log.attach(manager)
            manager.observers.requests.append(self.request_log)
            manager.observers.models.append(self.request_log)
            sinks.append(self.request_log.throughput)
        interval = self.config.log_stats_interval_ms / 1000
        if interval > 0:
            manager.spawn(report_throughput(lambda: manager.slots.values(), interval, sinks),
                          "throughput-log")

    async def close(self, exit_status: int) -> None:
        """server_stop, then wait (off the event loop) for the file to be written."""
        if self.request_log is not None:
            await asyncio.to_thread(self.request_log.close, exit_status)
