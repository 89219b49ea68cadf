"""Any OpenAI-compatible server as an engine (`serve --upstream`): what it is sent
(`engine`, `constraints`, `chat`) and its stream read back into steps (`wire`, `stream`).

The modules import their runtime when imported; nothing is imported here.
"""

__all__: list[str] = []  # the modules, not names, are the API here
