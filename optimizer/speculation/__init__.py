"""Speculative decoding at a stated acceptance: the break-even sweep (``spec-sweep``)."""
