"""Timed launch choices that persist across processes.

A generated launcher that times candidate launch configurations on the GPU (tile shapes,
loop vs split-KV, ...) asks this store first, and records what it measured, so that a
training script, a benchmark or a test run in a new process does not time again.

* key: (the device: ``torch.cuda.get_device_name`` and its number of SMs, so that a MIG
  slice is not confused with the whole GPU; the torch and triton versions; a hash of the
  generated module's source, ``source_hash``; what is chosen, a short tag such as
  ``'tiles'``; the launcher's own shape key, by ``repr``);
* value: the chosen candidate as JSON (tuples come back as lists: ``choose`` matches the
  stored value against the current candidates and returns the candidate itself);
* file: ``$ACEFUSE_CACHE_DIR/tuning/<sha256 of the key>.json`` (default
  ``~/.cache/acefuse/tuning``), one file per key holding ``{"key": ..., "value": ...}``,
  written to a temporary file and moved into place with ``os.replace``: concurrent writers
  never leave a partial file, and the last one wins;
* a file that cannot be read or parsed, or that holds another key, is ignored with a
  ``CacheWarning`` (the choice is timed again and the file rewritten); a stored value that
  is none of the current candidates is ignored the same way (timed again);
* ``ACEFUSE_TUNING_CACHE=0`` turns the store off (nothing read, nothing written): every
  process times its own choices.

The API a launcher uses (generated code imports it lazily, where it times)::

    from acefuse.codegen import tuning
    best = tuning.choose(tuning.source_hash(__file__), 'schedule', key, dev, cands,
                         lambda: _fastest(cands, call))

``choose`` returns the remembered candidate when there is one, else calls the timing
function and records its result (a result of None, nothing ran, is not recorded).
``lookup`` and ``record`` are the two halves, for a launcher whose choice is not one of a
list (then it validates what ``lookup`` returns itself).
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from pathlib import Path

_SOURCE_HASHES: dict = {}   # module path -> sha256 of its bytes (read once per process)


def enabled() -> bool:
    """The store is used unless ACEFUSE_TUNING_CACHE=0."""
    return os.environ.get("ACEFUSE_TUNING_CACHE", "1") != "0"


def tuning_dir() -> Path:
    """``$ACEFUSE_CACHE_DIR/tuning`` (default ``~/.cache/acefuse/tuning``)."""
    base = os.environ.get("ACEFUSE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "acefuse")
    return Path(base) / "tuning"


def source_hash(path) -> str | None:
    """sha256 of the file at ``path`` (a generated module's ``__file__``), read once per
    process; None when it cannot be read (then nothing is stored or looked up)."""
    if path is None:
        return None
    path = str(path)
    if path not in _SOURCE_HASHES:
        try:
            _SOURCE_HASHES[path] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
        except OSError:
            return None
    return _SOURCE_HASHES[path]


def device_name(dev) -> str:
    """The device a timing belongs to: the GPU's name and its number of SMs (the CPU: its
    device type, for tests)."""
    import torch
    dev = torch.device(dev)
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        return f"{torch.cuda.get_device_name(dev)} ({props.multi_processor_count} SMs)"
    return dev.type


def _key(source, what, shape_key, dev) -> dict:
    import torch
    import triton
    return {"device": device_name(dev), "torch": torch.__version__, "triton": triton.__version__,
            "source": source, "what": what, "shape": repr(shape_key)}


def _path(key: dict) -> Path:
    h = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return tuning_dir() / f"{h}.json"


def _warn(path, why):
    from acefuse.codegen.compile import CacheWarning
    warnings.warn(f"acefuse: tuning cache entry {path} is {why}; ignored (the launch configuration "
                  "is timed again and the entry rewritten)", CacheWarning, stacklevel=3)


def lookup(source, what, shape_key, dev):
    """The value recorded for this key, or None (none recorded, the store off, or an entry
    that cannot be read or holds another key: then with a CacheWarning)."""
    if source is None or not enabled():
        return None
    key = _key(source, what, shape_key, dev)
    path = _path(key)
    try:
        text = path.read_text()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        _warn(path, f"unreadable ({exc})")
        return None
    try:
        data = json.loads(text)
    except ValueError:
        _warn(path, f"not JSON ({len(text)} characters; truncated or overwritten)")
        return None
    if not isinstance(data, dict) or data.get("key") != key or "value" not in data:
        _warn(path, "not an entry for this key (edited, or written by another version)")
        return None
    return data["value"]


def record(source, what, shape_key, dev, value) -> None:
    """Store ``value`` (JSON) for this key: atomically (a temporary file, then os.replace);
    errors (an unwritable directory) are ignored: the choice then lives in this process only."""
    if source is None or not enabled():
        return
    key = _key(source, what, shape_key, dev)
    path = _path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tuning-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump({"key": key, "value": value}, fh, sort_keys=True)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except (OSError, TypeError, ValueError):
        pass


def _canon(value):
    return json.loads(json.dumps(value, sort_keys=True))


def choose(source, what, shape_key, dev, cands, time_them):
    """The candidate of ``cands`` recorded for this key; else ``time_them()`` (the timed
    choice: one of ``cands``, or None when none ran), recorded when not None. A recorded
    value that is none of ``cands`` (stale) is timed again, with a CacheWarning."""
    stored = lookup(source, what, shape_key, dev)
    if stored is not None:
        for c in cands:
            if _canon(c) == stored:
                return c
        _warn(_path(_key(source, what, shape_key, dev)), f"a choice {stored!r} that is none of the candidates")
    best = time_them()
    if best is not None:
        record(source, what, shape_key, dev, _canon(best))
    return best


def clear() -> int:
    """Remove every stored entry (``ACEFUSE_CACHE_DIR/tuning/*.json``); how many were removed."""
    n = 0
    for p in tuning_dir().glob("*.json"):
        try:
            p.unlink()
            n += 1
        except OSError:
            pass
    return n
