"""Reading a small settings file (JSON or TOML) whole, with one-line errors that name it.

Run folders, calibration profiles, sweep and regress files all come through here, so a
missing, binary or malformed file reads the same everywhere. Errors are ValueError; callers
that speak ConfigError wrap the message.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


def read_text(path: Path) -> str:
    """The file as UTF-8 text."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e.strerror or e})") from None
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
