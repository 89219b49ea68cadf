"""vLLM in process: `engine` loads a model folder into vLLM's `AsyncLLM` (or wraps an
`AsyncLLM` / offline `vllm.LLM`) behind tokentrail's Step stream; `batch` is the
server's continuous batch on it (`VLLMBatch`: every sequence a task on the engine's
loop, its outputs pushed as vLLM makes them).

The modules import vLLM only when used; nothing is imported here.
"""

__all__: list[str] = []  # the modules, not names, are the API here
