"""Column-set descriptions kept for `gpuload cache info` / `verify` (gpuload/cache/specs.py)."""

from __future__ import annotations

from gpuload.cache.admin import specs
from gpuload.cache.specs import record_spec, spec_problem
from gpuload.cache.chunkfile import spec_hash
from gpuload.cache.fs import CacheRoot
from gpuload.cache.paths import LAYOUT_DIR


def _wide(columns: int) -> list[dict]:
    """A description of ``columns`` float32 outputs, as a dataset of that many columns records it."""
    return [{"name": f"feature_{i:05d}", "columns": [f"feature_{i:05d}"], "kind": "scalar", "dtype": "<f4",
             "width": 1, "sources": [["<f4", ""]], "fills": [None]} for i in range(columns)]


def test_a_wide_column_sets_description_is_kept_whole(tmp_path):
    """7,000 columns describe themselves in more than a MiB: verify once called that corrupt, --delete removed
    it, and every opening wrote it again."""
    root = CacheRoot(tmp_path)
    desc = _wide(7000)
    key = spec_hash(desc)
    record_spec(root, key, desc)
    path = tmp_path / LAYOUT_DIR / "specs" / f"{key}.json"
    assert path.stat().st_size > 1 << 20
    assert spec_problem(root, path.name) is None
    assert specs(root)[key]["desc"] == desc
    before = path.stat().st_ino
    record_spec(root, key, desc)  # in use again: the same file, its mtime touched, not written anew
    assert path.stat().st_ino == before


def test_a_description_of_another_column_set_is_a_problem(tmp_path):
    root = CacheRoot(tmp_path)
    record_spec(root, spec_hash(_wide(3)), _wide(3))
    (path,) = (tmp_path / LAYOUT_DIR / "specs").glob("*.json")
    path.write_text(path.read_text().replace("feature_00002", "feature_00009"))
    assert spec_problem(root, path.name).startswith("describes column set ")
