"""One request's outcome: timings, token counts and, if it failed, what kind of failure.

Times are seconds on the client's clock; `start` is relative to the run's start, the other
times to the request's own send. The JSON form (`as_json`) is what `--out` files hold and
`record_from_json` reads it back, so a saved run can be re-summarized and re-plotted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class ErrorKind(str, Enum):
    HTTP = "http"  # a non-200 status; the key in counts is http_<status>
    CONNECTION = "connection"  # refused, reset, or the connection dropped mid-stream
    TIMEOUT = "timeout"  # connect or whole-request timeout
    STREAM_ERROR = "stream_error"  # an error event, or finish_reason "error"
    INCOMPLETE = "incomplete"  # the stream ended cleanly without a finish or [DONE]
    BAD_RESPONSE = "bad_response"  # not SSE, not JSON, or not the OpenAI shape


@dataclass
class RequestRecord:
    index: int  # the request's position in its workload's request list
    workload: str
    start: float  # when it was sent, seconds from the start of the run
    prompt_len: int  # the dataset's token count
    target_output_len: int
    ttft: float | None = None  # seconds
    itl: list[float] = field(default_factory=list)  # seconds between token events
    latency: float | None = None  # send -> end of stream, seconds (also for failures)
    output_tokens: int = 0
    prompt_tokens: int | None = None  # the server's usage.prompt_tokens
    finish_reason: str | None = None
    error: ErrorKind | None = None
    error_detail: str | None = None
    http_status: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None below two tokens."""
        if not self.ok or self.ttft is None or self.latency is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    @property
    def error_key(self) -> str | None:
        if self.error is ErrorKind.HTTP:
            return f"http_{self.http_status}"
        return self.error.value if self.error is not None else None

    def token_times(self) -> list[float]:
        """Absolute times (seconds from the run's start) of every token event."""
        if self.ttft is None:
            return []
        t = self.start + self.ttft
        out = [t]
        for gap in self.itl:
            t += gap
            out.append(t)
        return out

    def as_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "workload": self.workload,
            "start": self.start,
            "prompt_len": self.prompt_len,
            "target_output_len": self.target_output_len,
            "ttft": self.ttft,
            "itl": self.itl,
            "latency": self.latency,
            "tpot": self.tpot,
            "output_tokens": self.output_tokens,
            "prompt_tokens": self.prompt_tokens,
            "finish_reason": self.finish_reason,
            "error": self.error_key,
            "error_detail": self.error_detail,
            "http_status": self.http_status,
        }


def record_from_json(d: dict[str, Any]) -> RequestRecord:
    """The inverse of RequestRecord.as_json (for re-reading a run's --out file)."""
    error, status = d.get("error"), d.get("http_status")
    kind = None
    if error is not None:
        kind = ErrorKind.HTTP if error.startswith("http_") else ErrorKind(error)
    rec = RequestRecord(
        d["index"], d["workload"], d["start"], d["prompt_len"], d["target_output_len"]
    )
    rec.ttft, rec.itl, rec.latency = d["ttft"], list(d["itl"]), d["latency"]
    rec.output_tokens, rec.prompt_tokens = d["output_tokens"], d["prompt_tokens"]
    rec.finish_reason, rec.error, rec.error_detail = d["finish_reason"], kind, d["error_detail"]
    rec.http_status = status
    return rec
