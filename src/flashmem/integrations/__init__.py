"""Optional integrations of flashmem's tiers with serving engines (each behind its own extra).

Nothing here is imported by `flashmem` itself: an integration module imports its
engine only when it is used.
"""
