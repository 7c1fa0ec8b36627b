"""dmuon.util: the floor under every layer; helpers with no dmuon imports, each written once.

* :mod:`~dmuon.util.jsoncache`: the on-disk JSON caches' conventions (cache
  directory, header-checked read, atomic write, per-host file lock).
* :mod:`~dmuon.util.records`: validation of JSON lists of records, errors
  naming the entry and field.
* :mod:`~dmuon.util.rank0`: compute on rank 0 of a group, broadcast the result.
"""
