"""What every benchmark suite shares: naming the machine and writing results."""

from __future__ import annotations

import json
import os
import platform
import socket
import time

from hpcpipe.util.files import write_text_atomic


def machine_name() -> str:
    return f"{socket.gethostname()}-{platform.machine()}"


def write_json(path: str, result: dict) -> str:
    """Write `result` (adding when and where it was measured) as indented JSON."""
    result = {"machine": machine_name(), "date": time.strftime("%Y-%m-%d"), **result}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return write_text_atomic(path, json.dumps(result, indent=2))


def schedule_label(row: dict) -> str:
    """A bench pipeline row's schedule, saying when auto took a V (rows recorded before
    auto could lack "chunks"): for its printed table and the report's."""
    return f"{row['schedule']} (a V)" if row["schedule"] == "auto" and \
        row.get("chunks", 1) == 2 else row["schedule"]
