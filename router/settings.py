"""What the router knows about serving one model, resolved once per model from
the defaults, a preset's [*] section, the model's own section and the command
line (in rising order of precedence; see router/options.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from protocol import EngineOptions


@dataclass(frozen=True)
class SamplingOverrides:
    """Sampling defaults for requests that set none (llama.cpp's --temp,
    --top-k, --top-p, --min-p); None leaves the next source in charge."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    # --seed for requests that bring none (-1: a random seed per request).
    seed: int | None = None


@dataclass(frozen=True)
class ModelSettings:
    engine: EngineOptions = field(default_factory=EngineOptions)
    # Where the engine runs: auto (a GPU when there is one, placed by the
    # router's planner, else the CPU), cpu, cuda (any GPU) or cuda:N (pinned).
    # The router writes the chosen device into the engine's options at launch.
    device: str = "auto"
    sampling: SamplingOverrides = field(default_factory=SamplingOverrides)
    # To make room under --models-max, sleep this model instead of unloading it.
    model_suspend: bool = False
    # Where a sleeping model's weights wait: pinned host memory (fast wake) or
    # nowhere (read from disk again on wake).
    suspend_weights: Literal["host", "disk"] = "disk"
    # 0 disables each idle timer. Only requests count as use.
    sleep_idle_seconds: float = 0.0
    unload_idle_seconds: float = 0.0
    # Seconds a load (or wake) may take before it counts as failed.
    load_timeout: float = 600.0
    # Seconds an engine gets to exit after Shutdown before it is terminated.
    stop_timeout: float = 10.0
    # Preset only: load when the router starts.
    load_on_startup: bool = False
    # Other names requests may use for this model.
    aliases: tuple[str, ...] = ()
    # --chat-template FILE: the Jinja source that replaces the model's template.
    chat_template: str | None = None
    # --chat-template-kwargs: a JSON object of template variables every request
    # gets unless it sets them itself. Kept as JSON text so settings stay hashable.
    chat_template_kwargs: str = "{}"
    # --reasoning-budget (llama.cpp's): reasoning tokens a thinking model may
    # write when the request names no budget or effort (router/chat/
    # thinking_budget.py); -1 no limit, 0 thinking off.
    reasoning_budget: int = -1
    # Labels listed in the model's /models card (llama.cpp's --tags); no effect on routing.
    tags: tuple[str, ...] = ()
    # --reranking: answer POST /rerank with this model as a yes/no judge
    # (Qwen3-Reranker's prompt; router/rerank/). Off, rerank is refused.
    reranking: bool = False
    # llama.cpp's --slot-save-path: the directory POST /slots/{id}?action=save
    # and restore use (None: those actions are refused); --no-slots turns
    # GET /slots off (router/llamacpp/slots.py).
    slot_save_path: str | None = None
    slots_endpoint: bool = True
