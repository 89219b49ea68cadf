"""MLX: mlx-lm's step functions (`steps`) and `BatchGenerator` (`batch`), with
tokentrail's samplers (`sampling`) and guides (`guided`); `engine` loads and wraps models.

The modules import their runtime when imported; nothing is imported here.
"""

__all__: list[str] = []  # the modules, not names, are the API here
