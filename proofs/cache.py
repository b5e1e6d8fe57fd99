"""The proof cache: results on disk, keyed by the checker's own source and the rule,
and authenticated so that an edited entry is detected.

* key: ``sha256(checker_hash() + rule text)``, where ``checker_hash()`` hashes the
  source of every ``proofs/*.py`` module: changing the checker invalidates every
  cached proof;
* file: ``$ACEFUSE_CACHE_DIR/proofs.json`` (default ``~/.cache/acefuse``), a map
  key -> ``{"result": {...}, "mac": hex}``;
* ``mac``: HMAC-SHA256 of the key and the canonical JSON of the result, with a
  machine-local random key in ``proofs.key`` next to the cache (created with mode
  0600 on first use). An entry whose MAC does not match (edited by hand, or
  written under another key) is discarded with a warning on stderr, and the rule
  is proved again.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import sys
import tempfile
from pathlib import Path

_MEM: dict[str, dict] = {}       # key -> result dict (verified)
_DISK_LOADED = False
_DIRTY = False
_CHECKER_HASH = None
_KEY = None


def cache_path() -> Path:
    base = os.environ.get("ACEFUSE_CACHE_DIR")
    root = Path(base) if base else Path.home() / ".cache" / "acefuse"
    return root / "proofs.json"


def key_path() -> Path:
    return cache_path().with_name("proofs.key")


def checker_hash() -> str:
    """sha256 of the source of the checker (every proofs/*.py file)."""
    global _CHECKER_HASH
    if _CHECKER_HASH is None:
        h = hashlib.sha256()
        for p in sorted(Path(__file__).resolve().parent.glob("*.py")):
            h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
        _CHECKER_HASH = h.hexdigest()
    return _CHECKER_HASH


def _secret() -> bytes:
    global _KEY
    if _KEY is not None and _KEY[0] == key_path():
        return _KEY[1]
    p = key_path()
    k = _read_key(p)
    if k is None:
        # create it atomically (os.link fails if another process made one first; then use theirs)
        k = secrets.token_bytes(32)
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=".proofs-key-")
            with os.fdopen(fd, "w") as fh:
                fh.write(k.hex())
            try:
                os.link(tmp, p)
            except FileExistsError:
                k = _read_key(p) or k
            finally:
                os.unlink(tmp)
        except OSError:
            pass   # an unwritable cache directory: nothing is persisted either
    _KEY = (p, k)
    return k


def _read_key(p: Path):
    try:
        k = bytes.fromhex(p.read_text().strip())
        return k if len(k) >= 16 else None
    except (OSError, ValueError):
        return None


def _mac(key: str, result: dict) -> str:
    msg = (key + "\n" + json.dumps(result, sort_keys=True, default=str)).encode()
    return hmac.new(_secret(), msg, hashlib.sha256).hexdigest()


def clear():
    """Forget in-process results (the disk cache is re-read on next use)."""
    global _DISK_LOADED, _KEY
    _MEM.clear()
    _DISK_LOADED = False
    _KEY = None


def _valid(k, v) -> bool:
    return (isinstance(v, dict) and isinstance(v.get("result"), dict) and isinstance(v.get("mac"), str)
            and hmac.compare_digest(v["mac"], _mac(k, v["result"])))


def _load():
    global _DISK_LOADED
    if _DISK_LOADED:
        return
    _DISK_LOADED = True
    try:
        data = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return
    if not isinstance(data, dict):
        return
    bad = []
    for k, v in data.items():
        if not (isinstance(v, dict) and "mac" in v):
            continue          # an entry of an older cache format: never looked up
        if _valid(k, v):
            _MEM.setdefault(k, v["result"])
        else:
            res = v.get("result")
            bad.append(str(res.get("name", "?")) if isinstance(res, dict) else "?")
    if bad:
        print(f"acefuse: WARNING: {len(bad)} entr{'y' if len(bad) == 1 else 'ies'} of the proof cache "
              f"{cache_path()} failed authentication (edited, or written with another key) and "
              f"{'was' if len(bad) == 1 else 'were'} discarded; re-proving: {', '.join(sorted(bad)[:10])}",
              file=sys.stderr)


def get(key: str) -> dict | None:
    _load()
    return _MEM.get(key)


def put(key: str, result: dict):
    global _DIRTY
    _MEM[key] = result
    _DIRTY = True


def save():
    """Merge the in-process results into the disk cache (atomic replace; errors ignored)."""
    global _DIRTY
    if not _DIRTY:
        return
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict):
                data = {}
        except (OSError, ValueError):
            data = {}
        data = {k: v for k, v in data.items() if _valid(k, v)}   # drop forged and stale-format entries
        for k, v in _MEM.items():
            data[k] = {"result": v, "mac": _mac(k, v)}
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".proofs-", suffix=".json")
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh)
        os.replace(tmp, path)
        _DIRTY = False
    except (OSError, TypeError, ValueError):
        pass
