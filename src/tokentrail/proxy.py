"""Deprecated: use `tokentrail.server.proxy` (``tokentrail serve --upstream URL``)."""

from .server.proxy import add_arguments, check_arguments, create_upstream_app, load_tokenizer

__all__ = ["add_arguments", "check_arguments", "create_upstream_app", "load_tokenizer"]
