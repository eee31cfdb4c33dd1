"""What `gpuload cache` prints of a cache folder's column sets (gpuload/tools/cache_text.py)."""

from gpuload.tools.cache_text import chunks_text, spec_text


def test_column_sets_show_each_members_fill_where_they_differ():
    def desc(fills):
        return [{"name": "x", "columns": ["a", "b"], "kind": "group", "dtype": "<f4", "width": 2, "sources": [],
                 "fills": fills}]

    assert spec_text(desc([0.0, None])) == "x=[a, b] (float32, nulls as a: 0.0, b: refused)"
    assert spec_text(desc([0.0, 7.0])) != spec_text(desc([7.0, 0.0]))
    assert spec_text(desc([7.0, 7.0])) == "x=[a, b] (float32, nulls as 7.0)"
    assert spec_text(desc([None, None])) == "x=[a, b] (float32)"


def test_chunk_counts_read_as_words():
    assert (chunks_text(0), chunks_text(1), chunks_text(3)) == ("0 chunks", "1 chunk", "3 chunks")
