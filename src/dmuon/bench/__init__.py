"""``dmuon bench`` and ``dmuon plan``: workloads, shape lists, runs, reports and live bytes (nothing in the library imports it)."""
