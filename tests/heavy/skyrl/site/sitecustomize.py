"""On the SkyRL suite's PYTHONPATH: every process of a run (vLLM's engine core and workers, which
import SkyRL's worker extension, included) runs SkyRL 0.4.0 on Python 3.11 (``py311.py``)."""

from tests.heavy.skyrl.py311 import allow_skyrl

allow_skyrl()
