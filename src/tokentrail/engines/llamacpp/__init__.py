"""llama.cpp through llama-cpp-python: one sequence (`engine`) or a continuous batch on
one unified KV cache (`batch`), with llama.cpp's samplers (`sampling`) and guides
(`guided`).

The modules import their runtime when imported; nothing is imported here.
"""

__all__: list[str] = []  # the modules, not names, are the API here
