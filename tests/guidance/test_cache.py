"""GuidanceCache: bit-exact round trips through host memory and tensorstore spills, the byte
budget, and the errors that keep a record from being used for another version or sample."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax import fp4
from trace_jax.guidance import (
    FORMAT_VERSION,
    CorruptSpillError,
    GuidanceCache,
    GuidanceCacheError,
    GuidanceNotFoundError,
    GuidanceVersionError,
    SpillFormatError,
    split_records,
    stack_records,
)
from trace_jax.guidance import cache as cache_module

FMTS = ["nvfp4", "mxfp4"]
FIELDS = {
    fp4.Guidance: ("mantissa_bits", "block_scales", "global_scale"),
    fp4.QTensor: ("codes", "block_scales", "global_scale"),
}


def inputs(seed: int, b: int, t: int) -> dict[str, np.ndarray]:
    """Site inputs [B, T, ...] with magnitudes spread over several octaves (varied scales)."""
    rng = np.random.default_rng(seed)

    def draw(*shape):
        return (rng.standard_normal(shape) * np.exp(rng.uniform(-4, 4, (*shape[:-1], 1)))).astype(
            np.float32
        )

    return {
        "layers.2.experts.gate_up.act": draw(b, t, 64),
        "layers.2.experts.down.act": draw(b, t, 2, 32),
        "layers.2.kv.k": draw(b, t, 2, 32),
    }


def rollout_batch(fmt: str, seed: int = 0, b: int = 3, t: int = 5) -> dict:
    """A batched record [B, T, ...] as the rollout engine returns it (jax arrays), including a
    diagnostic ``.codes`` QTensor."""
    mode = "row" if fmt == "nvfp4" else "tensor"
    out = {}
    for name, x in inputs(seed, b, t).items():
        qt = fp4.quantize(jnp.asarray(x), fmt, global_scale=mode)
        out[name] = fp4.rollout_guidance(qt)
        if name.endswith("kv.k"):
            out[name + ".codes"] = qt
    return out


def assert_records_equal(got: dict, want: dict) -> None:
    """Same sites, types, static fields, and every array bitwise equal with the same dtype."""
    assert sorted(got) == sorted(want)
    for name in want:
        g, w = got[name], want[name]
        assert type(g) is type(w), name
        assert (g.fmt, tuple(g.shape), g.axis) == (w.fmt, tuple(w.shape), w.axis), name
        for f in FIELDS[type(w)]:
            a, b = np.asarray(getattr(g, f)), np.asarray(getattr(w, f))
            assert a.dtype == b.dtype and a.shape == b.shape, (name, f, a.dtype, b.dtype)
            assert a.tobytes() == b.tobytes(), (name, f)


def sample_nbytes(record: dict) -> int:
    return sum(np.asarray(getattr(r, f)).nbytes for r in record.values() for f in FIELDS[type(r)])


# ----------------------------------------------------------------------------- split / stack


@pytest.mark.parametrize("fmt", FMTS)
def test_split_gives_each_sample_its_slice_and_stack_inverts_it(fmt):
    batch = rollout_batch(fmt)
    samples = split_records(batch, ["a", "b", "c"])
    assert list(samples) == ["a", "b", "c"]
    for i, sid in enumerate(samples):
        for name, rec in batch.items():
            s = samples[sid][name]
            assert tuple(s.shape) == tuple(rec.shape[1:]) and s.axis == rec.axis - 1
            for f in FIELDS[type(rec)]:
                full = np.asarray(getattr(rec, f))
                want = full if full.ndim == 0 else full[i]
                assert np.asarray(getattr(s, f)).tobytes() == want.tobytes()
    host = {n: jax.tree_util.tree_map(np.asarray, r) for n, r in batch.items()}
    assert_records_equal(stack_records([samples[s] for s in "abc"]), host)
    # another order stacks the samples in that order
    swapped = stack_records([samples["c"], samples["a"]])
    assert_records_equal(split_records(swapped, ["c", "a"])["a"], split_records(host, "abc")["a"])


@pytest.mark.parametrize("fmt", FMTS)
def test_stack_pads_with_the_record_of_an_all_zero_input(fmt):
    # samples of two rollout batches with different lengths, stacked to a common length: the
    # guided quantization of the zero-padded inputs must reproduce the quantization of those
    # inputs, i.e. the padding is exactly the record of a zero row (finite scales, zero codes)
    mode = "row" if fmt == "nvfp4" else "tensor"
    # (batches of 3 as in the other tests: their quantize programs serve these too)
    short = split_records(rollout_batch(fmt, seed=1, t=3), [0, 1, 2])[0]
    long = split_records(rollout_batch(fmt, seed=2, t=5), [0, 1, 2])[1]
    # (MXFP4's scalar global scale is 1.0 in every batch, so its records stack too)
    stacked = stack_records([short, long], length=6)
    x_short = {n: x[0] for n, x in inputs(1, 3, 3).items()}
    x_long = {n: x[1] for n, x in inputs(2, 3, 5).items()}
    for name, rec in stacked.items():
        if name.endswith(".codes"):
            continue
        assert tuple(rec.shape[:2]) == (2, 6)
        x = np.zeros(rec.shape, np.float32)
        x[0, :3], x[1, :5] = x_short[name], x_long[name]
        got = fp4.guided_quantize(jnp.asarray(x), jax.device_put(rec))
        want = fp4.quantize(jnp.asarray(x), fmt, global_scale=mode)
        np.testing.assert_array_equal(np.asarray(got.codes), np.asarray(want.codes))
        # scales are per row (NVFP4) or per block (MXFP4): the padded rows' are the zero row's
        np.testing.assert_array_equal(np.asarray(rec.global_scale), np.asarray(want.global_scale))
        np.testing.assert_array_equal(
            np.asarray(rec.block_scales).view(np.uint8),
            np.asarray(want.block_scales).view(np.uint8),
        )


def test_stack_refuses_records_that_do_not_fit_together():
    a = split_records(rollout_batch("nvfp4", seed=1, t=3), [0, 1, 2])
    b = split_records(rollout_batch("nvfp4", seed=2, t=5), [0, 1, 2])
    with pytest.raises(ValueError, match=r"token lengths \[3, 5\]"):
        stack_records([a[0], b[0]])
    with pytest.raises(ValueError, match="more than 4"):
        stack_records([a[0], b[0]], length=4)
    fewer = {k: v for k, v in a[1].items() if "down" not in k}
    with pytest.raises(ValueError, match="other sites"):
        stack_records([a[0], fewer])
    # NVFP4 per-tensor global scales of two batches differ: no shared scalar exists
    x = inputs(1, 1, 3)["layers.2.kv.k"]
    t1 = fp4.rollout_guidance(fp4.quantize(jnp.asarray(x), "nvfp4"))
    t2 = fp4.rollout_guidance(fp4.quantize(jnp.asarray(2 * x), "nvfp4"))
    with pytest.raises(ValueError, match="per-tensor global_scale differs"):
        stack_records([split_records({"s": t1}, [0])[0], split_records({"s": t2}, [0])[0]])
    with pytest.raises(ValueError, match="not distinct"):
        split_records(rollout_batch("nvfp4"), [0, 0, 1])


# ----------------------------------------------------------------------------- host / spill


@pytest.mark.parametrize("fmt", FMTS)
def test_round_trip_through_host_memory(fmt, tmp_path):
    batch = rollout_batch(fmt)
    cache = GuidanceCache(tmp_path)
    cache.put_batch(7, [10, 11, 12], batch)
    single = split_records(rollout_batch(fmt, seed=5, b=1), ["x"])["x"]
    cache.put(7, "x", single)  # a single sample's record, jax arrays [T, ...]
    host = split_records(
        {n: jax.tree_util.tree_map(np.asarray, r) for n, r in batch.items()}, [10, 11, 12]
    )
    got = cache.get(7, [np.int64(12), "x", 10])
    want = stack_records([host[12], jax.tree_util.tree_map(np.asarray, single), host[10]])
    assert_records_equal(got, want)
    stats = cache.stats()
    assert stats.records == 4 and stats.spilled_records == 0 and stats.spilled_bytes == 0
    assert stats.host_bytes == 3 * sample_nbytes(host[10]) + sample_nbytes(single)
    assert not list(tmp_path.iterdir())  # nothing written without a budget


@pytest.mark.parametrize("fmt", FMTS)
def test_round_trip_through_a_spill_is_bit_exact(fmt, tmp_path):
    batch = rollout_batch(fmt)
    cache = GuidanceCache(tmp_path, host_budget_bytes=0)
    cache.put_batch(3, [0, 1, 2], batch)
    stats = cache.stats()
    per_sample = sample_nbytes(split_records(batch, [0, 1, 2])[0])
    assert (stats.host_bytes, stats.spilled_records, stats.spilled_bytes) == (0, 3, 3 * per_sample)
    for sid in range(3):
        meta = json.loads((cache.spill_path(3, sid) / "zarr.json").read_text())
        assert meta["zarr_format"] == 3 and meta["attributes"]["format_version"] == FORMAT_VERSION
    got = cache.get(3, [2, 0, 1])
    assert np.asarray(got["layers.2.kv.k"].block_scales).dtype == (
        jnp.float8_e4m3fn if fmt == "nvfp4" else np.uint8
    )
    host = {n: jax.tree_util.tree_map(np.asarray, r) for n, r in batch.items()}
    s = split_records(host, [0, 1, 2])
    assert_records_equal(got, stack_records([s[2], s[0], s[1]]))
    # the records read back guide the training side to the rollout's codes
    name = "layers.2.experts.down.act"
    x = jnp.asarray(inputs(0, 3, 5)[name][np.array([2, 0, 1])])
    guided = fp4.guided_quantize(x, jax.device_put(got[name]))
    mode = "row" if fmt == "nvfp4" else "tensor"
    want = fp4.quantize(x, fmt, global_scale=mode)
    np.testing.assert_array_equal(np.asarray(guided.codes), np.asarray(want.codes))


@pytest.mark.parametrize("fmt", FMTS)
def test_batches_are_read_back_as_rows_alike_per_sample_stacking(fmt, tmp_path):
    """Micro-batches of rows of put batches (one batch whole in its order, rows of two batches
    in any order, one row spilled) equal the stacks of the per-sample records; a whole batch in
    its order comes back as the cache's own arrays, read-only."""
    a, b = rollout_batch(fmt, seed=1), rollout_batch(fmt, seed=2)
    host = lambda r: {n: jax.tree_util.tree_map(np.asarray, x) for n, x in r.items()}  # noqa: E731
    rows = {**split_records(host(a), [0, 1, 2]), **split_records(host(b), [3, 4, 5])}
    cache = GuidanceCache(tmp_path, host_budget_bytes=10**9)
    cache.put_batch(4, [0, 1, 2], a)
    cache.put_batch(4, [3, 4, 5], b)
    whole = cache.get(4, [0, 1, 2])
    assert_records_equal(whole, stack_records([rows[i] for i in (0, 1, 2)]))
    codes = whole["layers.2.kv.k"].mantissa_bits
    assert not codes.flags.writeable
    for ids in ([2, 0], [4, 0, 5, 1], [3, 4, 5, 0, 1, 2]):
        assert_records_equal(cache.get(4, ids), stack_records([rows[i] for i in ids]))
    assert_records_equal(cache.get(4, [1, 1]), stack_records([rows[1], rows[1]]))
    cache._spill([cache._entries[(4, 4)]])  # one row of the second batch on disk
    assert cache.spill_path(4, 4) is not None and cache.spill_path(4, 3) is None
    for ids in ([3, 4, 5], [5, 4, 0]):
        assert_records_equal(cache.get(4, ids), stack_records([rows[i] for i in ids]))
    padded = cache.get(4, [0, 2], length=7)
    assert_records_equal(padded, stack_records([rows[0], rows[2]], length=7))


def test_budget_spills_the_oldest_records_and_bounds_host_bytes(tmp_path):
    batches = [rollout_batch("nvfp4", seed=s) for s in range(3)]
    per_sample = sample_nbytes(split_records(batches[0], [0, 1, 2])[0])
    budget = int(2.5 * per_sample)
    cache = GuidanceCache(tmp_path, host_budget_bytes=budget)
    order = []
    for i, b in enumerate(batches):
        ids = [3 * i, 3 * i + 1, 3 * i + 2]
        cache.put_batch(1, ids, b)
        order += ids
        stats = cache.stats()
        assert stats.host_bytes <= budget
        assert stats.host_bytes + stats.spilled_bytes == len(order) * per_sample
    stats = cache.stats()
    assert stats.records == 9 and stats.spilled_records == 7 and stats.host_bytes == 2 * per_sample
    spilled = [sid for sid in order if cache.spill_path(1, sid) is not None]
    assert spilled == order[:7]  # the oldest
    want = stack_records([r for b in batches for r in split_records(b, [0, 1, 2]).values()])
    assert_records_equal(cache.get(1, order), jax.tree_util.tree_map(np.asarray, want))


def test_spills_larger_than_a_chunk_span_several_files(tmp_path, monkeypatch):
    monkeypatch.setattr(cache_module, "SPILL_CHUNK_BYTES", 64)
    batch = rollout_batch("nvfp4")
    cache = GuidanceCache(tmp_path, host_budget_bytes=0)
    cache.put_batch(1, [0, 1, 2], batch)
    chunks = sorted((cache.spill_path(1, 0) / "c").iterdir(), key=lambda p: int(p.name))
    assert len(chunks) > 1
    assert_records_equal(cache.get(1, [0, 1, 2]), jax.tree_util.tree_map(np.asarray, dict(batch)))
    # a flipped byte of an array stored in chunk 1 is reported in chunk 1's file only
    attrs = json.loads((cache.spill_path(1, 0) / "zarr.json").read_text())["attributes"]
    inside = [
        a["offset"]
        for s in attrs["sites"]
        for a in s["arrays"]
        if a["offset"] >= 64 and a["offset"] + a["nbytes"] <= 128
    ]
    data = bytearray(chunks[1].read_bytes())
    data[inside[0] - 64] ^= 0x10
    chunks[1].write_bytes(bytes(data))
    with pytest.raises(CorruptSpillError) as err:
        cache.get(1, [0])
    assert str(chunks[1]) in str(err.value) and str(chunks[0]) not in str(err.value)


# ----------------------------------------------------------------------------- errors


def test_a_record_of_another_version_is_refused(tmp_path):
    cache = GuidanceCache(tmp_path)
    cache.put_batch(3, ["prompt/7#0", "b", "c"], rollout_batch("nvfp4"))
    with pytest.raises(GuidanceVersionError) as err:
        cache.get(4, ["b", "prompt/7#0"])
    msg = str(err.value)
    assert "'b'" in msg and "version 4" in msg and "[3]" in msg
    cache.get(3, ["prompt/7#0"])  # the recorded version is fine


def test_a_missing_sample_is_refused(tmp_path):
    cache = GuidanceCache(tmp_path)
    cache.put_batch(3, [0, 1, 2], rollout_batch("nvfp4"))
    with pytest.raises(GuidanceNotFoundError, match=r"sample 5 under policy version 3"):
        cache.get(3, [0, 5])
    with pytest.raises(GuidanceCacheError, match="already cached"):
        cache.put_batch(3, [2, 3, 4], rollout_batch("nvfp4"))
    assert cache.stats().records == 3  # the refused put left nothing behind


def test_an_inconsistent_record_is_refused_at_put(tmp_path):
    rec = rollout_batch("nvfp4")["layers.2.kv.k"]
    bad = {
        "layers.2.kv.k": fp4.Guidance(
            rec.mantissa_bits[..., :-1],
            rec.block_scales,
            rec.global_scale,
            rec.fmt,
            rec.shape,
            rec.axis,
        )
    }
    with pytest.raises(ValueError, match=r"site layers.2.kv.k: mantissa_bits"):
        GuidanceCache(tmp_path).put_batch(0, [0, 1, 2], bad)


def spilled_cache(tmp_path) -> GuidanceCache:
    cache = GuidanceCache(tmp_path / "spill", host_budget_bytes=0)
    cache.put_batch(1, [0, 1, 2], rollout_batch("nvfp4"))
    return cache


@pytest.mark.parametrize("field", ["mantissa_bits", "block_scales", "global_scale"])
def test_a_flipped_byte_in_a_spill_is_detected(tmp_path, field):
    cache = spilled_cache(tmp_path)
    path = cache.spill_path(1, 1)
    attrs = json.loads((path / "zarr.json").read_text())["attributes"]
    site = next(s for s in attrs["sites"] if s["site"] == "layers.2.kv.k")
    offset = next(a["offset"] for a in site["arrays"] if a["field"] == field)
    chunk = path / "c" / "0"
    data = bytearray(chunk.read_bytes())
    data[offset] ^= 0x01
    chunk.write_bytes(bytes(data))
    with pytest.raises(CorruptSpillError) as err:
        cache.get(1, [0, 1])
    assert str(chunk) in str(err.value) and f"layers.2.kv.k.{field}" in str(err.value)
    cache.get(1, [0, 2])  # the other records are intact


def test_a_damaged_or_misplaced_spill_is_detected(tmp_path):
    cache = spilled_cache(tmp_path)
    meta = cache.spill_path(1, 0) / "zarr.json"
    meta.write_text(meta.read_text()[:-20])
    with pytest.raises(CorruptSpillError, match=str(meta)):
        cache.get(1, [0])
    # sample 2's files in sample 1's place: valid checksums, but not sample 1's record
    shutil.rmtree(cache.spill_path(1, 1))
    shutil.copytree(cache.spill_path(1, 2), cache.spill_path(1, 1))
    with pytest.raises(CorruptSpillError, match="sample 'i2'; expected version 1, sample 'i1'"):
        cache.get(1, [1])


def test_the_spill_format_version_is_checked(tmp_path):
    cache = spilled_cache(tmp_path)
    meta = cache.spill_path(1, 2) / "zarr.json"
    content = json.loads(meta.read_text())
    content["attributes"]["format_version"] = FORMAT_VERSION + 1
    meta.write_text(json.dumps(content))
    with pytest.raises(SpillFormatError) as err:
        cache.get(1, [2])
    msg = str(err.value)
    assert str(meta) in msg and f"version {FORMAT_VERSION + 1}" in msg
    assert f"reads format version {FORMAT_VERSION}" in msg


def test_a_directory_with_foreign_files_is_refused(tmp_path):
    (tmp_path / "old").mkdir()
    with pytest.raises(ValueError, match="not empty"):
        GuidanceCache(tmp_path, host_budget_bytes=0)
    with pytest.raises(ValueError, match="needs a directory"):
        GuidanceCache(None, host_budget_bytes=10)


# ----------------------------------------------------------------------------- eviction


def test_evict_drops_old_versions_from_host_and_disk(tmp_path):
    per_sample = sample_nbytes(split_records(rollout_batch("mxfp4"), [0, 1, 2])[0])
    cache = GuidanceCache(tmp_path, host_budget_bytes=4 * per_sample)
    for version in (1, 2, 3):
        cache.put_batch(version, [f"{version}.{i}" for i in range(3)], rollout_batch("mxfp4"))
    assert cache.stats().spilled_records == 5 and (tmp_path / "v1").is_dir()
    assert cache.evict(version_below=3) == 6
    stats = cache.stats()
    assert stats.records == 3 and stats.spilled_records == 0 and stats.spilled_bytes == 0
    assert stats.host_bytes == 3 * per_sample
    assert not (tmp_path / "v1").exists() and not (tmp_path / "v2").exists()
    with pytest.raises(GuidanceNotFoundError, match="below 3 were evicted"):
        cache.get(2, ["2.0"])
    with pytest.raises(GuidanceCacheError, match="below the eviction bound"):
        cache.put_batch(2, ["x", "y", "z"], rollout_batch("mxfp4"))
    assert cache.get(3, ["3.0", "3.2"])["layers.2.kv.k"].shape[0] == 2
    cache.close()
    assert len(cache) == 0 and not list(tmp_path.iterdir())


def test_discard_drops_records_from_host_and_disk(tmp_path):
    batch = rollout_batch("nvfp4")
    per_sample = sample_nbytes(split_records(batch, [0, 1, 2])[0])
    cache = GuidanceCache(tmp_path, host_budget_bytes=int(1.5 * per_sample))
    cache.put_batch(2, [0, 1, 2], batch)  # two spilled, one in host memory
    spilled = cache.spill_path(2, 0)
    assert spilled is not None and spilled.is_dir() and cache.spill_path(2, 2) is None
    cache.discard(2, [0, 2])
    stats = cache.stats()
    assert (stats.records, stats.host_bytes, stats.spilled_bytes) == (1, 0, per_sample)
    assert not spilled.exists()
    for sid in (0, 2):
        with pytest.raises(GuidanceNotFoundError):
            cache.get(2, [sid])
    want = split_records(jax.tree_util.tree_map(np.asarray, batch), [0, 1, 2])[1]
    assert_records_equal(cache.get(2, [1]), stack_records([want]))
    cache.put_batch(2, [0, 2], {n: fp4.take_rows(r, jnp.asarray([0, 2])) for n, r in batch.items()})
    assert (2, 0) in cache and len(cache) == 3  # a discarded sample may come again
