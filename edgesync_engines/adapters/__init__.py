"""Engine adapters: the inference engines behind one interface (``protocol.EngineAdapter``).

``llamacpp.LlamaCppAdapter`` (llama-cpp-python) and ``onnxrt.OnnxRuntimeAdapter`` (an ONNX
Runtime session of an export of the GGUF, ``onnx_export``) subclass ``EngineAdapter``;
``compat`` says which stored KV an engine may use and ``reshape`` converts between their
layouts; ``model_files`` finds and fingerprints the GGUF.

To add an engine: subclass ``EngineAdapter`` (or implement its ``MEMBERS`` directly), give it a
namespace with its own ``engine`` and ``layout`` names, and teach ``compat`` and ``reshape``
its layout if another engine's KV may be converted for it.
"""
