"""One output pipeline: what one sequence produces, token by token, for every entry point.

`record.TokenOutput` is the one typed record of one generated token and everything that
became final with it (text, its tokens, confidence, stop, channels, tool calls, fields);
`processor.OutputProcessor` makes it, in one fixed order (align, stops, EOS and limit,
reasoning channels, tool calls, JSON fields), on whichever thread feeds it.
`stream_generate`, the batch functions, the server's scheduler and the proxy all go
through it; `GenerationResponse` (mlx-lm's shape) is a view built from it and the
server's renderer writes it to the wire. It is the only type that crosses from the
model thread to the event loop.

The package imports nothing itself: import `tokentrail.output.record` or
`tokentrail.output.processor` (the record sits below `tokentrail.sequence`, the
processor above it).
"""

__all__: list[str] = []  # the modules, not names, are the API here
