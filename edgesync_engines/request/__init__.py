"""The request path: the ``EdgeSync`` facade (``router``), its arguments' checks (``checks``) and
what a request returns (``result``); the reuse strategy of each mode (``reuse``), what a request
reuses (``plan``), carrying it out (``execute``), decoding (``stops``) and storing back
(``storeback``). Features imported when first used: documents (``documents``, ``blend``),
idle-time work (``idle``), prefetch (``prefetch``), the semantic lookup (``semantic_lookup``)."""
