"""What the host cannot see from outside: the console scripts of the distribution installed from this clone
(pyproject, setup.cfg or setup.py alike), and whether the package imports at all."""

from __future__ import annotations

import importlib
import json
import os
from importlib import metadata

from .prelude import emit


def check(package):
    here = os.path.realpath(os.getcwd())
    scripts = {}
    for dist in metadata.distributions():
        try:
            url = json.loads(dist.read_text("direct_url.json") or "{}").get("url", "")
        except ValueError:
            continue
        if url.startswith("file://") and os.path.realpath(url[7:]) == here:
            scripts = {ep.name: ep.value for ep in dist.entry_points if ep.group == "console_scripts"}
            break
    try:
        importlib.import_module(package) if package else None
        error = None
    except BaseException as e:  # noqa: BLE001 - whatever the import raises is the answer
        error = repr(e)[:300]
    emit({"scripts": scripts, "import_error": error})
    return 0
