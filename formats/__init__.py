"""qcore.formats: serialization (Quark-HF safetensors, GGUF, ONNX readers and writers). Depends on qcore only.
Empty until the format issues land."""
