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
    TokenLogprobs,
    Wake,
    command_decoder,
    encoder,
    event_decoder,
)
from protocol.sampling import (
    MAX_TOP_LOGPROBS,
    FinishReason,
    GrammarKind,
    GrammarSpec,
    SamplingParams,
)

__all__ = [
    "MAX_TOP_LOGPROBS",
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
    "TokenLogprobs",
    "Wake",
    "command_decoder",
    "encoder",
    "event_decoder",
]
