"""The typed, versioned wire contract between zserve's tiers (see messages and codec)."""

from .codec import MAX_FRAME_BYTES, decode, encode
from .messages import (
    PROTOCOL_VERSION,
    AbortRequest,
    AddRequest,
    ClientHello,
    EngineHello,
    EngineStats,
    ErrorMessage,
    GroupWake,
    Message,
    PoolOutput,
    PoolOutputs,
    PoolRequest,
    ProtocolError,
    RequestOutput,
    SamplingParams,
    StepOutputs,
    TopLogprobs,
)
from .speech import TranscribeOutput, TranscribeOutputs, TranscribeRequest, TranscriptSegment

__all__ = [
    "MAX_FRAME_BYTES", "PROTOCOL_VERSION", "AbortRequest", "AddRequest", "ClientHello", "EngineHello",
    "EngineStats", "ErrorMessage",
    "GroupWake", "Message", "PoolOutput", "PoolOutputs", "PoolRequest",
    "ProtocolError", "RequestOutput", "SamplingParams",
    "StepOutputs", "TopLogprobs", "TranscribeOutput", "TranscribeOutputs", "TranscribeRequest", "TranscriptSegment",
    "decode", "encode",
]
