"""Sleep mode on vLLM's CPU build: there is none, so no refit after sleep and wake is tested.

vLLM refuses ``enable_sleep_mode=True`` on the CPU platform when it builds the engine's config
(``Sleep mode is not supported on current platform.``), and the CPU worker's ``sleep`` and
``wake_up`` only log that they are ignored. Should a release grow one, this fails and the
refit after sleep and wake belongs in test_engine_on.py and test_engine_off.py.
"""

from __future__ import annotations

import pytest


def test_the_cpu_build_refuses_sleep_mode(model_dir):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    assert current_platform.is_cpu() and not current_platform.is_sleep_mode_available()
    with pytest.raises(ValueError, match="Sleep mode is not supported on current platform"):
        EngineArgs(model=str(model_dir), enable_sleep_mode=True, enforce_eager=True).create_engine_config()
