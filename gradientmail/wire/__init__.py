"""The wire: what travels through the bucket, byte for byte.

Tensors as bytes (`tensor_bytes`), payload packing and schemas (`serialization`), transfer
formats (`quantization`) and codecs (`compression`), the run's records in strict canonical
JSON (`records`, `record_json`), and their seals (`auth`). Nothing here does I/O or knows
about rounds: it is the vocabulary every other layer speaks.
"""

__all__: list[str] = []
