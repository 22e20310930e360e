"""Storage-codec bases fitted for the models the project ships evidence for (``kvcache calibrate-codec``;
:mod:`kv_cache.codec.basis_file`). Found by the fingerprint a ``.kvc`` file names, or by model."""
