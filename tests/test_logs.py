"""Log lines in the Go exporters' formats: logfmt and JSON, with nothing a terminal adds."""

from __future__ import annotations

import json
import logging

from colossalai_exporter.logs import JsonFormatter, LogfmtFormatter


def uvicorn_record() -> logging.LogRecord:
    # What uvicorn's server logs at start: the message plus a copy with ANSI colours in
    # ``color_message`` (extra=), meant for its own terminal formatter.
    record = logging.LogRecord("uvicorn.error", logging.INFO, __file__, 1,
                               "Started server process [%d]", (4242,), None)
    record.color_message = "Started server process [\x1b[36m%d\x1b[0m]"
    record.rank = 3  # an ordinary extra= field
    return record


def test_logfmt_lines_carry_no_terminal_colours() -> None:
    line = LogfmtFormatter().format(uvicorn_record())
    assert "\x1b" not in line and "color_message" not in line, line
    assert 'msg="Started server process [4242]"' in line
    assert "rank=3" in line and "level=info" in line and "logger=uvicorn.error" in line


def test_json_lines_carry_no_terminal_colours() -> None:
    fields = json.loads(JsonFormatter().format(uvicorn_record()))
    assert "color_message" not in fields
    assert fields["msg"] == "Started server process [4242]"
    assert fields["rank"] == 3
