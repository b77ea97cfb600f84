"""A pytest plugin for TRL's own tests (test_trl_own_tests.py): GRPO's and RLOO's configs with
``fp32_lm_head="fp32out"`` where the test leaves it unset, as if every test had written it.
Loaded with ``-p tests.heavy.trl.switch_on`` by a run of the patched tree only."""

from __future__ import annotations


def pytest_configure(config):
    from trl import GRPOConfig, RLOOConfig

    for cls in (GRPOConfig, RLOOConfig):
        post_init = cls.__post_init__

        def switched_on(self, post_init=post_init):
            if getattr(self, "fp32_lm_head", None) is None:
                self.fp32_lm_head = "fp32out"
            post_init(self)

        cls.__post_init__ = switched_on
