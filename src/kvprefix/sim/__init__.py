"""Trace replay on the real cache code: hit rates, prefill saved, capacity and routing what-ifs."""
