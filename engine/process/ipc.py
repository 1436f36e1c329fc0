"""The engine's two socket threads.

The input thread receives and decodes router commands into a queue; the output
thread encodes and sends engine events from another queue. Each ZMQ socket is
used by its own thread only (ZMQ sockets are not thread-safe), and the busy
loop never waits on the network.
"""

from __future__ import annotations

import logging
import queue
import threading

import zmq

from protocol import EngineEvent, RouterCommand, Shutdown, command_decoder, encoder

log = logging.getLogger(__name__)

# How long close() waits for queued events (say, EngineDead) to leave.
FLUSH_SECONDS = 5.0


class EngineSockets:
    def __init__(self, input_address: str, output_address: str):
        self._context = zmq.Context()
        self._input_address = input_address
        self._output_address = output_address
        self.commands: queue.Queue[RouterCommand] = queue.Queue()
        self._events: queue.Queue[EngineEvent | None] = queue.Queue()
        self._output_thread = threading.Thread(target=self._send_loop, name="engine-output", daemon=True)
        self._input_thread = threading.Thread(target=self._recv_loop, name="engine-input", daemon=True)

    def start_output(self) -> None:
        """Start sending; called before the model loads so progress can flow."""
        self._output_thread.start()

    def start_input(self) -> None:
        self._input_thread.start()

    def emit(self, event: EngineEvent) -> None:
        self._events.put(event)

    def close(self) -> None:
        self._events.put(None)
        self._output_thread.join(FLUSH_SECONDS)

    def _send_loop(self) -> None:
        socket = self._context.socket(zmq.PUSH)
        socket.setsockopt(zmq.LINGER, int(FLUSH_SECONDS * 1000))
        socket.connect(self._output_address)
        encode = encoder().encode
        while True:
            event = self._events.get()
            if event is None:
                break
            socket.send(encode(event), copy=False)
        socket.close()

    def _recv_loop(self) -> None:
        socket = self._context.socket(zmq.PULL)
        socket.connect(self._input_address)
        decode = command_decoder().decode
        while True:
            frame = socket.recv(copy=False)
            try:
                command = decode(frame.buffer)
            except Exception:
                # A message we cannot read is the router's bug, not a reason
                # to stop serving everyone else.
                log.exception("dropping an undecodable command (%d bytes)", len(frame.buffer))
                continue
            self.commands.put(command)
            if isinstance(command, Shutdown):
                break
