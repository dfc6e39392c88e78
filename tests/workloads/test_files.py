"""workloads.files: every settings file (run folder JSON, calibration, sweep and regress TOML)
fails with the same one-line messages, naming the file."""

import gzip
from pathlib import Path

import pytest

from kvsim.workloads.files import read_json, read_toml


def test_good_files(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text('{"x": 1}')
    (tmp_path / "a.toml").write_text("[base]\nx = 1\n")
    (tmp_path / "a.json.gz").write_bytes(gzip.compress(b'{"x": [1, 2]}'))
    assert read_json(tmp_path / "a.json") == {"x": 1}
    assert read_toml(tmp_path / "a.toml") == {"base": {"x": 1}}
    assert read_json(tmp_path / "a.json.gz") == {"x": [1, 2]}


@pytest.mark.parametrize(("name", "content", "message"), [
    ("missing.json", None, "cannot read (No such file or directory)"),
    ("bin.json", b"{\xff}", "not UTF-8 text (byte 0xff at offset 1)"),
    ("bad.json", b"{x", "not JSON (Expecting property name enclosed in double quotes, line 1)"),
    ("plain.json.gz", b'{"x": 1}', "not gzip data (Not a gzipped file (b'{\"'))"),
    ("cut.json.gz", gzip.compress(b'{"x": 1}', mtime=0)[:-6], "not gzip data (Compressed file ended before the end-of-stream marker was reached)"),
    ("bad.json.gz", gzip.compress(b"{x", mtime=0), "not JSON (Expecting property name enclosed in double quotes, line 1)"),
])
def test_bad_json(tmp_path: Path, name: str, content: bytes | None, message: str) -> None:
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ValueError) as info:
        read_json(path)
    assert str(info.value) == f"{path}: {message}"


def test_bad_toml_and_a_folder(tmp_path: Path) -> None:
    (tmp_path / "bad.toml").write_text("[base\n")
    with pytest.raises(ValueError) as info:
        read_toml(tmp_path / "bad.toml")
    assert str(info.value).startswith(f"{tmp_path / 'bad.toml'}: not valid TOML (")
    with pytest.raises(ValueError) as info:
        read_json(tmp_path)
    assert str(info.value) == f"{tmp_path}: cannot read (Is a directory)"
