"""qcore.adapters: the torch layer (quantized modules, calibration hooks, model quantizer, transformers glue,
Triton kernels, command line). The only place with module state. Empty until the adapter issues land."""
