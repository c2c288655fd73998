"""Engine adapters behind one protocol (``protocol``): llama.cpp with its seq-state codec, ONNX
Runtime with the export of a GGUF, compatibility verdicts and KV layout conversion between them,
and model files (locating the GGUF, its fingerprint)."""
