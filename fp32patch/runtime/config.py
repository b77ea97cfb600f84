"""``fp32patch.runtime.config``: the import path the README has documented for NeMo-RL's config
guard, kept for callers that use it. The guard lives in ``fp32patch.runtime.nemo_rl.config``."""

from fp32patch.runtime.errors import Fp32LmHeadConfigError
from fp32patch.runtime.nemo_rl.config import Fp32LmHeadSettings, validate_fp32_lm_head_config

__all__ = ["Fp32LmHeadConfigError", "Fp32LmHeadSettings", "validate_fp32_lm_head_config"]
