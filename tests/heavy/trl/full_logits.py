"""TRL before 1.15 (full logits through the head module), patched, in a process of its own:

    python -m tests.heavy.trl.full_logits MODEL_DIR OUT_JSON

With that release first on ``PYTHONPATH``: GRPO with the switch on and ``use_vllm`` off, its
policy's and reference model's heads converted by fp32patch's HF head, their logits under bf16
autocast against float64 of the bf16 operands; ``use_liger_kernel`` with the switch refused.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(model_dir: str, out: str) -> None:
    import torch
    import trl
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from fp32patch.runtime.errors import Fp32LmHeadConfigError
    from fp32patch.runtime.heads.hf import fp32_lm_head_mode
    from tests.heavy.trl.grpo_run import PROMPTS, reward_length

    def trainer(**overrides):
        config = GRPOConfig(output_dir="unused", use_cpu=True, report_to="none", gradient_checkpointing=False,
                            per_device_train_batch_size=4, num_generations=4, max_completion_length=8, beta=0.04,
                            use_vllm=False, **overrides)  # fmt: skip
        data = Dataset.from_dict({"prompt": PROMPTS})
        return GRPOTrainer(model=model_dir, reward_funcs=reward_length, args=config, train_dataset=data)

    wired = trainer(fp32_lm_head="fp32out")
    ids = torch.tensor([[11, 42, 7, 300, 12, 99, 5, 250, 17, 8]])
    errors, dtypes = [], []
    for model in (wired.model, wired.ref_model):
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
            outputs = model(input_ids=ids, output_hidden_states=True)
        hidden = outputs.hidden_states[-1].bfloat16().double()
        want = hidden @ model.get_output_embeddings().weight.detach().bfloat16().double().T
        dtypes.append(str(outputs.logits.dtype))
        errors.append(((outputs.logits.double() - want).abs().max() / want.abs().max()).item())
    try:
        trainer(fp32_lm_head="fp32out", use_liger_kernel=True)
        liger = None
    except Fp32LmHeadConfigError as exc:
        liger = str(exc)
    Path(out).write_text(
        json.dumps(
            {
                "trl": trl.__version__,
                "trl_file": trl.__file__,
                "modes": [fp32_lm_head_mode(m) for m in (wired.model, wired.ref_model)],
                "marks": [getattr(m, "_fp32patch_lm_head", None) for m in (wired.model, wired.ref_model)],
                "logits_dtypes": dtypes,
                "relative_errors": errors,
                "liger": liger,
            }
        )
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
