"""qcore.formats: checkpoint file formats (readers and writers). Depends on qcore only (no torch).

- ``qcore.formats.quark_hf``: AMD Quark's Hugging Face ``quantization_config`` (``quant_method: "quark"``),
  read and written exactly, and its quantization specs converted to and from ``qcore.QuantSpec``.
"""
