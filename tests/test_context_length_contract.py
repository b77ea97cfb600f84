"""End to end: the patched NeMo-RL route, served by FastAPI, against NeMo-Gym's rule.

Each test patches a fixture through the CLI, imports the patched file, mounts its chat
route on a real FastAPI app (vLLM's classes are the doubles in nemo_rl_harness) and sends
HTTP requests. A prompt that overflows the context, however it is caught (NeMo-RL's clamp,
vLLM's renderer, vLLM's serving layer), must get an answer that NeMo-Gym turns into
finish_reason="length"; any other ValueError must stay a 500 so it is not mistaken for
one. ``test_contract_catches_mutation`` breaks each side on purpose and checks that
these very checks notice.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from types import ModuleType

import pytest

from fp32patch.runtime.context_length import (
    CONTEXT_LENGTH_MARKER,
    context_length_message,
    is_context_length_overflow,
)
from tests.nemo_rl_harness import (
    NEMO_GYM_LENGTH_RULE,
    PATCH_ID,
    FakeEngine,
    LengthRule,
    chat_app,
    chat_body,
    cli,
    fixture,
    install_doubles,
    load_module,
    serving_overflow_message,
    site_packages,
)

SPEC_FILE = resources.files("fp32patch.patches") / f"{PATCH_ID}.toml"
MAX_MODEL_LEN = FakeEngine().max_model_len


@dataclass(frozen=True)
class Case:
    """One request to the route, and what NeMo-Gym must make of the answer."""

    id: str
    prompt_words: int
    serving_error: Callable[[], BaseException] | None  # raised by vLLM's serving layer
    overflow: bool | None  # True: a clean "length" end; False: a 500; None: served (200)


CASES = [
    # exactly the context: vLLM's renderer lets it through, NeMo-RL's clamp refuses it
    Case("clamp", MAX_MODEL_LEN, None, True),
    Case("online-renderer", MAX_MODEL_LEN + 4, None, True),
    Case("vllm-serving", 3, lambda: ValueError(serving_overflow_message(MAX_MODEL_LEN, 20)), True),
    Case(
        "unrelated-value-error",
        3,
        lambda: ValueError("chat template failed: unknown role 'robot'"),
        False,
    ),
    Case("fits", 3, None, None),
]
# Our route's handler also tells an overflow from a ValueError that merely mentions a
# context length; an upstream route may check the bare marker and answer that one 400.
PRECISION = Case(
    "context-length-not-overflow",
    3,
    lambda: ValueError("N-gram embedding requires context length >= 1."),
    False,
)
OUR_ROUTE_CASES = [*CASES, PRECISION]


def _client(app):
    with warnings.catch_warnings():
        # starlette's TestClient still works on httpx; its nudge towards httpx2 is noise here
        warnings.filterwarnings("ignore", message="Using `httpx` with `starlette.testclient`")
        from fastapi.testclient import TestClient
    return TestClient(app, raise_server_exceptions=False)


def ask(module: ModuleType, case: Case) -> tuple[int, bytes]:
    engine = FakeEngine(serving_error=case.serving_error() if case.serving_error else None)
    response = _client(chat_app(module, engine)).post("/v1/chat/completions", json=chat_body(case.prompt_words))
    return response.status_code, response.content


def violation(module: ModuleType, case: Case, rule: LengthRule) -> str | None:
    """What is wrong with the route's answer to ``case`` under ``rule``; None if nothing."""
    status, body = ask(module, case)
    clean_end = rule.ends_rollout_cleanly(status, body)
    if case.overflow is None:
        return None if status == 200 else f"{case.id}: a request that fits got {status}: {body!r}"
    if case.overflow:
        if not clean_end:
            return f"{case.id}: NeMo-Gym would retry, not end with length: {status} {body!r}"
        # the body satisfies the rule through our marker, not by luck of other wording
        if CONTEXT_LENGTH_MARKER not in body.decode() or CONTEXT_LENGTH_MARKER not in rule.substrings:
            return f"{case.id}: the answer does not carry the marker NeMo-Gym looks for: {body!r}"
        return None
    if status != 500 or clean_end:
        return f"{case.id}: an unrelated ValueError must stay a 500, got {status} {body!r}"
    return None


def patched(tmp_path: Path, source: str = "pre_fix.py", spec_text: str | None = None) -> ModuleType:
    """``source`` installed in a fresh site-packages, patched by ``fp32patch apply``, imported."""
    target = site_packages(tmp_path / "site-packages", fixture(source))
    args = ["apply", "-s", str(tmp_path / "site-packages"), "--patch", PATCH_ID]
    if spec_text is not None:
        (tmp_path / "specs").mkdir()
        (tmp_path / "specs" / SPEC_FILE.name).write_text(spec_text)
        args += ["--specs", str(tmp_path / "specs")]
    code, data = cli(*args)
    assert code == 0, data
    return load_module(target)


@pytest.fixture(params=[Exception, ValueError], ids=["vllm-0.33-errors", "older-vllm-errors"])
def doubles(request, monkeypatch):
    # VLLMValidationError is a ValueError in older vLLM and not in 0.33: the route's
    # handlers must sort both the same way.
    return install_doubles(monkeypatch, validation_error_base=request.param)


@pytest.mark.parametrize("source", ["pre_fix.py", "reformatted.py"])
@pytest.mark.parametrize("case", OUR_ROUTE_CASES, ids=lambda c: c.id)
def test_patched_route_honours_the_contract(tmp_path, doubles, source, case):
    assert violation(patched(tmp_path, source), case, NEMO_GYM_LENGTH_RULE) is None


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_partly_fixed_file_honours_it_once_patched(tmp_path, doubles, case):
    # upstream's route handler stays; our clamp message is what it must now recognise
    assert violation(patched(tmp_path, "partial_route_fixed.py"), case, NEMO_GYM_LENGTH_RULE) is None


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_obsolete_file_already_honours_it(tmp_path, doubles, case):
    # what `obsolete` promises: upstream's own fix, left untouched, keeps the contract
    target = site_packages(tmp_path, fixture("upstream_fix_route.py"))
    code, data = cli("apply", "-s", str(tmp_path), "--patch", PATCH_ID)
    assert (code, data["patches"][0]["status"]) == (0, "obsolete")
    assert violation(load_module(target), case, NEMO_GYM_LENGTH_RULE) is None


def test_first_upstream_fix_alone_leaves_vllms_serving_overflow_a_500(tmp_path, doubles):
    # why that fix is not `obsolete`: its clamp is answered, vLLM's own ValueError is not
    module = load_module(site_packages(tmp_path, fixture("upstream_fix_clamp.py")))
    serving = next(c for c in CASES if c.id == "vllm-serving")
    assert violation(module, serving, NEMO_GYM_LENGTH_RULE) is not None


@pytest.mark.parametrize("case", OUR_ROUTE_CASES, ids=lambda c: c.id)
def test_first_upstream_fix_honours_it_once_patched(tmp_path, doubles, case):
    # upstream's clamp stays as it is; the route gets our handler for every other overflow
    assert violation(patched(tmp_path, "upstream_fix_clamp.py"), case, NEMO_GYM_LENGTH_RULE) is None


def test_unpatched_route_turns_the_clamp_overflow_into_a_500(tmp_path, monkeypatch):
    # the bug the patch exists for, reproduced by the fixture
    install_doubles(monkeypatch)
    module = load_module(site_packages(tmp_path, fixture("pre_fix.py")))
    status, body = ask(module, CASES[0])
    assert status == 500 and not NEMO_GYM_LENGTH_RULE.ends_rollout_cleanly(status, body)


def test_patched_clamp_says_the_runtime_message(tmp_path, monkeypatch):
    install_doubles(monkeypatch)
    status, body = ask(patched(tmp_path), CASES[0])
    assert status == 400
    assert context_length_message(MAX_MODEL_LEN, MAX_MODEL_LEN) in body.decode()


@pytest.mark.parametrize(
    "message",
    [
        context_length_message(9, 8),
        serving_overflow_message(8, 9),
        "The maximum context length of this model is 8 tokens.",
        "A 9-token prompt leaves no output room under max_model_len 8.",
        "N-gram embedding requires context length >= 1.",
        "Maximum Context Length exceeded",
        "",
    ],
)
def test_route_answers_400_exactly_when_the_runtime_predicate_says_overflow(tmp_path, monkeypatch, message):
    # the patched file carries its own copy of the predicate: it must agree with ours
    install_doubles(monkeypatch)
    case = Case("table", 3, lambda: ValueError(message), None)
    status, _ = ask(patched(tmp_path), case)
    assert status == (400 if is_context_length_overflow(ValueError(message)) else 500)


def _spec_edit(old: str, new: str) -> Callable[[str], str]:
    def edit(text: str) -> str:
        assert text.count(old) == 1, f"the mutation's target moved: {old!r}"
        return text.replace(old, new)

    return edit


# name -> (a change to the spec's text, the rule NeMo-Gym applies)
MUTATIONS = {
    "clamp-keeps-max-model-len-wording": (
        _spec_edit(
            'f"This model\'s maximum context length is "\n'
            '    f"{self.model_config.max_model_len} tokens and the prompt "\n'
            '    f"alone has {len(prompt_token_ids)}: no room is left for output tokens."',
            'f"A {len(prompt_token_ids)}-token prompt leaves no output room under "\n'
            '    f"max_model_len {self.model_config.max_model_len}."',
        ),
        NEMO_GYM_LENGTH_RULE,
    ),
    "route-answers-500": (_spec_edit("status_code=400,", "status_code=500,"), NEMO_GYM_LENGTH_RULE),
    "route-except-narrowed": (
        _spec_edit("except ValueError as e:", "except UnicodeError as e:"),
        NEMO_GYM_LENGTH_RULE,
    ),
    "route-answers-every-value-error": (
        _spec_edit('    if "maximum context length" not in str(e):\n        raise\n', ""),
        NEMO_GYM_LENGTH_RULE,
    ),
    "route-checks-the-bare-marker": (
        _spec_edit('if "maximum context length" not in str(e):', 'if "context length" not in str(e):'),
        NEMO_GYM_LENGTH_RULE,
    ),
    "gym-looks-for-context-window": (
        lambda text: text,
        LengthRule(status_code=400, substrings=("context_window", "max_tokens")),
    ),
    "gym-wants-422": (
        lambda text: text,
        LengthRule(status_code=422, substrings=NEMO_GYM_LENGTH_RULE.substrings),
    ),
}


@pytest.mark.parametrize("name", MUTATIONS)
def test_contract_catches_mutation(tmp_path, monkeypatch, name):
    mutate, rule = MUTATIONS[name]
    install_doubles(monkeypatch)
    module = patched(tmp_path, spec_text=mutate(SPEC_FILE.read_text()))
    found = [v for case in OUR_ROUTE_CASES if (v := violation(module, case, rule)) is not None]
    assert found, f"mutation {name} broke the contract and no check noticed"
