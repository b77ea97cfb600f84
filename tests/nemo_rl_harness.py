"""What the context-length tests share: NeMo-Gym's rule, vLLM doubles, import roots.

NeMo-Gym's side of the contract is written here once, as data (``NEMO_GYM_LENGTH_RULE``),
so a change on either side fails the tests. The vLLM doubles stand in for the few vLLM
objects the NeMo-RL chat route touches, with the behaviour that matters here: the
renderer rejects a prompt longer than the context with vLLM's "maximum context length"
error, a prompt of exactly the context length passes it (and then meets NeMo-RL's clamp),
and a test can make the serving layer raise whatever vLLM's own code would.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

from pydantic import BaseModel

TARGET = "nemo_rl/models/generation/vllm/vllm_worker_async.py"
FIXTURES = Path(__file__).parent / "fixtures" / "nemo_rl"
PATCH_ID = "nemo-rl-context-length-400"


@dataclass(frozen=True)
class LengthRule:
    """How NeMo-Gym's vLLM proxy tells "the prompt did not fit" from a failure."""

    status_code: int
    substrings: tuple[str, ...]  # any one of them, case-sensitive, in the raw body

    def ends_rollout_cleanly(self, status_code: int, body: bytes) -> bool:
        text = body.decode("utf-8")
        return status_code == self.status_code and any(s in text for s in self.substrings)


# NeMo-Gym, responses_api_models/vllm_model/app.py: a 400 whose raw body contains either
# substring becomes an empty completion with finish_reason="length"; anything else is
# raised to the agent and retried.
NEMO_GYM_LENGTH_RULE = LengthRule(status_code=400, substrings=("context length", "max_tokens"))


# ---------------------------------------------------------------- vLLM's overflow wording


# Shaped like vLLM 0.33's messages (tests/heavy/vllm-0.33 checks the real ones).
def renderer_overflow_message(max_model_len: int, prompt_tokens: int) -> str:
    return (
        f"This model's maximum context length is {max_model_len} tokens. However, your "
        f"prompt contains {prompt_tokens} input tokens, which exceeds this limit."
    )


def serving_overflow_message(max_model_len: int, prompt_tokens: int) -> str:
    return f"Input length ({prompt_tokens}) exceeds model's maximum context length ({max_model_len})."


# ---------------------------------------------------------------- vLLM doubles


@dataclass
class FakeEngine:
    """The engine client NeMo-RL hands to vLLM's serving classes."""

    max_model_len: int = 16
    serving_error: BaseException | None = None  # raised by the serving layer after rendering
    model_config: Any = field(init=False)

    def __post_init__(self) -> None:
        self.model_config = SimpleNamespace(max_model_len=self.max_model_len)


def _module(name: str, **attrs: Any) -> ModuleType:
    module = ModuleType(name)
    module.__dict__.update(attrs)
    return module


def vllm_doubles(validation_error_base: type[Exception] = Exception) -> dict[str, ModuleType]:
    """The vLLM modules the fixtures import, as ``sys.modules`` entries.

    ``validation_error_base``: vLLM 0.33's VLLMValidationError is not a ValueError; older
    releases made it one. The route must answer both the same way.
    """

    class VLLMValidationError(validation_error_base):  # type: ignore[misc, valid-type]
        def __init__(self, message: str, *, parameter: str | None = None, value: Any = None):
            super().__init__(message)
            self.parameter, self.value = parameter, value

    def render(model_config: Any, messages: list[dict[str, Any]]) -> tuple[list, list[dict]]:
        # one token per word is tokenizer enough for a length contract
        tokens = [i for m in messages for i, _ in enumerate(str(m.get("content", "")).split())]
        if len(tokens) > model_config.max_model_len:
            raise VLLMValidationError(
                renderer_overflow_message(model_config.max_model_len, len(tokens)),
                parameter="input_tokens",
                value=len(tokens),
            )
        return messages, [{"prompt_token_ids": tokens}]

    class ChatCompletionRequest(BaseModel):
        model: str = "policy"
        messages: list[dict[str, Any]]
        max_tokens: int | None = None
        max_completion_tokens: int | None = None

    class ChatCompletionResponse(BaseModel):
        prompt_tokens: int
        max_tokens: int | None

    class ErrorInfo(BaseModel):
        message: str
        type: str
        code: int

    class ErrorResponse(BaseModel):
        error: ErrorInfo

    class OnlineRenderer:
        def __init__(self, model_config: Any, **_: Any):
            self.model_config = model_config

        async def preprocess_chat(self, request: Any, messages: Any, *args: Any, **kwargs: Any):
            return render(self.model_config, messages)

    class OpenAIServingChat:
        def __init__(self, engine_client: FakeEngine, online_renderer: Any = None, **_: Any):
            self.engine_client = engine_client
            self.model_config = engine_client.model_config
            self.online_renderer = online_renderer

        # older releases rendered on the serving class itself (the mixin sat here)
        async def preprocess_chat(self, request: Any, messages: Any, *args: Any, **kwargs: Any):
            return render(self.model_config, messages)

        async def create_chat_completion(self, request: Any, raw_request: Any = None):
            renderer = self.online_renderer if self.online_renderer is not None else self
            _, prompts = await renderer.preprocess_chat(request, request.messages)
            if self.engine_client.serving_error is not None:
                raise self.engine_client.serving_error
            budget = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
            return ChatCompletionResponse(prompt_tokens=len(prompts[0]["prompt_token_ids"]), max_tokens=budget)

    prefix = "vllm.entrypoints.openai"
    leaves = {
        "vllm.exceptions": _module("vllm.exceptions", VLLMValidationError=VLLMValidationError),
        f"{prefix}.chat_completion.protocol": _module(
            f"{prefix}.chat_completion.protocol",
            ChatCompletionRequest=ChatCompletionRequest,
            ChatCompletionResponse=ChatCompletionResponse,
        ),
        f"{prefix}.chat_completion.serving": _module(
            f"{prefix}.chat_completion.serving", OpenAIServingChat=OpenAIServingChat
        ),
        f"{prefix}.engine.protocol": _module(f"{prefix}.engine.protocol", ErrorResponse=ErrorResponse),
        "vllm.renderers.online_renderer": _module("vllm.renderers.online_renderer", OnlineRenderer=OnlineRenderer),
    }
    modules = dict(leaves)
    for name in leaves:
        parts = name.split(".")
        for i in range(1, len(parts)):
            modules.setdefault(".".join(parts[:i]), _module(".".join(parts[:i])))
    return modules


_loaded = 0


def load_module(path: Path) -> ModuleType:
    """Import a (patched) NeMo-RL file under a fresh name, as NeMo-RL's process would."""
    global _loaded
    _loaded += 1
    spec = importlib.util.spec_from_file_location(f"_nemo_rl_under_test_{_loaded}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def chat_app(module: ModuleType, engine: FakeEngine):
    """A FastAPI app with the module's chat route, served against ``engine``."""
    from fastapi import FastAPI

    worker_classes = [
        v for v in vars(module).values() if isinstance(v, type) and hasattr(v, "_setup_vllm_openai_api_server")
    ]
    assert len(worker_classes) == 1, worker_classes
    worker = worker_classes[0](engine)
    return worker._setup_vllm_openai_api_server(FastAPI())


def chat_body(words: int, max_tokens: int = 4) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": " ".join(["word"] * words)}],
        "max_tokens": max_tokens,
    }


# ---------------------------------------------------------------- import roots


def site_packages(
    root: Path,
    source: bytes,
    *,
    version: str = "0.7.0",
    folder: str = "nemo_rl",
    name: str = "nemo-rl",
) -> Path:
    """A site-packages holding ``source`` as NeMo-RL's worker file, installed as a wheel would."""
    target = root / TARGET
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(source)
    meta = root / f"{folder}-{version}.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (meta / "RECORD").write_text(f"{TARGET},,\n{meta.name}/METADATA,,\n{meta.name}/RECORD,,\n")
    return target


def source_checkout(root: Path, source: bytes) -> Path:
    """A NeMo-RL source checkout: its version is dynamic (read from the package at build)."""
    target = root / TARGET
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(source)
    (root / "nemo_rl" / "__init__.py").write_text('__version__ = "0.7.0"\n')
    (root / "pyproject.toml").write_text(
        '[project]\nname = "nemo-rl"\ndynamic = ["version"]\n\n'
        '[tool.setuptools.dynamic]\nversion = { attr = "nemo_rl.__version__" }\n'
    )
    return target


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` with its bytes: equal snapshots mean nothing was written."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def fixture(name: str) -> bytes:
    """A fixture's bytes; the upstream-fixed shapes are pre_fix.py with their edits applied."""
    from tests.fixtures.nemo_rl.upstream_fixes import DERIVED

    if name not in DERIVED:
        return (FIXTURES / name).read_bytes()
    text = (FIXTURES / "pre_fix.py").read_text()
    for old, new in DERIVED[name]["edits"]:
        assert text.count(old) == 1, f"{name}: an edit's text is not in pre_fix.py exactly once"
        text = text.replace(old, new)
    return text.encode()


def cli(*args: str) -> tuple[int, dict[str, Any]]:
    """Run the ``fp32patch`` CLI in-process with ``--json``: (exit code, parsed output)."""
    from typer.testing import CliRunner

    from fp32patch.cli import app

    result = CliRunner().invoke(app, [*args, "--json"])
    try:
        data = json.loads(result.stdout)
    except ValueError:
        raise AssertionError(f"fp32patch {' '.join(args)} printed no JSON:\n{result.output}") from result.exception
    return result.exit_code, data


def install_doubles(monkeypatch, validation_error_base: type[Exception] = Exception) -> ModuleType:
    """Put the vLLM doubles in ``sys.modules`` for one test; returns ``vllm.exceptions``."""
    modules = vllm_doubles(validation_error_base)
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return modules["vllm.exceptions"]
