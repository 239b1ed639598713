"""Dynamic programs, heuristics, engine adapters and the facade (``solve``, ``compare``)."""
