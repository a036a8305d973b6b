"""The tuners' result cache on disk: one JSON object of entries by key, read defensively, written under a lock.

Nothing here imports Lightning: the file, its lock and the entries' schema are plain Python, tested with plain
values. What the key is made of lives in :mod:`lightning_memguard.tuning.cache_key`, the one place that reads it
from a Trainer.

- A read never raises: a file that is missing, unreadable, a folder, not JSON, or JSON that is not an object is a
  miss, and so is an entry that does not pass :func:`check_entry`. Each problem is reported once, by the ``warn``
  the cache was given, with the file's path.
- A write is a read-modify-write under :class:`FileLock` (a lock file made with ``O_CREAT | O_EXCL``, which Linux,
  macOS and Windows all honour, so no Unix-only module is imported), into a temporary file in the same folder that
  is flushed, synced and moved over the cache with ``os.replace``; the temporary file is removed when anything
  fails (and one a killed writer left is removed by the next write). A cache file that held no JSON object is
  replaced by one that does; a cache path that is a folder, or a folder that cannot be written, is reported and
  left as it is.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lightning_memguard.tuning.search import OK, OOM, OVER_HEADROOM, PREDICTED, SPILL, Margin, TrialResult

CACHE_FILE = "tuner-cache.json"
_TMP_PREFIX, _TMP_SUFFIX = ".tuner-cache-", ".tmp"
_OUTCOMES = (OK, OOM, SPILL, OVER_HEADROOM, PREDICTED)


def cache_folder(cache_dir: str | os.PathLike[str] | None) -> str:
    """The cache's folder: ``cache_dir`` with ``~`` expanded, or ``~/.cache/lightning-memguard``.

    Example:
        >>> cache_folder("/tmp/memguard")
        '/tmp/memguard'
        >>> cache_folder("~/x") == os.path.join(os.path.expanduser("~"), "x")
        True
    """
    if cache_dir is None:
        return os.path.join(os.path.expanduser("~"), ".cache", "lightning-memguard")
    return os.path.expanduser(os.fspath(cache_dir))


def digest(fields: Mapping[str, Any]) -> str:
    """A short, stable key for ``fields`` (JSON with sorted keys, anything else by ``str``).

    Example:
        >>> digest({"b": 1, "a": [2, 3]}) == digest({"a": [2, 3], "b": 1}), len(digest({}))
        (True, 24)
    """
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:24]


class BadEntry(ValueError):
    """A cache entry that is not what a tuner stores; its message says what is wrong."""


def _is_int(value: Any, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


_ROW_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "size": (lambda v: _is_int(v, 1), "a positive int"),
    "step_ms": (lambda v: v is None or _is_number(v), "None or a number >= 0"),
    "peak_bytes": (lambda v: v is None or _is_int(v, 0), "None or an int >= 0"),
    "samples_per_sec": (lambda v: v is None or _is_number(v), "None or a number >= 0"),
    "outcome": (lambda v: v in _OUTCOMES, f"one of {_OUTCOMES}"),
    "accumulate": (lambda v: _is_int(v, 1), "a positive int"),
    "compiled": (lambda v: isinstance(v, bool), "a bool"),
    "compile_s": (_is_number, "a number >= 0"),
    "spread": (lambda v: v is None or _is_number(v), "None or a number >= 0"),
}
_ROW_REQUIRED = ("size", "step_ms", "peak_bytes", "samples_per_sec", "outcome")
_MARGIN_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "size": (lambda v: _is_int(v, 1), "a positive int"),
    "accumulate": (lambda v: _is_int(v, 1), "a positive int"),
    "runner_up": (lambda v: _is_int(v, 1), "a positive int"),
    "runner_up_accumulate": (lambda v: _is_int(v, 1), "a positive int"),
    "gap": (lambda v: isinstance(v, int | float) and not isinstance(v, bool) and -1 <= v <= 1, "a number in [-1, 1]"),
    "noise": (_is_number, "a number >= 0"),
    "remeasured": (lambda v: isinstance(v, bool), "a bool"),
}


def _check_fields(
    fields: dict[str, Any], where: str, checks: dict[str, tuple[Callable[[Any], bool], str]], required: Sequence[str]
) -> None:
    """Every field of ``fields`` known to ``checks`` and passing its check, every ``required`` one there."""
    unknown = sorted(set(fields) - set(checks), key=str)
    missing = [name for name in required if name not in fields]
    if unknown or missing:
        raise BadEntry(f"{where} has unknown fields {unknown} and lacks {missing}")
    for name, value in fields.items():
        check, expected = checks[name]
        if not check(value):
            raise BadEntry(f"{where}.{name} must be {expected}, got {value!r}")


def _check_row(i: int, row: Any) -> TrialResult:
    if not isinstance(row, dict):
        raise BadEntry(f"results[{i}] must be an object, got {row!r}")
    _check_fields(row, f"results[{i}]", _ROW_CHECKS, _ROW_REQUIRED)
    return TrialResult(**row)


def _check_margin(margin: Any, size: int) -> Margin | None:
    if margin is None:
        return None
    if not isinstance(margin, dict):
        raise BadEntry(f"margin must be None or an object, got {margin!r}")
    _check_fields(margin, "margin", _MARGIN_CHECKS, sorted(_MARGIN_CHECKS))
    if margin["size"] != size:
        raise BadEntry(f"margin.size {margin['size']} is not the choice, batch_size {size}")
    return Margin(**margin)


def check_entry(entry: Any, *, accumulates: bool, per_step: int | None = None) -> dict[str, Any]:
    """``entry`` as a tuner's state (each trial with all its fields), or :class:`BadEntry` saying what is wrong.

    An entry holds ``batch_size`` (a positive int), ``accumulate_grad_batches`` (None for a
    ``BatchSizeTuner``; a positive int for an ``AccumulationTuner``, whose micro-batch times it is ``per_step``),
    ``results`` (trials, each the fields of a :class:`~lightning_memguard.tuning.search.TrialResult` with values of
    their types; the chosen size, with its accumulation for an ``AccumulationTuner``, among those that fit) and,
    for an ``AccumulationTuner`` only, ``checkpointing`` (a bool); and ``margin``, how far the choice stood from the
    fastest other size that fit (the fields of a :class:`~lightning_memguard.tuning.search.Margin`, or None where no
    other did). Nothing else. An entry without ``margin`` (written before it was kept) is read as it is.

    Example:
        >>> row = {"size": 8, "step_ms": 5.0, "peak_bytes": 10, "samples_per_sec": 1600.0, "outcome": "ok"}
        >>> entry = check_entry({"batch_size": 8, "accumulate_grad_batches": None, "results": [row]}, accumulates=False)
        >>> entry["results"][0]["accumulate"], entry["results"][0]["compiled"]  # the defaults filled in
        (1, False)
        >>> check_entry({"batch_size": 8, "accumulate_grad_batches": -1, "results": [row]}, accumulates=False)
        Traceback (most recent call last):
        ...
        lightning_memguard.tuning.cache.BadEntry: accumulate_grad_batches must be None, got -1
    """
    if not isinstance(entry, dict):
        raise BadEntry(f"an entry must be an object, got {entry!r}")
    fields = ["batch_size", "accumulate_grad_batches", "results", *(["checkpointing"] if accumulates else [])]
    unknown = sorted(set(entry) - {*fields, "margin"}, key=str)
    missing = [f for f in fields if f not in entry]
    if unknown or missing:
        raise BadEntry(f"the entry has unknown fields {unknown} and lacks {missing}")
    size, accumulate, rows = entry["batch_size"], entry["accumulate_grad_batches"], entry["results"]
    if not _is_int(size, 1):
        raise BadEntry(f"batch_size must be a positive int, got {size!r}")
    if accumulates and not _is_int(accumulate, 1):
        raise BadEntry(f"accumulate_grad_batches must be a positive int, got {accumulate!r}")
    if not accumulates and accumulate is not None:
        raise BadEntry(f"accumulate_grad_batches must be None, got {accumulate!r}")
    if accumulates and not isinstance(entry["checkpointing"], bool):
        raise BadEntry(f"checkpointing must be a bool, got {entry['checkpointing']!r}")
    if per_step is not None and size * (accumulate or 1) != per_step:
        raise BadEntry(f"batch_size {size} x accumulate_grad_batches {accumulate} is not {per_step} samples a step")
    if not isinstance(rows, list):
        raise BadEntry(f"results must be a list, got {rows!r}")
    results = [_check_row(i, row) for i, row in enumerate(rows)]
    # a BatchSizeTuner measures at the accumulation training starts with, whatever it is: the size alone must match
    if not any(r.fits and r.size == size and (not accumulates or r.accumulate == accumulate) for r in results):
        raise BadEntry(f"batch_size {size}{f' x {accumulate}' if accumulates else ''} is not among the trials that fit")
    checked = {**entry, "results": [r.to_dict() for r in results]}
    if "margin" in entry:
        margin = _check_margin(entry["margin"], size)
        checked["margin"] = None if margin is None else margin.to_dict()
    return checked


class FileLock:
    """An inter-process lock: the file ``path``, made with ``O_CREAT | O_EXCL`` and removed on release.

    Waits up to ``timeout`` seconds (then ``TimeoutError``). A lock file older than ``stale_after`` seconds was
    left by a process that died while holding it, and is broken: renamed to a name of its own first, so that of
    several processes breaking it one wins, and put back if what was renamed turns out to be a live lock.

    Example:
        >>> import tempfile
        >>> folder = tempfile.TemporaryDirectory()
        >>> path = os.path.join(folder.name, "x.lock")
        >>> with FileLock(path):
        ...     os.path.exists(path)
        True
        >>> os.path.exists(path)
        False
        >>> folder.cleanup()
    """

    def __init__(self, path: str, timeout: float = 20.0, stale_after: float = 10.0, poll: float = 0.005) -> None:
        self.path, self.timeout, self.stale_after, self.poll = path, timeout, stale_after, poll
        self._token = ""

    def __enter__(self) -> FileLock:
        token = f"{os.getpid()} {uuid.uuid4().hex}"
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                pass
            except PermissionError:  # Windows: a lock file deleted while another process still had it open
                if os.name != "nt" or not os.path.exists(self.path):
                    raise
            else:
                try:
                    with os.fdopen(fd, "w", encoding="utf-8") as f:
                        f.write(token)
                except BaseException:
                    with contextlib.suppress(OSError):
                        os.remove(self.path)
                    raise
                self._token = token
                return self
            if self._break_if_stale():
                continue
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    errno.ETIMEDOUT, f"another process has held the lock for over {self.timeout:g} s", self.path
                )
            time.sleep(self.poll)

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(OSError):
            if self._read(self.path) == self._token:  # not if it was broken as stale and taken by another
                os.remove(self.path)
        self._token = ""

    @staticmethod
    def _read(path: str) -> str | None:
        try:
            with open(path, encoding="utf-8") as f:
                return f.read()
        except (OSError, ValueError):
            return None

    def _age(self, path: str) -> float:
        return time.time() - os.stat(path).st_mtime

    def _break_if_stale(self) -> bool:
        """Whether to try again at once: the lock is gone, or it was stale and has been removed."""
        try:
            if self._age(self.path) < self.stale_after:
                return False
            grave = f"{self.path}.{uuid.uuid4().hex}.stale"
            os.rename(self.path, grave)
        except FileNotFoundError:
            return True  # released meanwhile
        try:
            if self._age(grave) < self.stale_after:  # another breaker's fresh lock: give it back
                with contextlib.suppress(OSError):
                    os.link(grave, self.path)
        finally:
            with contextlib.suppress(OSError):
                os.remove(grave)
        return True


def _replace(src: str, dst: str, tries: int = 20) -> None:
    """``os.replace``, retried a while on Windows, where a reader holding ``dst`` open refuses it."""
    for attempt in range(tries):
        try:
            os.replace(src, dst)
            return
        except PermissionError:
            if os.name != "nt" or attempt == tries - 1:
                raise
            time.sleep(0.01 * (attempt + 1))


class ResultCache:
    """The cache file ``folder/tuner-cache.json``: :meth:`load` an entry, :meth:`store` one.

    Args:
        folder: the cache's folder (see :func:`cache_folder`); made on the first store.
        warn: called with a message for each problem; a problem with the file itself is reported once per
            instance, however many reads and writes meet it.
        lock_timeout: seconds to wait for another process's write; stale_after: age in seconds of a lock file
            taken to be left behind by a process that died.

    Example:
        >>> import tempfile
        >>> folder = tempfile.TemporaryDirectory()
        >>> cache = ResultCache(folder.name)
        >>> row = {"size": 8, "step_ms": 5.0, "peak_bytes": 10, "samples_per_sec": 1600.0, "outcome": "ok"}
        >>> cache.store("k", {"batch_size": 8, "accumulate_grad_batches": None, "results": [row]})
        True
        >>> cache.load("k", accumulates=False)["batch_size"], cache.load("other", accumulates=False)
        (8, None)
        >>> folder.cleanup()
    """

    def __init__(
        self,
        folder: str,
        warn: Callable[[str], None] | None = None,
        lock_timeout: float = 20.0,
        stale_after: float = 10.0,
    ) -> None:
        self.folder = folder
        self.path = os.path.join(folder, CACHE_FILE)
        self.warn = warn if warn is not None else _warn
        self.lock_timeout, self.stale_after = lock_timeout, stale_after
        self._file_reported = False

    def _file_problem(self, message: str) -> None:
        if not self._file_reported:
            self._file_reported = True
            self.warn(message)

    def _read(self) -> tuple[dict[str, Any] | None, str | None]:
        """The file's entries (None: no file, or nothing usable), and what is wrong with it if anything."""
        try:
            with open(self.path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            return None, None
        except NotADirectoryError as err:
            raise _Unreadable("its folder is a file") from err
        except OSError as err:
            what = "it is a folder" if os.path.isdir(self.path) else f"{type(err).__name__}: {err.strerror or err}"
            raise _Unreadable(what) from err
        except (ValueError, RecursionError) as err:
            return None, f"it is not valid JSON ({err})"
        if not isinstance(data, dict):
            return None, f"it holds a JSON {type(data).__name__}, not an object of entries"
        return data, None

    def load(self, key: str, *, accumulates: bool, per_step: int | None = None) -> dict[str, Any] | None:
        """The entry under ``key``, checked by :func:`check_entry`; None on a miss, for whatever reason."""
        try:
            data, problem = self._read()
        except _Unreadable as err:
            self._file_problem(f"the result cache {self.path} cannot be read ({err}); measuring again")
            return None
        if problem is not None:
            self._file_problem(f"the result cache {self.path} is ignored: {problem}; it will be replaced")
            return None
        if data is None or key not in data:
            return None
        try:
            return check_entry(data[key], accumulates=accumulates, per_step=per_step)
        except BadEntry as err:
            self.warn(f"the entry {key} of the result cache {self.path} is ignored: {err}; measuring again")
            return None

    def store(self, key: str, entry: Mapping[str, Any]) -> bool:
        """Write ``entry`` under ``key``, keeping every other process's entries; whether it was written."""
        try:
            if os.path.exists(self.folder) and not os.path.isdir(self.folder):
                raise NotADirectoryError(errno.ENOTDIR, "the cache folder is a file", self.folder)
            if os.path.isdir(self.path):
                raise IsADirectoryError(errno.EISDIR, "the cache file is a folder", self.path)
            os.makedirs(self.folder, exist_ok=True)
            with FileLock(f"{self.path}.lock", self.lock_timeout, self.stale_after):
                try:
                    data, _ = self._read()  # a file without an object of entries is replaced
                except _Unreadable as err:  # not overwritten: it may hold entries this process cannot see
                    raise OSError(str(err)) from err
                data = {**(data or {}), key: dict(entry)}
                self._write(data)
                self._remove_orphans()
            return True
        except OSError as err:
            self._file_problem(f"could not write the result cache {self.path}: {err}")
            return False

    def _remove_orphans(self) -> None:
        """Temporary files are only written under the lock: one older than a stale lock is a killed writer's."""
        with contextlib.suppress(OSError), os.scandir(self.folder) as entries:
            for found in entries:
                if found.name.startswith(_TMP_PREFIX) and found.name.endswith(_TMP_SUFFIX):
                    with contextlib.suppress(OSError):
                        if time.time() - found.stat().st_mtime > self.stale_after:
                            os.remove(found.path)

    def _write(self, data: dict[str, Any]) -> None:
        fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, suffix=_TMP_SUFFIX, dir=self.folder)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(data, f, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            _replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise


class _Unreadable(Exception):
    """The cache file exists but cannot be opened or read (a folder, no permission)."""


def _warn(message: str) -> None:
    warnings.warn(message, UserWarning, stacklevel=3)
