"""The disk KV tier (``--kv-disk-dir``/``--kv-disk-size``): prefix blocks in checksummed
segment files under a directory, surviving restarts and shared by the servers of one host.

- the options: :mod:`engine.config.kv_disk` (frozen, validated);
- :mod:`.fingerprint`: what gives the bytes meaning (a different fingerprint is never read);
- :mod:`.segment`: the file format (records with a CRC each) and its scanner;
- :mod:`.store`: the directory: index rebuilt from the segments, LRU eviction, locks, the
  writer thread with its bounded queue;
- :mod:`.health`: failing open: a directory or write that fails costs the cache only, retried
  with backoff;
- :mod:`.budget`: ``--kv-disk-size`` over the whole directory (other fingerprints evicted
  first, live ones never), orphans pruned at start;
- :mod:`.prefetch`: the reader thread that loads disk blocks into host blocks;
- :mod:`.tier`: the engine's facade (arrival look-up, admission gate, commit write-through).
"""

from engine.kv_cache.disk.fingerprint import KVFingerprint

__all__ = ["KVFingerprint"]
