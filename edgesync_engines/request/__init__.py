"""The request path: the ``EdgeSync`` facade (``router``), deciding what a request reuses, carrying
it out, prefetch into the RAM tier and the semantic lookup of donor prompts."""
