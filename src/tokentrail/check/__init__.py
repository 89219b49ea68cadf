"""`tokentrail check URL`: a conformance and capability report for any OpenAI-compatible
server.

`prompts` (the fixed probes), `probe` (`Checker`: HTTP with httpx), `contract` (the
pure checks on recorded chunks), `capabilities`, `report` (`Report`: a rich table or
JSON) and `cli` (the command). Only the CLI and `tokentrail.server.proxy` (the startup
check of ``serve --upstream``) import this package.
"""

from __future__ import annotations

from .cli import register
from .contract import CHECKS, Finding, Stream, read_stream, read_whole
from .probe import Checker
from .report import CAPABILITIES, Capability, Report

__all__ = [
    "CAPABILITIES",
    "CHECKS",
    "Capability",
    "Checker",
    "Finding",
    "Report",
    "Stream",
    "read_stream",
    "read_whole",
    "register",
]
