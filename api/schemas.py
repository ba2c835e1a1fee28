"""Request and response bodies (pydantic v2) of the LangGraph protocol, Elesium and OpenAI routes.

Protocol requests accept the fields langgraph-sdk sends and ignore what this server does not use
(webhooks, feedback keys, LangSmith tracing); ``extra="ignore"`` keeps newer SDKs working. Fields
that change what runs (``interrupt_before``, ``multitask_strategy`` other than ``reject``) are
refused with a 422 naming the field rather than silently dropped.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

StreamModeName = Literal[
    "values",
    "updates",
    "messages",
    "messages-tuple",
    "custom",
    "events",
    "debug",
    "tasks",
    "checkpoints",
    "lifecycle",
    "tools",
]
SUPPORTED_STREAM_MODES = ("values", "updates", "messages", "messages-tuple", "custom")


class Loose(BaseModel):
    model_config = ConfigDict(extra="ignore")


class CommandBody(Loose):
    resume: Any = None
    update: dict[str, Any] | list[Any] | None = None
    goto: str | list[str] | None = None


class CheckpointRef(Loose):
    thread_id: str | None = None
    checkpoint_ns: str = ""
    checkpoint_id: str | None = None


class RunCreate(Loose):
    assistant_id: str = Field(min_length=1, max_length=200)
    input: dict[str, Any] | None = None
    command: CommandBody | None = None
    config: dict[str, Any] | None = None
    context: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    stream_mode: StreamModeName | list[StreamModeName] = "values"
    checkpoint: CheckpointRef | None = None
    checkpoint_id: str | None = None
    interrupt_before: Any = None
    interrupt_after: Any = None
    multitask_strategy: Literal["reject", "interrupt", "rollback", "enqueue"] | None = None
    if_not_exists: Literal["create", "reject"] | None = None
    on_disconnect: Literal["cancel", "continue"] | None = None
    on_completion: Literal["delete", "keep"] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)

    @field_validator("interrupt_before", "interrupt_after")
    @classmethod
    def _no_static_interrupts(cls, v: Any) -> Any:
        if v:
            raise ValueError(
                "static interrupt_before/interrupt_after are not supported; workflows declare "
                "their approval points with interrupt()"
            )
        return v

    @property
    def modes(self) -> list[str]:
        modes = [self.stream_mode] if isinstance(self.stream_mode, str) else list(self.stream_mode)
        return modes or ["values"]

    @property
    def fork_checkpoint(self) -> str | None:
        return self.checkpoint_id or (self.checkpoint.checkpoint_id if self.checkpoint else None)


class ThreadCreate(Loose):
    # No U+001F: it separates a thread id from its tenant in tenant-scoped stored ids (state.threads).
    thread_id: str | None = Field(default=None, min_length=1, max_length=200, pattern=r"^[^\x1f]+$")
    metadata: dict[str, Any] | None = None
    if_exists: Literal["raise", "do_nothing"] | None = None


class ThreadPatch(Loose):
    metadata: dict[str, Any] | None = None


class ThreadSearch(Loose):
    metadata: dict[str, Any] | None = None
    values: dict[str, Any] | None = None
    status: Literal["idle", "busy", "interrupted", "error"] | None = None
    ids: list[str] | None = None
    limit: int = Field(default=10, ge=0, le=1000)
    offset: int = Field(default=0, ge=0)


class AssistantSearch(Loose):
    metadata: dict[str, Any] | None = None
    graph_id: str | None = None
    name: str | None = None
    limit: int = Field(default=10, ge=0, le=1000)
    offset: int = Field(default=0, ge=0)


class StateUpdate(Loose):
    values: dict[str, Any] | list[Any] | None = None
    as_node: str | None = None
    checkpoint_id: str | None = None
    checkpoint: CheckpointRef | None = None


class StateCheckpointRequest(Loose):
    checkpoint: CheckpointRef
    subgraphs: bool = False


class HistoryRequest(Loose):
    limit: int = Field(default=10, ge=1, le=1000)
    before: str | CheckpointRef | dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    checkpoint: CheckpointRef | dict[str, Any] | None = None


class ReplayRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: Literal["reexecute", "recorded"] = "reexecute"


# ---------------------------------------------------------------- OpenAI
class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(str(p.get("text", "")) for p in self.content if p.get("type", "text") == "text")
        return self.content or ""


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    """``/v1/chat/completions``'s body. Keys not declared here land in ``model_extra`` and are judged
    by :func:`elesium.api.chat_completions.prepare`: harmless ones (``user``, ``metadata``...) are
    accepted, every other one answers 400 naming it, so nothing is silently ignored."""

    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1)
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, description="keep the k most likely tokens (0: all); vLLM's extra "
                       "sampling parameter, sent by the OpenAI SDK through extra_body")
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    deadline_s: float | None = Field(
        default=None, gt=0, le=86400, allow_inf_nan=False,
        description="seconds from the request's arrival after which the answer ends with what it has "
                    "(finish_reason \"length\"; Elesium's extra parameter, sent through extra_body)")
    mode: Literal["vanilla", "speculative", "medusa", "typical"] | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return v
