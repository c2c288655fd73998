"""Engine adapters: the inference engines behind one protocol.

Public API, by module:

* ``protocol``: :class:`EngineAdapter` (what the request path calls on an engine),
  ``ContextOverflowError``, ``InjectionError``.
* ``base``: ``EngineAdapterBase`` (what both engines share), ``assemble_kv``, ``kv_ranges``.
* ``llamacpp``: ``LlamaCppAdapter`` (llama-cpp-python), with ``seqstate`` (the byte layout of
  llama.cpp's per-sequence state, ``parse``/``serialize``).
* ``onnxrt``: ``OnnxRuntimeAdapter`` (an ONNX Runtime session of an export of the GGUF), with
  ``onnx_export`` (``export_gguf``, ``check_exportable``, ``open_export``, ``read_meta``,
  ``ExportError``) and ``onnx_support`` (``SUPPORTED_ARCHITECTURES``, ``onnx_refusal``: which
  GGUFs it exports and serves, from the header).
* ``compat``: ``compatible_with`` and its verdicts ``COMPATIBLE``, ``CONVERTIBLE``,
  ``INCOMPATIBLE``, ``layout_refusal``; ``reshape``: ``convert_fragment`` between the two
  engines' KV layouts.
* ``model_files``: ``default_model_path``, ``file_fingerprint``, ``route_native_logs``,
  ``ModelNotFoundError``, ``ModelLoadError``; ``gguf_header``: ``read_header`` (a GGUF's
  metadata and tensor directory, without the weights).

To add an engine: subclass ``EngineAdapterBase`` (or implement ``EngineAdapter`` directly),
give it a namespace with its own ``engine`` and ``layout`` names, and teach ``compat`` and
``reshape`` its layout if another engine's KV may be converted for it.
"""
