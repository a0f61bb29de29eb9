"""The bytes of a checkpoint: names, zarr documents and array records (``meta``),
the sharding codec and read planning (``shard``), data types (``dtypes``).

Imports only :mod:`reshard.layouts` and :mod:`reshard.store.io`.
"""
