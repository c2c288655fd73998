"""The request path: the ``EdgeSync`` facade (``router``) and what a request returns
(``result``); what a request reuses (``plan``), carrying it out (``execute``) and storing back
(``storeback``); prefetch into the RAM tier (``prefetch``, ``ramtier``); the semantic lookup of
donor prompts (``semantic_lookup``) and the text it embeds (``prompt_text``)."""
