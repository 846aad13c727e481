"""File formats for torch models: one module per format, export and import together, mirroring
``qcore.formats`` (Quark HF, GGUF, compressed-tensors, ONNX), and ``convert`` between them."""
