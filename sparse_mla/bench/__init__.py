"""The benchmark behind ``sparse-mla bench``: scenarios, GPU timing, the report (table, JSON, plot)."""
