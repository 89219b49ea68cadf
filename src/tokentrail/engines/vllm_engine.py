"""The vLLM engine under its first name: `tokentrail.engines.vllm.engine`, re-exported.

`from tokentrail.engines.vllm_engine import load` keeps working; the engine lives in
the `tokentrail.engines.vllm` package (`engine`, and `batch`, the server's batch).
"""

from .vllm.engine import *  # noqa: F403
from .vllm.engine import __all__  # noqa: F401
