"""qcore.adapters: reserved for the torch layer (quantized modules, calibration hooks, model integration), the
only place meant to hold module state. Empty so far: the torch layer is planned."""
