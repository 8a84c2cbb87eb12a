"""The lifecycle of an idempotent execution, with no HTTP in it: claim the
key (``claims``), run the work in the claim's transaction while ``work``
guards what it sends to the databases (read by ``statements``, with the
``drivers``' reports), then complete or let go (``units``). ``aio`` runs a
whole unit for async code."""
