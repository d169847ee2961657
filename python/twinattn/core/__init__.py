"""twinattn's core (layer 0): twinattn.attention and its checks, the NumPy reference, the native
ports' loading and threads, int8 quantization and merge_attention. It imports NumPy, ml_dtypes
and itself only; the layers above (twinattn.nn, the integrations, twinattn.bench) build on it."""
