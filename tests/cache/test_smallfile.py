"""Small checked files: what is written reads back whole; any damage is a ValueError naming it."""

from __future__ import annotations

import pytest

from gpuload.cache.fs import CacheRoot
from gpuload.cache.smallfile import SMALL_PREFIX, read_small_file, write_small_file

MAGIC = b"GPULTEST"


def _read(root, name="f", **kw):
    args = dict(magic=MAGIC, version=2, what="test", limit=1 << 20) | kw
    return read_small_file(root, ("d",), name, args["magic"], args["version"], args["what"], args["limit"])


def test_header_and_payload_read_back(tmp_path):
    root = CacheRoot(tmp_path)
    write_small_file(root, ("d",), "f", MAGIC, 2, b'{"a":1}', b"\x00payload")
    assert _read(root) == (7, b'{"a":1}\x00payload')
    write_small_file(root, ("d",), "g", MAGIC, 2, b"{}")  # no payload
    assert _read(root, "g") == (2, b"{}")
    assert (tmp_path / "d" / "f").stat().st_size == SMALL_PREFIX.size + 15


@pytest.mark.parametrize("damage, expect", [
    (lambda b: b[:10], "too short for a test file"),
    (lambda b: b"GPULOTHR" + b[8:], "not a gpuload test file of this version"),
    (lambda b: b[:8] + (3).to_bytes(4, "little") + b[12:], "not a gpuload test file of this version"),
    (lambda b: b[:12] + (99).to_bytes(4, "little") + b[16:], "not a gpuload test file of this version"),
    (lambda b: b[:-1] + bytes([b[-1] ^ 1]), "checksum mismatch"),
    (lambda b: b + b"x", "checksum mismatch"),
])
def test_damage_is_named(tmp_path, damage, expect):
    root = CacheRoot(tmp_path)
    write_small_file(root, ("d",), "f", MAGIC, 2, b'{"a":1}', b"payload")
    path = tmp_path / "d" / "f"
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(ValueError, match=expect):
        _read(root)


def test_a_file_over_the_limit_is_not_read(tmp_path):
    root = CacheRoot(tmp_path)
    write_small_file(root, ("d",), "f", MAGIC, 2, b"{}", bytes(1000))
    with pytest.raises(ValueError, match="too large for a footer file"):
        _read(root, what="footer", limit=500)
    with pytest.raises(FileNotFoundError):
        _read(root, "absent")


def test_json_files_read_back_checked(tmp_path):
    from gpuload.cache.smallfile import read_json_file, write_json_file

    root = CacheRoot(tmp_path)

    def check(h):
        if h["n"] < 0:
            raise ValueError("n is negative")

    write_json_file(root, ("d",), "j", MAGIC, 2, {"n": 3, "s": "é"})
    assert read_json_file(root, ("d",), "j", MAGIC, 2, "test", 1 << 20, check) == {"n": 3, "s": "é"}
    write_json_file(root, ("d",), "j", MAGIC, 2, {"n": -1})
    with pytest.raises(ValueError, match=r"malformed \(ValueError: n is negative\)"):
        read_json_file(root, ("d",), "j", MAGIC, 2, "test", 1 << 20, check)
    write_json_file(root, ("d",), "j", MAGIC, 2, {})
    with pytest.raises(ValueError, match=r"malformed \(KeyError: 'n'\)"):
        read_json_file(root, ("d",), "j", MAGIC, 2, "test", 1 << 20, check)
    write_small_file(root, ("d",), "p", MAGIC, 2, b'{"n": 1}', b"payload")  # a file with a payload is another kind
    with pytest.raises(ValueError, match="not a gpuload test file of this version"):
        read_json_file(root, ("d",), "p", MAGIC, 2, "test", 1 << 20, check)
