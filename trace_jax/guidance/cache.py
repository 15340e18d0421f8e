"""The guidance cache: rollout records move device -> host memory -> disk, keyed by version/sample.

A *record* is what the rollout keeps of one sample: site name -> ``Guidance`` (or, in the
diagnostic mode, ``QTensor``) whose arrays have the sample's token positions as leading dim
``[T, ...]``. The engine produces a batch ``[B, T, ...]``; the cache keeps it whole on the host,
each sample a row of it, and ``get`` gathers a trainer micro-batch ``[B', T, ...]`` from the rows
(``split_records`` and ``stack_records`` do the same per sample: for spills, records put one by
one, and padding).

Data path (TRACE section 4)::

    cache = GuidanceCache(spill_dir, host_budget_bytes=8 << 30)
    cache.put_batch(version, sample_ids, state.guidance)  # starts device -> host copies
    ...
    batch = cache.get(version, micro_batch_ids)            # numpy, [B', T, ...]
    cache.evict(version_below=version - max_staleness)

``put``/``put_batch`` start the device-to-host copies (``copy_to_host_async``) and return; the
host copies are taken lazily, at the latest on the next ``put``/``put_batch`` (or ``get``, a
spill, ``sync``). The caller must therefore not delete or donate the arrays it passed until
then. Above ``host_budget_bytes`` the oldest records are spilled, one zarr v3 array of raw
bytes per record written through tensorstore, with the layout of each array and its sha256 in
the array's attributes, plus a format version. Reads check the format version, the key and
every checksum. Nothing is ever silently reused: a record asked for under another policy
version, a missing record, a corrupt or foreign spill each raise a ``GuidanceCacheError``.

Spill layout::

    <directory>/v<version>/<sample key>/zarr.json   # zarr v3 metadata, attributes below
    <directory>/v<version>/<sample key>/c/<i>       # chunk i of the record's bytes (uint8)

``sample key`` is ``i<n>`` for an int sample id and ``s<url-quoted>`` for a str one. The
attributes: ``format_version``, ``version``, ``sample_key`` and ``sites``, a list of
``{site, kind ("guidance" | "qtensor"), fmt, shape, axis, arrays}`` where each array is
``{field, dtype, shape, offset, nbytes, sha256}`` (offsets into the record's bytes).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import shutil
import threading
import urllib.parse
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import tensorstore as ts

from trace_jax import fp4
from trace_jax.fp4.qtensor import stored_shape

SampleId = int | str
SiteRecord = fp4.Guidance | fp4.QTensor
Record = dict[str, SiteRecord]
"""One sample (arrays [T, ...]) or a batch of samples (arrays [B, T, ...]): site name -> record."""

FORMAT_VERSION = 1
"""Version of the spill layout; bumped whenever the bytes or attributes change meaning."""

SPILL_CHUNK_BYTES = 16 << 20
"""Records larger than this are written as several chunk files."""

_ALIGN = 16  # each array starts at a multiple of this in the record's bytes
_KINDS = {"guidance": fp4.Guidance, "qtensor": fp4.QTensor}
_PAYLOAD_FIELD = {fp4.Guidance: ("mantissa_bits", 8), fp4.QTensor: ("codes", 2)}
"""The per-element array of each record type and how many elements one byte of it holds."""


# ----------------------------------------------------------------------------- errors


class GuidanceCacheError(Exception):
    """Base of the errors the cache raises instead of returning a wrong or stale record."""


class GuidanceNotFoundError(GuidanceCacheError, LookupError):
    """No record of the sample under any cached version."""


class GuidanceVersionError(GuidanceCacheError, LookupError):
    """The sample is cached, but under another policy version than the one requested."""


class CorruptSpillError(GuidanceCacheError, OSError):
    """A spilled record failed its checksum or could not be read; the message names the file."""


class SpillFormatError(GuidanceCacheError):
    """A spilled record was written in another format version (or by something else)."""


# ----------------------------------------------------------------------------- records


def _array_fields(rec: SiteRecord) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(rec) if not f.metadata.get("static"))


def _kind(rec: SiteRecord) -> str:
    for name, cls in _KINDS.items():
        if type(rec) is cls:
            return name
    raise TypeError(f"expected fp4.Guidance or fp4.QTensor, got {type(rec).__name__}")


def check_record(name: str, rec: SiteRecord) -> None:
    """Check that the arrays of ``rec`` match its static shape, axis and format.

    Raises ``ValueError``/``TypeError`` naming the site ``name``.
    """
    _kind(rec)
    stored = stored_shape(tuple(rec.shape), rec.axis)
    k, rows = stored[-1], stored[:-1]
    payload, per_byte = _PAYLOAD_FIELD[type(rec)]
    scale_dtype = jnp.float8_e4m3fn if rec.fmt.scale_format == "e4m3" else jnp.uint8
    expected = {
        payload: ((*rows, k // per_byte), jnp.uint8),
        "block_scales": ((*rows, k // rec.fmt.block_size), scale_dtype),
    }
    for field, (shape, dtype) in expected.items():
        a = getattr(rec, field)
        if tuple(np.shape(a)) != shape or np.dtype(a.dtype) != np.dtype(dtype):
            raise ValueError(
                f"site {name}: {field} is {np.dtype(a.dtype).name}{list(np.shape(a))}, expected "
                f"{np.dtype(dtype).name}{list(shape)} for a {rec.fmt.name} record of logical "
                f"shape {rec.shape} along axis {rec.axis}"
            )
    g = rec.global_scale
    if tuple(np.shape(g)) not in ((), (*rows, 1)) or np.dtype(g.dtype) != np.float32:
        raise ValueError(
            f"site {name}: global_scale is {np.dtype(g.dtype).name}{list(np.shape(g))}, expected "
            f"float32 [] or {[*rows, 1]}"
        )


def _check_leading_axis(name: str, rec: SiteRecord, what: str) -> None:
    if rec.axis == 0 or not rec.shape:
        raise ValueError(
            f"site {name}: the leading axis is the {what} axis and cannot be the quantized one "
            f"(shape {rec.shape}, axis {rec.axis})"
        )


def _per_row(rec: SiteRecord) -> bool:
    return np.ndim(rec.global_scale) > 0


def split_records(
    batch: Mapping[str, SiteRecord], sample_ids: Sequence[SampleId]
) -> dict[SampleId, Record]:
    """Cut a batched record [B, T, ...] into one record [T, ...] per sample.

    Args:
      batch: site name -> record with arrays [B, T, ...] (jax or numpy).
      sample_ids: B distinct ids, in batch order.
    Returns:
      sample id -> record. Numpy inputs give fresh copies (the per-sample record owns its
      memory); jax inputs give jax slices. A per-tensor (scalar) global scale is shared by all
      samples of the batch.
    """
    ids = list(sample_ids)
    if len(set(ids)) != len(ids):
        raise ValueError(f"sample ids are not distinct: {ids}")
    for name, rec in batch.items():
        check_record(name, rec)
        _check_leading_axis(name, rec, "batch")
        if rec.shape[0] != len(ids):
            raise ValueError(f"site {name}: batch of {rec.shape[0]} records, {len(ids)} sample ids")

    return {sid: _row(batch, i, copy=True) for i, sid in enumerate(ids)}


@functools.cache
def _empty_values(fmt: fp4.FormatSpec, kind: str, per_row: bool) -> dict[str, np.ndarray]:
    """The record of an all-zero input (one row), used to pad token positions with finite scales
    (the rollout engine fills unwritten slots the same way)."""
    qt = fp4.quantize(
        jnp.zeros((1, fmt.block_size * 8), jnp.float32),
        fmt,
        global_scale="row" if per_row and fmt.has_global_scale else "tensor",
    )
    rec = fp4.rollout_guidance(qt) if kind == "guidance" else qt
    return {f: np.asarray(getattr(rec, f)).reshape(-1)[0] for f in _array_fields(rec)}


def stack_records(records: Sequence[Mapping[str, SiteRecord]], length: int | None = None) -> Record:
    """Stack per-sample records [T, ...] into a micro-batch [B, T, ...] (numpy).

    Args:
      records: B records with the same sites, formats, axes and per-token shapes.
      length: pad every record's token axis to this length (with the record of an all-zero
        input: zero codes, finite scales); None requires all records to have the same T.
    Returns:
      site name -> record with numpy arrays [B, T, ...] and static shape ``(B, *shape)``.
      A per-tensor global scale must be bitwise equal across the records and stays a scalar.
    """
    if not records:
        raise ValueError("stack_records needs at least one record")
    sites = list(records[0])
    for i, r in enumerate(records):
        if set(r) != set(sites):
            diff = sorted(set(r) ^ set(sites))
            raise ValueError(f"record {i} has other sites than record 0: {diff}")
    out: Record = {}
    for name in sites:
        first = records[0][name]
        check_record(name, first)
        _check_leading_axis(name, first, "token")
        for i, r in enumerate(records):
            rec = r[name]
            check_record(name, rec)
            if not _same_layout(rec, first):
                raise ValueError(
                    f"site {name}: record {i} ({type(rec).__name__} {rec.fmt.name}, shape "
                    f"{rec.shape}, axis {rec.axis}) does not stack with record 0 "
                    f"({type(first).__name__} {first.fmt.name}, shape {first.shape}, "
                    f"axis {first.axis})"
                )
        lengths = [r[name].shape[0] for r in records]
        t = length if length is not None else lengths[0]
        if length is None and len(set(lengths)) > 1:
            raise ValueError(f"site {name}: records have token lengths {lengths}; pass length=")
        if max(lengths) > t:
            raise ValueError(f"site {name}: a record has {max(lengths)} tokens, more than {t}")
        fill = _empty_values(first.fmt, _kind(first), _per_row(first))
        arrays = {}
        for f in _array_fields(first):
            parts = [np.asarray(getattr(r[name], f)) for r in records]
            if parts[0].ndim == 0:
                if len({p.tobytes() for p in parts}) > 1:
                    raise ValueError(
                        f"site {name}: the per-tensor {f} differs between records, so they "
                        f"cannot share one; record with a per-row global scale"
                    )
                arrays[f] = parts[0].copy()
                continue
            stacked = np.full((len(parts), t, *parts[0].shape[1:]), fill[f], parts[0].dtype)
            for i, p in enumerate(parts):
                stacked[i, : p.shape[0]] = p
            arrays[f] = stacked
        out[name] = dataclasses.replace(
            first, **arrays, shape=(len(records), t, *first.shape[1:]), axis=first.axis + 1
        )
    return out


# ----------------------------------------------------------------------------- cache


@dataclasses.dataclass(frozen=True)
class CacheStats:
    """Attributes:
    host_bytes: bytes of records held in host memory (including copies still in flight).
    spilled_bytes: bytes of records spilled to disk (array bytes, without metadata).
    records: number of records cached.
    spilled_records: how many of them are on disk.
    """

    host_bytes: int
    spilled_bytes: int
    records: int
    spilled_records: int

    def metrics(self) -> dict[str, float]:
        return {
            "guidance/cache/host_bytes": float(self.host_bytes),
            "guidance/cache/spilled_bytes": float(self.spilled_bytes),
            "guidance/cache/records": float(self.records),
            "guidance/cache/spilled_records": float(self.spilled_records),
        }


class _Transfer:
    """Arrays handed to one ``put``/``put_batch`` call, copied to the host when first needed.

    A batch stays one set of host arrays [B, T, ...]; its samples are rows of it (``rows``), cut
    out only where one is needed alone (a spill, a micro-batch padded to another length)."""

    def __init__(self, record: Mapping[str, SiteRecord], sample_ids: Sequence[SampleId] | None):
        self.record = dict(record)
        self.rows = None if sample_ids is None else {sid: i for i, sid in enumerate(sample_ids)}
        for leaf in jax.tree_util.tree_leaves(self.record):
            if isinstance(leaf, jax.Array):
                leaf.copy_to_host_async()
        self._host: Record | None = None

    def host(self) -> Record:
        """The record on the host (numpy arrays the cache owns; a batch's: [B, T, ...])."""
        if self._host is None:
            self._host = jax.tree_util.tree_map(_host_copy, self.record)
            self.record = {}  # drop the device arrays
        return self._host


def _host_copy(a) -> np.ndarray:
    """A host array the cache may keep: a device array's host copy (read-only, made once), or a
    copy of a numpy input (the caller may reuse its own)."""
    return np.asarray(a) if isinstance(a, jax.Array) else np.array(a)


def _row(batch: Record, i: int, copy: bool = False) -> Record:
    """Sample ``i`` of a batched record: [T, ...] slices (a scalar global scale shared; with
    ``copy``, numpy slices copied)."""

    def take(a):
        if np.ndim(a) == 0:
            return a
        return np.array(a[i]) if copy and isinstance(a, np.ndarray) else a[i]

    return {
        name: dataclasses.replace(
            rec,
            **{f: take(getattr(rec, f)) for f in _array_fields(rec)},
            shape=tuple(rec.shape[1:]),
            axis=rec.axis - 1,
        )
        for name, rec in batch.items()
    }


@dataclasses.dataclass
class _Entry:
    """One sample's record: in flight (``transfer``), in host memory (``host``: its own record,
    or row ``row`` of a batch's), or on disk (``spill``)."""

    version: int
    sample_id: SampleId
    nbytes: int
    host: Record | None = None
    transfer: _Transfer | None = None
    spill: Path | None = None
    row: int | None = None

    def record(self) -> Record:
        """The sample's host record [T, ...] (after ``GuidanceCache._to_host``)."""
        assert self.host is not None
        return self.host if self.row is None else _row(self.host, self.row)


class GuidanceCache:
    """Guidance records keyed by (policy version, sample id): host memory, spilled to disk.

    Args:
      directory: where spilled records go; created if missing and must be empty (a cache never
        reads files it did not write). Required when ``host_budget_bytes`` is set.
      host_budget_bytes: the most bytes of records kept in host memory; above it the oldest
        records are spilled. None: never spill.

    Thread-safe: every public method holds one lock.
    """

    def __init__(
        self, directory: str | Path | None = None, *, host_budget_bytes: int | None = None
    ):
        if host_budget_bytes is not None and host_budget_bytes < 0:
            raise ValueError(f"host_budget_bytes must be >= 0, got {host_budget_bytes}")
        if host_budget_bytes is not None and directory is None:
            raise ValueError("a host byte budget needs a directory to spill to")
        self.directory = None if directory is None else Path(directory)
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            if any(self.directory.iterdir()):
                raise ValueError(f"spill directory {self.directory} is not empty")
        self.host_budget_bytes = host_budget_bytes
        self._entries: dict[tuple[int, SampleId], _Entry] = {}  # insertion order = age
        self._versions: dict[SampleId, set[int]] = {}
        self._in_flight: list[_Entry] = []
        self._evicted_below: int | None = None
        self._host_bytes = 0
        self._spilled_bytes = 0
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ writing

    def put(self, version: int, sample_id: SampleId, record: Mapping[str, SiteRecord]) -> None:
        """Cache one sample's record (arrays [T, ...], jax or numpy) under ``version``."""
        self._put(version, [sample_id], record, batched=False)

    def put_batch(
        self, version: int, sample_ids: Sequence[SampleId], batch: Mapping[str, SiteRecord]
    ) -> None:
        """Cache a batched record (arrays [B, T, ...]) as B records, one per sample id.

        One device-to-host copy per array of the batch; the batch is split on the host.
        """
        self._put(version, list(sample_ids), batch, batched=True)

    def _put(self, version, sample_ids, record, batched):
        version = int(version)
        sample_ids = [_sample_id(sid) for sid in sample_ids]
        for name, rec in record.items():
            check_record(name, rec)
            _check_leading_axis(name, rec, "batch" if batched else "token")
            if batched and rec.shape[0] != len(sample_ids):
                raise ValueError(
                    f"site {name}: batch of {rec.shape[0]} records, {len(sample_ids)} sample ids"
                )
        if len(set(sample_ids)) != len(sample_ids):
            raise ValueError(f"sample ids are not distinct: {sample_ids}")
        with self._lock:
            for sid in sample_ids:
                if (version, sid) in self._entries:
                    raise GuidanceCacheError(
                        f"sample {sid!r} is already cached under version {version}"
                    )
            if self._evicted_below is not None and version < self._evicted_below:
                raise GuidanceCacheError(
                    f"version {version} is below the eviction bound {self._evicted_below}"
                )
            self._sync()  # earlier transfers have had time to land
            transfer = _Transfer(record, sample_ids if batched else None)
            per_sample = _sample_nbytes(record, batched)
            for sid in sample_ids:
                entry = _Entry(version, sid, per_sample, transfer=transfer)
                self._entries[(version, sid)] = entry
                self._versions.setdefault(sid, set()).add(version)
                self._in_flight.append(entry)
                self._host_bytes += per_sample
            self._enforce_budget()

    def sync(self) -> None:
        """Wait for every device-to-host copy started by ``put``/``put_batch``."""
        with self._lock:
            self._sync()

    def _sync(self):
        for entry in self._in_flight:
            self._to_host(entry)
        self._in_flight = []

    def _to_host(self, entry: _Entry) -> None:
        if entry.transfer is not None:
            rows = entry.transfer.rows
            entry.host = entry.transfer.host()
            entry.row = None if rows is None else rows[entry.sample_id]
            entry.transfer = None

    def _enforce_budget(self):
        if self.host_budget_bytes is None or self._host_bytes <= self.host_budget_bytes:
            return
        victims, excess = [], self._host_bytes - self.host_budget_bytes
        for entry in self._entries.values():
            if excess <= 0:
                break
            if entry.spill is None:
                victims.append(entry)
                excess -= entry.nbytes
        self._spill(victims)

    # ------------------------------------------------------------------ disk

    def _path(self, version: int, sample_id: SampleId) -> Path:
        assert self.directory is not None
        return self.directory / f"v{version}" / _sample_key(sample_id)

    def _spill(self, entries: list[_Entry]) -> None:
        writes = []
        for entry in entries:
            self._to_host(entry)
            payload, attrs = _encode(entry)
            path = self._path(entry.version, entry.sample_id)
            spec = _zarr_spec(path)
            spec["metadata"] = {
                "shape": [payload.size],
                "data_type": "uint8",
                "chunk_grid": {
                    "name": "regular",
                    "configuration": {
                        "chunk_shape": [max(1, min(payload.size, SPILL_CHUNK_BYTES))]
                    },
                },
                "attributes": attrs,
            }
            store = ts.open(spec, create=True, delete_existing=True).result()
            writes.append((entry, path, store.write(payload)))
        for entry, path, future in writes:
            future.result()
            entry.host, entry.row, entry.spill = None, None, path
            self._host_bytes -= entry.nbytes
            self._spilled_bytes += entry.nbytes

    def _load(self, entry: _Entry) -> Record:
        path = entry.spill
        assert path is not None
        meta = path / "zarr.json"
        try:
            store = ts.open(_zarr_spec(path), open=True).result()
            attrs = store.spec().to_json()["metadata"].get("attributes", {})
        except ValueError as e:
            raise CorruptSpillError(f"spilled guidance record {meta} cannot be opened: {e}") from e
        found = attrs.get("format_version")
        if found != FORMAT_VERSION:
            raise SpillFormatError(
                f"spilled guidance record {meta} has format version {found!r}; this code reads "
                f"format version {FORMAT_VERSION}"
            )
        key = _sample_key(entry.sample_id)
        if attrs.get("version") != entry.version or attrs.get("sample_key") != key:
            raise CorruptSpillError(
                f"spilled guidance record {meta} belongs to version {attrs.get('version')!r}, "
                f"sample {attrs.get('sample_key')!r}; expected version {entry.version}, "
                f"sample {key!r}"
            )
        try:
            payload = store.read().result()
        except ValueError as e:
            raise CorruptSpillError(f"spilled guidance record {path} cannot be read: {e}") from e
        try:
            return _decode(payload, attrs, path, store.chunk_layout.read_chunk.shape[0])
        except (KeyError, TypeError, ValueError) as e:  # attributes edited or truncated
            raise CorruptSpillError(f"spilled guidance record {meta} is malformed: {e!r}") from e

    # ------------------------------------------------------------------ reading

    def get(
        self, version: int, sample_ids: Iterable[SampleId], *, length: int | None = None
    ) -> Record:
        """The micro-batch of ``sample_ids`` recorded under ``version``.

        Args:
          version: the policy version the trainer needs the records of.
          sample_ids: B ids.
          length: pad the token axis to this length (see ``stack_records``).
        Returns:
          site name -> record with numpy arrays [B, T, ...] (``jax.device_put`` it with the
          trainer's sharding; read-only where they are the cache's own, e.g. one whole batch
          asked for in its order). Spilled records are read back and stay on disk.
        Raises:
          GuidanceVersionError: a sample is cached only under other versions.
          GuidanceNotFoundError: a sample is not cached at all.
          CorruptSpillError, SpillFormatError: a spilled record fails its checks.
        """
        version = int(version)
        ids = [_sample_id(sid) for sid in sample_ids]
        with self._lock:
            entries = [self._lookup(version, sid) for sid in ids]
            for entry in entries:
                if entry.spill is None:
                    self._to_host(entry)
            gathered = _rows_of_batches(entries, length)
            if gathered is not None:
                return gathered
            records = [
                self._load(entry) if entry.spill is not None else entry.record()
                for entry in entries
            ]
        return stack_records(records, length)

    def _lookup(self, version: int, sample_id: SampleId) -> _Entry:
        entry = self._entries.get((version, sample_id))
        if entry is not None:
            return entry
        recorded = sorted(self._versions.get(sample_id, ()))
        if recorded:
            raise GuidanceVersionError(
                f"guidance of sample {sample_id!r} was requested for policy version {version} "
                f"but was recorded under version(s) {recorded}; it must not be reused"
            )
        hint = ""
        if self._evicted_below is not None and version < self._evicted_below:
            hint = f" (versions below {self._evicted_below} were evicted)"
        raise GuidanceNotFoundError(
            f"no guidance cached for sample {sample_id!r} under policy version {version}{hint}"
        )

    def __contains__(self, key: tuple[int, SampleId]) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def spill_path(self, version: int, sample_id: SampleId) -> Path | None:
        """The zarr array of a spilled record, or None while it is in host memory."""
        with self._lock:
            return self._lookup(int(version), _sample_id(sample_id)).spill

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(
                host_bytes=self._host_bytes,
                spilled_bytes=self._spilled_bytes,
                records=len(self._entries),
                spilled_records=sum(e.spill is not None for e in self._entries.values()),
            )

    # ------------------------------------------------------------------ eviction

    def evict(self, *, version_below: int) -> int:
        """Drop every record of a version below ``version_below`` (host and disk).

        Returns the number of records dropped. Later puts below the bound are refused.
        """
        with self._lock:
            old = [key for key in self._entries if key[0] < version_below]
            for key in old:
                self._drop(self._entries[key], remove_spill=False)  # their folders go below
            self._in_flight = [e for e in self._in_flight if e.version >= version_below]
            if self.directory is not None:
                for vdir in self.directory.glob("v*"):
                    if int(vdir.name[1:]) < version_below:
                        shutil.rmtree(vdir)
            bound = self._evicted_below
            self._evicted_below = version_below if bound is None else max(bound, version_below)
            return len(old)

    def discard(self, version: int, sample_ids: Iterable[SampleId]) -> None:
        """Drop the records of ``sample_ids`` under ``version`` (host and disk), e.g. once the
        trainer has taken them for good; later puts of that version are still accepted."""
        version = int(version)
        with self._lock:
            entries = [self._lookup(version, _sample_id(sid)) for sid in sample_ids]
            for entry in entries:
                self._drop(entry)
            gone = {id(e) for e in entries}
            self._in_flight = [e for e in self._in_flight if id(e) not in gone]

    def _drop(self, entry: _Entry, remove_spill: bool = True) -> None:
        del self._entries[(entry.version, entry.sample_id)]
        versions = self._versions[entry.sample_id]
        versions.discard(entry.version)
        if not versions:
            del self._versions[entry.sample_id]
        if entry.spill is not None:
            self._spilled_bytes -= entry.nbytes
            if remove_spill:
                shutil.rmtree(entry.spill, ignore_errors=True)
        else:
            self._host_bytes -= entry.nbytes
        entry.host = entry.transfer = None

    def close(self) -> None:
        """Drop every record and delete the spilled files."""
        with self._lock:
            self._entries.clear()
            self._versions.clear()
            self._in_flight = []
            self._host_bytes = self._spilled_bytes = 0
            if self.directory is not None:
                for vdir in self.directory.glob("v*"):
                    shutil.rmtree(vdir)

    def __enter__(self) -> GuidanceCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _rows_of_batches(entries: Sequence[_Entry], length: int | None) -> Record | None:
    """The micro-batch of ``entries`` gathered from the host batches they are rows of: one
    indexing per array and batch, no per-sample records (``stack_records``'s result for them).
    None where that does not apply: an entry spilled or put alone, batches that do not stack
    (other sites, formats, shapes, per-tensor scales), padding to another length."""
    if not entries or any(e.row is None or e.host is None for e in entries):
        return None
    batches: dict[int, Record] = {}
    for e in entries:
        batches.setdefault(id(e.host), e.host)
    first = next(iter(batches.values()))
    for batch in batches.values():
        if set(batch) != set(first) or not all(
            _stack_alike(batch[name], ref) for name, ref in first.items()
        ):
            return None
    if length is not None and any(length != rec.shape[1] for rec in first.values()):
        return None
    n = len(entries)
    which = np.asarray([id(e.host) for e in entries])
    rows = np.asarray([e.row for e in entries])
    # one whole batch in its own order (a rollout batch trained on at once): its arrays, read-only
    whole = len(batches) == 1 and np.array_equal(rows, np.arange(_batch_rows(first)))
    out: Record = {}
    for name, ref in first.items():
        arrays = {}
        for f in _array_fields(ref):
            a = getattr(ref, f)
            if np.ndim(a) == 0:  # a per-tensor global scale, the same in every batch
                arrays[f] = np.array(a)
            elif whole:
                arrays[f] = a.view()
                arrays[f].flags.writeable = False
            elif len(batches) == 1:
                arrays[f] = np.take(a, rows, axis=0)
            else:
                arrays[f] = np.empty((n, *a.shape[1:]), a.dtype)
                for key, batch in batches.items():
                    at = np.flatnonzero(which == key)
                    arrays[f][at] = np.take(getattr(batch[name], f), rows[at], axis=0)
        out[name] = dataclasses.replace(ref, **arrays, shape=(n, *ref.shape[1:]))
    return out


def _batch_rows(batch: Record) -> int:
    return next(iter(batch.values())).shape[0]


def _same_layout(rec: SiteRecord, ref: SiteRecord) -> bool:
    """Whether two records (alike batched, or alike per sample) have one type, format, axis,
    shape past the leading axis and kind of global scale: their leading entries stack."""
    return (
        type(rec) is type(ref)
        and rec.fmt == ref.fmt
        and rec.axis == ref.axis
        and tuple(rec.shape[1:]) == tuple(ref.shape[1:])
        and _per_row(rec) == _per_row(ref)
    )


def _stack_alike(rec: SiteRecord, ref: SiteRecord) -> bool:
    """Whether two batched records' rows stack into one micro-batch (a per-tensor global scale
    must be the same)."""
    if not _same_layout(rec, ref):
        return False
    if not _per_row(rec):
        return np.asarray(rec.global_scale).tobytes() == np.asarray(ref.global_scale).tobytes()
    return True


# ----------------------------------------------------------------------------- encoding


def _sample_nbytes(record: Mapping[str, SiteRecord], batched: bool) -> int:
    """Bytes of one sample's record; in a batch, a scalar global scale counts for each sample."""
    total = 0
    for rec in record.values():
        for f in _array_fields(rec):
            a = getattr(rec, f)
            shape = np.shape(a)[1:] if batched and np.ndim(a) else np.shape(a)
            total += int(np.prod(shape)) * np.dtype(a.dtype).itemsize
    return total


def _zarr_spec(path: Path) -> dict[str, Any]:
    return {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}}


def _encode(entry: _Entry) -> tuple[np.ndarray, dict[str, Any]]:
    """A record -> its bytes (arrays in site order, each aligned) and the zarr attributes."""
    record = entry.record()
    arrays, layout, offset = [], [], 0
    for name in sorted(record):
        rec = record[name]
        site = {
            "site": name,
            "kind": _kind(rec),
            "fmt": rec.fmt.name,
            "shape": list(rec.shape),
            "axis": rec.axis,
            "arrays": [],
        }
        for f in _array_fields(rec):
            a = np.asarray(getattr(rec, f))
            raw = np.ascontiguousarray(a).reshape(-1).view(np.uint8)  # 0-d arrays too
            offset = -(-offset // _ALIGN) * _ALIGN
            site["arrays"].append(
                {
                    "field": f,
                    "dtype": a.dtype.name,
                    "shape": list(a.shape),
                    "offset": offset,
                    "nbytes": raw.size,
                    "sha256": hashlib.sha256(raw).hexdigest(),
                }
            )
            arrays.append((offset, raw))
            offset += raw.size
        layout.append(site)
    payload = np.zeros(offset, np.uint8)
    for start, raw in arrays:
        payload[start : start + raw.size] = raw
    attrs = {
        "format_version": FORMAT_VERSION,
        "version": entry.version,
        "sample_key": _sample_key(entry.sample_id),
        "sites": layout,
    }
    return payload, attrs


def _sample_id(sample_id: Any) -> SampleId:
    """Sample ids are ints (numpy integers accepted) or strs."""
    if isinstance(sample_id, np.integer):
        return int(sample_id)
    if isinstance(sample_id, bool) or not isinstance(sample_id, int | str):
        raise TypeError(f"sample ids are int or str, got {sample_id!r}")
    return sample_id


def _sample_key(sample_id: SampleId) -> str:
    if isinstance(sample_id, int):
        return f"i{sample_id}"
    return "s" + urllib.parse.quote(sample_id, safe="")


def _decode(payload: np.ndarray, attrs: dict[str, Any], path: Path, chunk: int) -> Record:
    """Inverse of ``_encode``; every array's checksum is verified."""
    out: Record = {}
    for site in attrs["sites"]:
        cls = _KINDS[site["kind"]]
        arrays = {}
        for a in site["arrays"]:
            start, n = a["offset"], a["nbytes"]
            raw = payload[start : start + n]
            if raw.size != n or hashlib.sha256(raw).hexdigest() != a["sha256"]:
                first, last = start // chunk, max(start, start + n - 1) // chunk
                files = ", ".join(str(path / "c" / str(i)) for i in range(first, last + 1))
                raise CorruptSpillError(
                    f"checksum mismatch for {site['site']}.{a['field']} of spilled guidance "
                    f"record {path} (bytes {start}..{start + n} in {files})"
                )
            arrays[a["field"]] = raw.view(jnp.dtype(a["dtype"])).reshape(a["shape"])
        out[site["site"]] = cls(
            **arrays, fmt=fp4.get_format(site["fmt"]), shape=tuple(site["shape"]), axis=site["axis"]
        )
    return out
