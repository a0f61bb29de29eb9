"""Where bytes live: ``storage`` (local files and fsspec URLs, counters, retries,
create-if-absent) and ``pool`` (thread pools sized for local or remote storage).

Imports nothing else of :mod:`reshard.store`.
"""
