"""The byte encodings a paged slot is made of, one file per encoding (:mod:`..codecs` composes
them into the codecs' slot layouts):

* :mod:`.bits` - bit packing along the last dim;
* :mod:`.token_int8` - per-token symmetric int8 (``q8``);
* :mod:`.lloyd_max` - rotated Lloyd-Max values with one 8-bit log-coded norm (``*d``);
* :mod:`.uniform` - uniform asymmetric groups: KIVI's per-token values in 32-channel groups;
* :mod:`.channel_keys` - per-channel keys in 32-slot groups, re-encoded as a group fills.

Pure torch; nothing here imports vLLM.
"""
