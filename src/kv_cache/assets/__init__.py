"""Data files shipped with the package, no code: ``codec_bases/`` (storage-codec bases,
``kvcache calibrate-codec``, read by :mod:`kv_cache.codec.basis_file`) and ``kvzap_scorers/``
(KVzap scorers, ``kvcache calibrate-scorer``, read by :mod:`kv_cache.policies.kvzap`), each fitted
for the models the project ships evidence for and found by model identity or fingerprint."""
