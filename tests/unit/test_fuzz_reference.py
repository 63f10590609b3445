"""Hypothesis: embedding references. Any bytes, and any edit of a real reference's fields, are
parsed and verified to our INVALID_ARG / NOT_FOUND -- or, when what is left still names a stored
entry exactly, read that entry's own bytes and nothing else: no input reads outside its entry."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from python_backends.errors import EpdError, ErrorCode
from python_backends.store import EmbeddingStore, EntryMeta, StoreConfig, content_key, parse_reference
from tests.unit.fuzz_settings import FUZZ

CODES = (ErrorCode.INVALID_ARG, ErrorCode.NOT_FOUND)
SHAPES = [(4, 8), (16, 8), (1, 8), (64, 8)]  # placeholder rows x hidden; grids below match merge 2
GRIDS = [(1, 4, 4), (1, 8, 8), (1, 2, 2), (1, 16, 16)]


@pytest.fixture(scope="module")
def stored() -> Iterator[tuple[EmbeddingStore, list[tuple[bytes, np.ndarray]]]]:
    """A store with a few entries of different sizes side by side, and their references."""
    path = tempfile.mkdtemp(prefix="epd-fuzz-reference-")
    store = EmbeddingStore(StoreConfig(path=path, capacity_bytes=1 << 20, merge_size=2))
    entries = []
    for i, (shape, grid) in enumerate(zip(SHAPES, GRIDS, strict=True)):
        array = np.arange(np.prod(shape), dtype=np.float32).reshape(shape) + 1000 * i
        ref = store.put(content_key(bytes([i + 1]) * 8, {}, "v1"), array, EntryMeta(grid_thw=grid), lease=False)
        entries.append((ref.to_bytes(), array))
    yield store, entries
    store.close()
    shutil.rmtree(path, ignore_errors=True)


VALUES = (
    st.none()
    | st.booleans()
    | st.integers(-(2**64), 2**64)
    | st.floats()
    | st.text(max_size=70)
    | st.lists(st.integers(-5, 70000), max_size=5)
)


@st.composite
def edited(draw: st.DrawFn, entries: list[tuple[bytes, np.ndarray]]) -> tuple[bytes, int]:
    """A real reference with fields replaced, copied from another entry's, removed or added."""
    index = draw(st.integers(0, len(entries) - 1))
    fields = json.loads(entries[index][0])
    for _ in range(draw(st.integers(1, 3))):
        name = draw(st.sampled_from(sorted(fields) + ["extra"]))
        action = draw(st.sampled_from(["replace", "borrow", "drop"]))
        if action == "drop":
            fields.pop(name, None)
        elif action == "borrow" and name != "extra":
            fields[name] = json.loads(entries[draw(st.integers(0, len(entries) - 1))][0])[name]
        else:
            fields[name] = draw(VALUES)
    return json.dumps(fields, separators=(",", ":"), sort_keys=True).encode(), index


def _read(store: EmbeddingStore, raw: bytes) -> np.ndarray | None:
    try:
        return store.resolve(raw)
    except EpdError as exc:
        assert exc.code in CODES and exc.message
        return None


@FUZZ
@given(st.binary(max_size=1100) | st.text(max_size=300).map(str.encode))
def test_any_bytes_are_refused_with_a_coded_error(stored, raw):
    store, _ = stored
    with pytest.raises(EpdError) as info:
        parse_reference(raw, merge_size=2)
    assert info.value.code is ErrorCode.INVALID_ARG
    assert _read(store, raw) is None


@FUZZ
@given(st.data())
def test_an_edited_reference_reads_nothing_or_exactly_its_own_entry(stored, data):
    store, entries = stored
    raw, _ = data.draw(edited(entries))
    array = _read(store, raw)
    if array is not None:  # every signed field survived the edit: it still names one stored entry
        assert any(array.shape == own.shape and np.array_equal(array, own) for _, own in entries)


def test_unedited_references_read_their_entries(stored):
    store, entries = stored
    for raw, array in entries:
        assert np.array_equal(store.resolve(raw), array)
