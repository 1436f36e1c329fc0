"""Messages between the router and its engine processes.

msgspec Structs only; this package depends on msgspec and the standard library
alone, so both sides (and tests) can import it cheaply.
"""

from protocol.errors import ErrorCode
from protocol.launch import EngineOptions
from protocol.messages import (
    PROTOCOL_VERSION,
    Abort,
    Awake,
    EngineDead,
    EngineEvent,
    EngineStats,
    Generate,
    GrammarVocab,
    KvFacts,
    LoadProgress,
    MemoryFacts,
    ModelFacts,
    Ready,
    RequestError,
    RequestOutput,
    RouterCommand,
    Shutdown,
    Sleep,
    Slept,
    StepOutputs,
    Wake,
    command_decoder,
    encoder,
    event_decoder,
)
from protocol.sampling import FinishReason, GrammarKind, GrammarSpec, SamplingParams

__all__ = [
    "PROTOCOL_VERSION",
    "Abort",
    "Awake",
    "EngineDead",
    "EngineEvent",
    "EngineOptions",
    "EngineStats",
    "ErrorCode",
    "FinishReason",
    "Generate",
    "GrammarKind",
    "GrammarSpec",
    "GrammarVocab",
    "KvFacts",
    "LoadProgress",
    "MemoryFacts",
    "ModelFacts",
    "Ready",
    "RequestError",
    "RequestOutput",
    "RouterCommand",
    "SamplingParams",
    "Shutdown",
    "Sleep",
    "Slept",
    "StepOutputs",
    "Wake",
    "command_decoder",
    "encoder",
    "event_decoder",
]
