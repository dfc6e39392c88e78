"""Reading a small settings file (JSON or TOML) whole, with one-line errors that name it.

Run folders, calibration profiles, sweep and regress files, GPU step rows and replay reports all
come through here, so a missing, binary or malformed file reads the same everywhere; a name ending
in `.gz` is read through gzip (the replay reports kept under benchmarks/results are). Errors are ValueError; callers
that speak ConfigError wrap the message.
"""

from __future__ import annotations

import gzip
import json
import zlib
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


def read_text(path: Path) -> str:
    """The file as UTF-8 text (gunzipped first where its name ends in `.gz`)."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e.strerror or e})") from None
    if path.suffix == ".gz":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:
            raise ValueError(f"{path}: not gzip data ({e})") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start})") from None


def read_json(path: Path) -> Any:
    """The file's JSON value."""
    try:
        return json.loads(read_text(path))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e.msg}, line {e.lineno})") from None


def read_toml(path: Path) -> dict[str, Any]:
    """The file's TOML tables."""
    try:
        return tomllib.loads(read_text(path))
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: not valid TOML ({e})") from None
