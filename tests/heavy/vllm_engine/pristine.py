"""The pristine engine: the environment's own vLLM (no patched root on the path), the real
weights loaded, the suite's generations written as JSON.

    python -m tests.heavy.vllm_engine.pristine MODEL_DIR OUT_JSON

A script of its own because vLLM spawns its engine process (``if __name__ == "__main__"``) and
because the test process has imported the patched vLLM already.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(model_dir: str, out: str) -> None:
    import vllm.model_executor.layers.logits_processor as processor

    from tests.heavy.vllm_engine import harness

    if "fp32patch" in Path(processor.__file__).read_text():
        raise SystemExit(f"not the pristine vLLM: {processor.__file__} carries fp32patch's edits")
    from vllm import LLM

    llm = LLM(model=model_dir, worker_extension_cls=harness.EXTENSION, **harness.ENGINE_ARGS)
    wrong = llm.collective_rpc(harness.on_worker_gemms)
    if any(wrong):
        raise SystemExit(f"the plain GEMM plugin did not reach these layers: {wrong}")
    Path(out).write_text(json.dumps(harness.generate(llm)))
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
