"""JSON logs carry the claim and operation on every line logged while a claim is being prepared."""

from __future__ import annotations

import io
import json
import logging

from driver import logs
from driver.config import Config


def test_context_tags_every_line_in_json(monkeypatch):
    stream = io.StringIO()
    monkeypatch.setattr(logs.sys, "stderr", stream)
    logs.setup(0, "json")
    log = logging.getLogger("driver.somewhere")
    with logs.log_context(claim="uid-1", op="prepare"):
        log.info("writing spec", extra={"device": "gpu-0"})
        with logs.log_context(op="nested"):
            log.warning("inner")
    log.info("outside")
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert lines[0]["claim"] == "uid-1" and lines[0]["op"] == "prepare" and lines[0]["device"] == "gpu-0"
    assert lines[1]["claim"] == "uid-1" and lines[1]["op"] == "nested"
    assert "claim" not in lines[2]
    logging.getLogger().handlers.clear()


def test_the_start_up_configuration_is_an_object_in_json_and_one_json_text_in_text(monkeypatch):
    """A log pipeline queries `configuration.node_name`; an escaped string inside `msg` it cannot."""
    config = Config(node_name="n1").as_log()
    for fmt in ("json", "text"):
        stream = io.StringIO()
        monkeypatch.setattr(logs.sys, "stderr", stream)
        logs.setup(0, fmt)
        logging.getLogger("driver.daemon").info("starting tandem pid=1", extra={logs.CONFIG_FIELD: config})
        line = stream.getvalue().strip()
        if fmt == "json":
            record = json.loads(line)
            assert record["msg"] == "starting tandem pid=1" and record["configuration"]["node_name"] == "n1"
        else:
            assert json.loads(line.split(", configuration ", 1)[1])["node_name"] == "n1"
        logging.getLogger().handlers.clear()
