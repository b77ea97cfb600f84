"""The stack kit: what every RL stack's glue is built from, and the contract a stack follows.

The kit (pure Python, no torch at import):

- ``kit.stack.Stack``: one stack in three declarative fields (its name, its logger, its key);
  ``Stack.guard`` runs the stack's rules as every patched guard runs them (the caller named in a
  refusal, the notes logged, the verdict kept for the probe), ``Stack.wire`` gives a trainer
  model fp32 logits through the Megatron or the PyTorch/HF head with a role label.
- ``kit.config``: reading configs (plain dicts from DictConfig/pydantic, sections, the trainer
  key's value with its hints, near-miss keys) and the measured case against one side alone.
- ``kit.rollout``: the rollout's switches: vLLM's variable under both names (read from a config's
  ``env_vars`` or the environment, set in a rollout process or in a Ray actor's ``runtime_env``),
  vLLM's own ``head_dtype`` (0.26+), SGLang's ``enable_fp32_lm_head``; the installed vLLM's release
  under any distribution name and the route it takes (``vllm_route``).
- ``kit.sglang``: SGLang as a rollout engine: its flag (``sglang_args``, re-exported by
  ``kit.rollout``), the guard's SGLang hazards (``check_server_args``, ``sglang_hazards``), and the
  probe of a server, an in-process ``Engine`` or tokenizer manager (its arguments read, the grade of
  its log-probs measured), held to the key by ``hold_server_reports``.
- ``kit.probe``: the startup probe's RPC name and verdicts: the workers' reports held to one
  expectation, one line per disagreeing worker, the refusal; for vLLM's own OpenAI server, the
  worker extension that answers the probe and the probe over HTTP (``/collective_rpc``).
- ``kit.fused``: the heads ``Stack.wire`` wired, found again from the weight a stack's fused
  log-prob path reads (``wired_mode(weight)``): such a path never calls the head, so the stack
  computes it with ``kernels.chunked_logprobs`` in that head's mode, and any other weight keeps
  the stack's own kernel.

What a stack provides (``fp32patch/runtime/<stack>/``, each file short; NeMo-RL, verl, TRL,
OpenRLHF, slime, Prime-RL and AReaL are the examples to copy; Prime-RL's heads are its own classes, so
it adds a ``head.py`` of fp32-grade forwards for them):

1. ``config.py``: ``STACK = Stack(...)``; its rules, ``validate_fp32_lm_head_config(config,
   **kw) -> Settings`` (a frozen dataclass with ``notes``): where its trainer switch lives and
   which trainers it wires (refuse the rest), what turns the rollout's switch on (``kit.rollout``),
   what one side alone means there, fused log-prob paths (fp32-grade through
   ``kernels.chunked_logprobs`` where ``kit.fused.wired_mode`` or the model's own head says the
   logits are fp32, or refused, never silently bf16); and ``check_config(config,
   where=...) = STACK.guard(rules, config, where=where)``.
2. ``wiring.py``: thin adapters, one per place the stack builds a trainer model
   (``STACK.wire(model, mode, trainer=..., role=...)``) or starts a rollout
   (``kit.rollout.set_vllm_env`` / ``head_dtype_overrides`` / ``kit.sglang.sglang_args``).
3. ``probe.py``: where the stack reaches its vLLM workers (``kit.probe.PROBE_RPC`` through its
   engine's ``collective_rpc``, or ``heads.vllm_probe.probe_vllm_model`` in process), then
   ``disagreeing_reports`` -> ``disagreement`` -> ``refuse``; its SGLang servers through
   ``kit.sglang.probe_servers`` / ``probe_engine`` / ``probe_tokenizer_manager``.
4. ``__init__.py``: the names its patched files call, and nothing else; those names never change
   (an image patched by an older fp32patch imports them).
5. Outside the runtime: a spec ``fp32patch/patches/<stack>-fp32-lm-head.toml`` whose edits call
   those names through a gate snippet (``patches/snippets/<stack>_gate.py``: the stock code runs,
   and fp32patch is never imported, unless the config asks); tests over the stack's real
   releases (apply, verify, exact revert) and a real training step with its real trainer.
"""
