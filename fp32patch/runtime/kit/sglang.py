"""SGLang as a rollout engine of the kit: its switch, the guard's hazards, the startup probe.

SGLang has its own fp32 LM head from 0.5.3: ``ServerArgs.enable_fp32_lm_head`` (the command
line's ``--enable-fp32-lm-head``; from 0.5.20 ``ServerArgs`` is a msgspec record and the field is
declared in its ``exec.features`` namespace, still a flat field of the record). What it does not
cover, read from every release's wheel (0.5.2 ... 0.5.23):

- a quantized LM head (``should_apply_lm_head_quant_method``, 0.5.15 on) and a LoRA-wrapped head
  (0.5.7 on) are computed before the flag is looked at: bf16 logits with the flag on;
- ``rl_on_policy_target`` (0.5.5 on; "fsdp") makes the sampler return log-probs of
  ``logits.bfloat16().div(temperature).bfloat16()``: fp32 logits, bf16 log-probs;
- model configs turn an fp32 head on without the flag (``enable_lm_head_fp32``,
  ``enable_lm_head_output_fp32``; read by the logits processor from 0.5.20, defaulting to true
  in some model families' configs), and DeepSeek-V4 DSpark reads ``SGLANG_DSPARK_FP32_LM_HEAD``
  (0.5.16 on): with the stack's key off, SGLang fp32 and the trainer bf16;
- releases before 0.5.3 have no flag.

``GET /server_info`` (``Engine.get_server_info()``, ``tokenizer_manager.server_args`` in process)
holds the flag and the other server arguments: what was asked, not what the head computes. The
probe therefore also measures: one short generation with the top log-probs of every prompt
position, and the grid their differences lie on. A log-prob is ``logit - logsumexp``, so within
one position the difference of two log-probs is the difference of two logits, up to the fp32
rounding of the log-probs; bf16 logits (8 significant bits) differ by multiples of a power of two
far above that rounding, fp32 logits do not. So the measurement reads log-probs and infers the
grade of the logits the sampler saw (after the head, soft-capping, scaling and
``rl_on_policy_target``'s bf16 rounding): a bf16 grid is proof of bf16 logits or log-probs; no grid
is fp32 logits, or a transform after the head that breaks the grid (a soft-capped head, a scale
that is not a power of two), which the probe cannot tell apart and says so.

Pure Python (torch is never imported); the errors are the kit's (``Fp32LmHeadConfigError`` before
anything starts, ``Fp32LmHeadMismatchError`` from the probe).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from fp32patch.runtime.errors import Fp32LmHeadConfigError
from fp32patch.runtime.kit.probe import disagreeing_reports, refuse

SGLANG_SWITCH = "enable_fp32_lm_head"
FIRST_RELEASE = (0, 5, 3)  # the first SGLang with enable_fp32_lm_head
FP32OUT_RELEASE = (0, 5, 18)  # SGLang's own head is fp32out (torch.mm(out_dtype=float32)) from here
# the model config's own switches that turn an fp32 head on without the flag (0.5.20 on)
MODEL_CONFIG_SWITCHES = ("enable_lm_head_fp32", "enable_lm_head_output_fp32")
# a model family's own environment variable (DeepSeek-V4 DSpark, 0.5.16 on)
MODEL_ENV_SWITCHES = ("SGLANG_DSPARK_FP32_LM_HEAD",)
# LoRA target names that SGLang maps onto the LM head (lora/utils.py)
LORA_HEAD_NAMES = ("lm_head", "output", "unembed_tokens")

# The probe's generation: a fixed prompt of token ids (any model's vocabulary holds them), one new
# token, the top log-probs of every position.
PROBE_INPUT_IDS = tuple(range(10, 42))
PROBE_TOP_LOGPROBS = 20


# ---------------------------------------------------------------- the switch and the release


def server_args_fields(server_args_cls: Any) -> frozenset[str]:
    """The field names of SGLang's ``ServerArgs`` class (a dataclass up to 0.5.19, a msgspec
    record from 0.5.20; any other class: its attributes)."""
    if dataclasses.is_dataclass(server_args_cls):
        return frozenset(f.name for f in dataclasses.fields(server_args_cls))
    fields = getattr(server_args_cls, "__struct_fields__", None)
    if fields is not None:
        return frozenset(fields)
    return frozenset(vars(server_args_cls))


def installed_sglang_version() -> tuple[int, ...] | None:
    """The installed ``sglang`` distribution's release as (major, minor, micro); None without one."""
    from importlib import metadata

    try:
        text = metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None
    return release_tuple(text)


def release_tuple(text: str) -> tuple[int, ...] | None:
    """``"0.5.15.post1"`` -> (0, 5, 15); None where ``text`` starts with no release."""
    found = re.match(r"\d+(\.\d+)*", str(text))
    return tuple(int(part) for part in found.group(0).split(".")[:3]) if found else None


def sglang_args(
    args: dict[str, Any],
    mode: str | None,
    server_args_cls: Any,
    *,
    key: str,
    where: str,
    logger: logging.Logger,
    model_config: Any = None,
    environ: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """SGLang's server arguments (the keyword arguments of ``ServerArgs(**args)``) with its own
    fp32 LM head on where the stack's key is on (``mode``), then held to ``check_server_args``.

    On: sets ``enable_fp32_lm_head`` True; refuses an SGLang whose ``server_args_cls`` has no such
    field (before 0.5.3) and an explicit other value. Off: refuses a true one. Either way the
    hazards of ``check_server_args`` are refused. Returns ``args`` (changed in place). Raises
    ``Fp32LmHeadConfigError`` (``fp32patch (where): ...``, naming the setting and what to do)."""
    asked = args.get(SGLANG_SWITCH)
    if mode is not None:
        if SGLANG_SWITCH not in server_args_fields(server_args_cls):
            raise Fp32LmHeadConfigError(
                f"fp32patch ({where}): {key} is {mode!r} but this SGLang's ServerArgs has no {SGLANG_SWITCH} "
                f"(SGLang 0.5.3 and later have it): the rollout's logits would stay bf16. Upgrade SGLang, or set "
                f"{key} to false"
            )
        if asked is not None and asked is not True:
            raise Fp32LmHeadConfigError(
                f"fp32patch ({where}): {key} is {mode!r} but SGLang's {SGLANG_SWITCH} is {asked!r}: the two "
                "disagree. Remove it from SGLang's arguments; the key turns it on"
            )
    final = {**args, SGLANG_SWITCH: True} if mode is not None else args
    notes = check_server_args(
        final, on=mode is not None, where=where, key=key, model_config=model_config, environ=environ
    )
    args.update(final)  # nothing changed where refused
    for note in notes:
        logger.warning("fp32patch (%s): %s", where, note)
    if mode is not None:
        logger.info("fp32patch (%s): SGLang's %s on (%s=%r)", where, SGLANG_SWITCH, key, mode)
    return args


def check_server_args(
    args: Any,
    *,
    on: bool,
    where: str,
    key: str,
    model_config: Any = None,
    environ: Mapping[str, str] | None = None,
) -> list[str]:
    """The guard's SGLang hazards, before anything starts.

    ``args``: SGLang's server arguments as they will start the server: the mapping handed to
    ``ServerArgs(**args)`` or a ``ServerArgs`` (any object with those attributes). ``on``: whether
    the stack's key asks for fp32 logits. ``model_config``: the model's config where the caller has
    it (an HF config, a mapping), for its own switches. ``environ``: the server's environment
    (default: this process's).

    Refused, in one ``Fp32LmHeadConfigError`` naming each setting and what to do:
    on: ``enable_fp32_lm_head`` not true; ``rl_on_policy_target`` set (bf16 log-probs); LoRA
    target modules that wrap the LM head. Off: ``enable_fp32_lm_head`` true; a model-config switch
    (``MODEL_CONFIG_SWITCHES``, in ``json_model_override_args`` or ``model_config``) or a model
    family's variable (``MODEL_ENV_SWITCHES``) on: SGLang fp32, the trainer bf16.

    Returns notes for what only the probe can settle (a quantization method or a GGUF model: a
    quantized LM head skips the flag; LoRA adapters: their own target modules may hold the head)."""
    problems, notes = sglang_hazards(args, on=on, key=key, model_config=model_config, environ=environ, where=where)
    if problems:
        lines = "\n".join(f"  {p}" for p in problems)
        raise Fp32LmHeadConfigError(f"fp32patch ({where}): SGLang's arguments do not follow {key}:\n{lines}")
    return notes


def sglang_hazards(
    args: Any,
    *,
    on: bool,
    key: str,
    model_config: Any = None,
    environ: Mapping[str, str] | None = None,
    where: str = "SGLang",
) -> tuple[list[str], list[str]]:
    """``check_server_args``'s findings without raising, for a stack's own guard to word: the
    problems (each a sentence naming the setting and what to do) and the notes. Raises only for
    a ``json_model_override_args`` that is not JSON."""
    environ = os.environ if environ is None else environ
    problems: list[str] = []
    notes: list[str] = []
    flag = _read(args, SGLANG_SWITCH)
    overrides = _json_overrides(_read(args, "json_model_override_args"), where)
    switched = [
        f"json_model_override_args {name}={overrides[name]!r}" for name in MODEL_CONFIG_SWITCHES if overrides.get(name)
    ]
    switched += [
        f"the model config's {name}=True" for name in MODEL_CONFIG_SWITCHES if _read(model_config, name) is True
    ]
    switched += [
        f"{name}={environ[name]!r} in the environment"
        for name in MODEL_ENV_SWITCHES
        if str(environ.get(name, "")).strip().lower() in ("1", "true", "yes", "on")
    ]
    if on:
        if flag is not True:
            problems.append(
                f"SGLang's {SGLANG_SWITCH} is {flag!r}: its LM head would give bf16 logits. Let {key} turn it on"
            )
        target = _read(args, "rl_on_policy_target")
        if target is not None:
            problems.append(
                f"SGLang's rl_on_policy_target={target!r}: its sampler rounds the logits to bf16 before the "
                "log-probs (logits.bfloat16().div(temperature).bfloat16()), so the rollout's log-probs stay bf16 "
                "with fp32 logits. Unset rl_on_policy_target"
            )
        modules = _names(_read(args, "lora_target_modules"))
        on_head = sorted(modules & set(LORA_HEAD_NAMES))
        if on_head:
            problems.append(
                f"SGLang's lora_target_modules holds {', '.join(on_head)}: a LoRA-wrapped LM head is computed by "
                "the LoRA layer before SGLang looks at its fp32 switch (bf16 logits). Leave the LM head out of "
                "lora_target_modules"
            )
        elif _read(args, "enable_lora") or _read(args, "lora_paths"):
            notes.append(
                "SGLang serves LoRA adapters: an adapter whose target modules hold the LM head gives bf16 logits "
                "(the probe measures the base model's)"
            )
        quantization = _read(args, "quantization")
        if quantization or str(_read(args, "load_format") or "").lower() == "gguf":
            notes.append(
                f"SGLang's quantization={quantization!r}: a quantized LM head is computed by its quantization method "
                "before SGLang looks at its fp32 switch; the startup probe measures what the head gives"
            )
    else:
        if flag is True:
            problems.append(
                f"{SGLANG_SWITCH} is on in SGLang's arguments but {key} is off: the rollout would compute fp32 "
                f"logits and "
                f"the trainer bf16 ones. Set {key} instead"
            )
        for what in switched:
            problems.append(
                f"{what} gives SGLang an fp32 LM head without {SGLANG_SWITCH}, but {key} is off: the trainer's "
                f"logits would stay bf16. Remove it, or turn {key} on"
            )
    return problems, notes


def _json_overrides(value: Any, where: str) -> dict[str, Any]:
    if value is None or value == "":
        return {}
    if isinstance(value, Mapping):
        return dict(value)
    try:
        parsed = json.loads(value)
    except (TypeError, ValueError) as exc:
        raise Fp32LmHeadConfigError(
            f"fp32patch ({where}): SGLang's json_model_override_args is not JSON ({exc}): {value!r}"
        ) from None
    return parsed if isinstance(parsed, dict) else {}


def _names(value: Any) -> set[str]:
    if value is None:
        return set()
    if isinstance(value, str):
        return {value}
    return {str(v) for v in value} if isinstance(value, Iterable) else set()


def _read(source: Any, name: str) -> Any:
    """``name`` from a mapping, an object's attribute, or a nested mapping of either (SGLang
    0.5.20+ serializes nested records); None where absent."""
    if source is None:
        return None
    if isinstance(source, Mapping):
        if name in source:
            return source[name]
        for value in source.values():
            if isinstance(value, Mapping):
                found = _read(value, name)
                if found is not None:
                    return found
        return None
    return getattr(source, name, None)


# ---------------------------------------------------------------- the probe


def probe_request(input_ids: Sequence[int] = PROBE_INPUT_IDS) -> dict[str, Any]:
    """The probe's generation, as SGLang's ``/generate``, ``Engine.generate`` and
    ``GenerateReqInput`` take it: ``input_ids``, one new token at temperature 1, the top
    ``PROBE_TOP_LOGPROBS`` log-probs of every prompt position and of the new token."""
    return {
        "input_ids": list(input_ids),
        "sampling_params": {"max_new_tokens": 1, "temperature": 1.0},
        "return_logprob": True,
        "top_logprobs_num": PROBE_TOP_LOGPROBS,
        "logprob_start_len": 0,
    }


def logprob_grade(rows: Iterable[Any]) -> tuple[str | None, str]:
    """The grade of the logits behind SGLang's top log-probs: ``rows`` is one list per position
    of ``(logprob, token_id, ...)`` entries (``meta_info["input_top_logprobs"]`` and
    ``["output_top_logprobs"]``; None rows and entries are skipped).

    Returns ``("bfloat16", evidence)`` where the differences of one position's log-probs lie on
    a power-of-two grid at least 16 times coarser than the log-probs' fp32 rounding (fp32 logits
    do so by chance with odds below 1e-17 per position); ``("float32", evidence)`` where no
    position shows a grid; ``(None, why)`` without evidence (fewer than 8 distinct differences in
    every position, as with a constant head)."""
    grid = plain = 0
    coarsest = 0.0
    for row in rows:
        values = _row_values(row)
        found = _grid(values)
        if found is None:
            continue
        if found > 0:
            grid += 1
            coarsest = max(coarsest, found)
        else:
            plain += 1
    if grid + plain == 0:
        return None, "its log-probs hold too few distinct values to tell the logits' grade"
    if grid and grid * 4 >= grid + plain:
        return "bfloat16", (
            f"in {grid} of {grid + plain} positions the log-probs differ by multiples of 2^{int(math.log2(coarsest))} "
            "(bf16's grid)"
        )
    return "float32", f"in {plain} of {grid + plain} positions the log-probs lie on no bf16 grid"


def _row_values(row: Any) -> list[float]:
    values = []
    for entry in row or ():
        value = entry[0] if isinstance(entry, (list, tuple)) else entry
        if isinstance(value, (int, float)) and math.isfinite(value):
            values.append(float(value))
    return values


def _grid(values: list[float]) -> float | None:
    """The coarsest power of two that every difference from the first value is a multiple of
    (within the values' fp32 rounding), 0.0 where none is 16x above that rounding; None where the
    row is no evidence."""
    if len(values) < 9:
        return None
    base = values[0]
    diffs = [v - base for v in values[1:]]
    if len({d for d in diffs if d != 0.0}) < 8:
        return None
    scale = max(1.0, max(abs(v) for v in values))
    tol = 4 * 2.0 ** (math.floor(math.log2(scale)) - 23) + 2.0**-21
    if max(abs(d) for d in diffs) < 2**12 * tol:
        return None  # logits too close together (a dummy-initialized model): no grid could show
    for k in range(0, 40):
        q = 2.0**-k
        if q < 16 * tol:
            return 0.0
        if all(abs(d - round(d / q) * q) <= tol for d in diffs):
            return q
    return 0.0


def server_report(
    server_args: Any, output: Mapping[str, Any] | None, *, server: str, version: Any = None
) -> dict[str, Any]:
    """One server's probe report from what it said: ``server_args`` (its ``/server_info`` or
    ``get_server_info()`` mapping, or a ``ServerArgs``); ``output`` (its answer to
    ``probe_request()``, None where it was not asked); ``server`` (how messages name it).

    Keys: ``server``, ``version``; read: ``flag`` (``enable_fp32_lm_head``),
    ``rl_on_policy_target``, ``lora`` (LoRA target modules or paths), ``quantization``,
    ``model_switches`` (``MODEL_CONFIG_SWITCHES`` on in ``json_model_override_args``);
    measured: ``measured`` (``logprob_grade``'s grade or None) and ``evidence``; and the verdict
    ``dtype``: "bfloat16" where the measurement found bf16's grid or nothing read turns fp32 on,
    "float32" where something read does and the measurement does not contradict it (the
    log-probs then follow the head unless ``rl_on_policy_target`` rounds them: "bfloat16"), with
    ``reason`` saying why."""
    flag = _read(server_args, SGLANG_SWITCH)
    target = _read(server_args, "rl_on_policy_target")
    overrides = _json_overrides(_read(server_args, "json_model_override_args"), server)
    switches = [name for name in MODEL_CONFIG_SWITCHES if overrides.get(name)]
    modules = _names(_read(server_args, "lora_target_modules"))
    lora = sorted(modules) or (_read(server_args, "lora_paths") or None)
    quantization = _read(server_args, "quantization")
    if version is None:
        version = _read(server_args, "version")
    measured, evidence = (None, "not measured") if output is None else logprob_grade(_rows(output))
    asks = flag is True or bool(switches)
    if measured == "bfloat16":
        dtype = "bfloat16"
        causes = []
        if target is not None:
            causes.append(f"rl_on_policy_target={target!r} rounds the logits to bf16 before the log-probs")
        if set(modules) & set(LORA_HEAD_NAMES) or lora:
            causes.append(f"a LoRA-wrapped LM head (LoRA: {lora!r})")
        if quantization:
            causes.append(f"a quantized LM head (quantization={quantization!r})")
        if asks and not causes:
            causes.append("a quantized or LoRA-wrapped LM head, or a model whose head SGLang's flag does not reach")
        reason = evidence + (f": {'; '.join(causes)}" if causes and asks else "")
    elif not asks:
        dtype, reason = "bfloat16", f"{SGLANG_SWITCH} is {flag!r} and no model switch is on; {evidence}"
        if measured == "float32":
            reason += (
                " (fp32 logits from a model config's own switch, or a soft-capped or scaled head: the probe "
                "cannot tell them apart)"
            )
    elif target is not None:
        dtype = "bfloat16"
        reason = f"rl_on_policy_target={target!r}: its sampler rounds the logits to bf16 before the log-probs"
    else:
        dtype = "float32"
        on = f"{SGLANG_SWITCH}=True" if flag is True else ", ".join(switches)
        reason = f"{on}; {evidence}"
    return {
        "server": server,
        "version": version,
        "flag": flag,
        "rl_on_policy_target": target,
        "lora": lora,
        "quantization": quantization,
        "model_switches": switches,
        "measured": measured,
        "evidence": evidence,
        "dtype": dtype,
        "reason": reason,
    }


def _rows(output: Any) -> list[Any]:
    if isinstance(output, (list, tuple)):  # a batch answer
        return [row for item in output for row in _rows(item)]
    meta = output.get("meta_info", output) if isinstance(output, Mapping) else {}
    return [*(meta.get("input_top_logprobs") or ()), *(meta.get("output_top_logprobs") or ())]


def hold_server_reports(
    reports: Sequence[Mapping[str, Any]], mode: str | None, *, where: str, key: str, logger: logging.Logger
) -> list[Mapping[str, Any]]:
    """Hold SGLang servers' reports (``server_report``) to the key: every one "float32" where it is
    on (``mode``), none where it is off; else ``Fp32LmHeadMismatchError`` with one line per server
    naming it, what it computes and why (``kit.probe.refuse``). Logs one line when all agree;
    returns ``reports``."""
    expect = mode is not None

    def why(index: int, report: Mapping[str, Any]) -> str:
        asking = f"{key}={mode!r}" if expect else f"{key} is off"
        version = f", SGLang {report.get('version')}" if report.get("version") else ""
        return (
            f"SGLang server {report.get('server', index)}{version} computes {report.get('dtype')} log-probs "
            f"while {asking}: {report.get('reason')}"
        )

    _, bad = disagreeing_reports(list(reports), expect, why, where=where)
    if bad:
        refuse(
            bad,
            header=f"fp32patch ({where}): the SGLang rollout's log-probs do not follow {key}={mode!r}:",
            footer=(
                "The trainer and the rollout would compute different logits. Fix the server(s) above "
                f"({'SGLang' + chr(39) + 's ' + SGLANG_SWITCH + ' from ' + key if expect else 'unset what turns fp32 on'})."
            ),
        )
    for report in reports:
        if not expect and report.get("measured") == "float32":
            logger.warning(
                "fp32patch (%s): SGLang server %s reads as stock but %s: fp32 logits from the model's own "
                "config, or a soft-capped or scaled head; if the model turns an fp32 head on itself, turn %s on",
                where,
                report.get("server"),
                report.get("evidence"),
                key,
            )
    logger.info(
        "fp32patch (%s): %d SGLang server(s) compute %s logits, as %s=%r asks (%s)",
        where,
        len(reports),
        "float32" if expect else "stock",
        key,
        mode,
        "; ".join(f"{r.get('server')}: {r.get('evidence')}" for r in reports),
    )
    return list(reports)


def probe_servers(
    urls: Sequence[str],
    mode: str | None,
    *,
    get: Callable[..., Any],
    post: Callable[..., Any],
    where: str,
    key: str,
    logger: logging.Logger,
) -> list[Mapping[str, Any]]:
    """The startup probe of running SGLang HTTP servers (``urls``: their base URLs): for each,
    ``GET /server_info`` (``/get_server_info`` before it existed) and ``POST /generate`` with
    ``probe_request()``, through the caller's HTTP client (``get(url, timeout=...)``,
    ``post(url, json=..., timeout=...)``, e.g. a ``requests.Session``'s), then
    ``hold_server_reports``. A server that cannot answer is refused (``Fp32LmHeadMismatchError``)
    naming it: nobody could tell what it computes. Returns the reports."""
    from fp32patch.runtime.errors import Fp32LmHeadMismatchError

    reports = []
    for url in urls:
        base = url.rstrip("/")
        try:
            info = _json_of(get(f"{base}/server_info", timeout=_TIMEOUT_S))
            if info is None:
                info = _json_of(get(f"{base}/get_server_info", timeout=_TIMEOUT_S))
            if info is None:
                raise ValueError("neither /server_info nor /get_server_info answered 200")
            output = _json_of(post(f"{base}/generate", json=probe_request(), timeout=_TIMEOUT_S))
            if output is None:
                raise ValueError("/generate did not answer 200")
        except Exception as exc:  # the client's own error type, whatever it is
            raise Fp32LmHeadMismatchError(
                f"fp32patch ({where}): cannot probe the SGLang server at {base}: {type(exc).__name__}: {exc}. "
                f"{key} asks for fp32 logits and nobody could tell what that server computes",
                [],
            ) from None
        reports.append(server_report(info, output, server=base))
    return hold_server_reports(reports, mode, where=where, key=key, logger=logger)


def _json_of(response: Any) -> Any:
    if getattr(response, "status_code", 200) != 200:
        return None
    return response.json()


def probe_engine(
    engine: Any, mode: str | None, *, where: str, key: str, logger: logging.Logger, name: str = "in-process Engine"
) -> Mapping[str, Any]:
    """The startup probe of an in-process ``sglang.Engine``: ``engine.get_server_info()`` and
    ``engine.generate(**probe_request())``, then ``hold_server_reports`` (``name`` names it).
    Returns its report."""
    info = engine.get_server_info()
    output = engine.generate(**probe_request())
    report = server_report(info, output, server=name)
    hold_server_reports([report], mode, where=where, key=key, logger=logger)
    return report


async def probe_tokenizer_manager(
    tokenizer_manager: Any,
    mode: str | None,
    *,
    where: str,
    key: str,
    logger: logging.Logger,
    name: str | None = None,
) -> Mapping[str, Any]:
    """The startup probe of an SGLang server whose ``TokenizerManager`` lives in this process (verl's
    ``SGLangHttpServer``): its ``server_args``, one ``GenerateReqInput(**probe_request())`` through
    ``generate_request``, then ``hold_server_reports`` (``name`` names it; default: its host:port).
    Returns its report."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    request = GenerateReqInput(**probe_request())
    stream = tokenizer_manager.generate_request(request, None)
    output = await stream.__anext__()
    closing = getattr(stream, "aclose", None)
    if closing is not None:
        result = closing()
        if inspect.isawaitable(result):
            await result
    version = _sglang_version_text()
    args = tokenizer_manager.server_args
    if name is None:
        name = f"{_read(args, 'host')}:{_read(args, 'port')}"
    report = server_report(args, output, server=name, version=version)
    hold_server_reports([report], mode, where=where, key=key, logger=logger)
    return report


def _sglang_version_text() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


# how long one server may take to answer each of the probe's two requests
_TIMEOUT_S = 120
