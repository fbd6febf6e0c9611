"""The environment interface, the tool-runner interface and the registry of environments.

An environment holds one trajectory's state (one instance per attempt, built by
`make_env`): `await env.reset(problem)` gives the first observation (the prompt text),
and `await env.step(action, num_tokens=n)` takes the text of one sampled turn and gives a `Step`
(observation, reward, done, info). Observations are text here; the episode driver
(fnrl.envs.episode) encodes each one once and appends its ids verbatim.

Tools are described by OpenAI-style function schemas (`ToolSpec.schema`) and executed
by a `ToolRunner`, injected into the environment: `InlineCalculator` runs the pure
calculator on the event loop (unit tests, the tiny task); fnrl.sandbox.SandboxPool runs
any tool in sandboxed worker processes. An environment never blocks the event loop.

Environments are registered by name in `ENVS` (`@register_env("name")`) and built by
fnrl.envs.registry.make_env from `task.env`; fnrl.config.run.ENV_NAMES lists the
built-in names for validation, and registering a new one lets the config accept it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol

from fnrl.config.run import accept_env_name
from fnrl.envs.calculator import calculate
from fnrl.types import Problem

REASONS = ("ok", "error", "bad_call", "timeout", "cpu_limit", "memory", "crashed",
           "output_limit", "network", "forbidden")
"""Why a tool call ended: `ok`, or what cut it off (see docs/environments.md)."""


@dataclass(frozen=True, kw_only=True)
class ToolSpec:
    """A tool as the model is told about it (an OpenAI function schema)."""

    name: str
    description: str
    parameters: Mapping[str, Any]
    """JSON Schema of the arguments object."""

    @property
    def schema(self) -> dict[str, Any]:
        """{"type": "function", "function": {...}}, what chat templates take as `tools`."""
        return {"type": "function", "function": {
            "name": self.name, "description": self.description,
            "parameters": dict(self.parameters)}}


CALCULATOR = ToolSpec(
    name="calculator", description="Evaluate an arithmetic expression (+ - * / // % ** and "
    "parentheses) and return its value.",
    parameters={"type": "object", "required": ["expression"],
                "properties": {"expression": {"type": "string"}}})
PYTHON = ToolSpec(
    name="python", description="Run Python code in a sandbox without network; returns what "
    "it prints and the value of its last expression.",
    parameters={"type": "object", "required": ["code"], "properties": {"code": {"type": "string"}}})


@dataclass(frozen=True, kw_only=True)
class ToolResult:
    """What one tool call returned: its reply text and why it ended (REASONS)."""

    text: str
    reason: str = "ok"
    elapsed_s: float = 0.0

    def __post_init__(self):
        if self.reason not in REASONS:
            raise ValueError(f"ToolResult.reason={self.reason!r} is not one of {REASONS}")

    @property
    def ok(self) -> bool:
        return self.reason == "ok"


class ToolRunner(Protocol):
    """Executes a tool call off the event loop."""

    async def call(self, name: str, arguments: Mapping[str, Any]) -> ToolResult: ...


class InlineCalculator:
    """A ToolRunner for the calculator only, evaluated in-process (bounded, pure); with
    nothing to start or close, it also serves as a tools handle (fnrl.control.handles)."""

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def call(self, name: str, arguments: Mapping[str, Any]) -> ToolResult:
        if name != "calculator" or not isinstance(arguments.get("expression"), str):
            return ToolResult(text=f"error: no tool {name!r} with these arguments",
                              reason="bad_call")
        reply = calculate(arguments["expression"])
        return ToolResult(text=reply, reason="error" if reply.startswith("error:") else "ok")


@dataclass(frozen=True, kw_only=True)
class Step:
    """One environment step's outcome. `reward` is None until the episode ends."""

    observation: str
    reward: float | None
    done: bool
    info: dict[str, Any] = field(default_factory=dict)


class Env(Protocol):
    """One trajectory's environment (see the module docstring)."""

    tools: tuple[ToolSpec, ...]
    stop: tuple[str, ...]
    """Strings that end a sampled turn (a tool call's closing tag)."""

    async def reset(self, problem: Problem) -> str: ...

    async def step(self, action: str, *, num_tokens: int = 0) -> Step:
        """`action`: one sampled turn's text; `num_tokens`: its length in tokens."""
        ...

    async def close(self) -> None: ...

    # Optional: `async def restore(self, problem, steps: Sequence[dict]) -> None` puts the
    # environment in the state after the non-final steps whose infos are `steps`, so a
    # cut-off episode resumes where it was (fnrl.envs.episode.Resume); an environment
    # without it runs a cut-off episode afresh.


EnvFactory = Callable[..., Env]
ENVS: dict[str, EnvFactory] = {}


def register_env(name: str):
    """Decorator adding an environment factory to `ENVS` under `name`."""
    def wrap(factory: EnvFactory) -> EnvFactory:
        if name in ENVS:
            raise ValueError(f"environment {name!r} is already registered")
        ENVS[name] = factory
        accept_env_name(name)   # the config validates task.env without the registry
        return factory
    return wrap
