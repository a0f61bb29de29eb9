"""Writing a save: each rank's plan, shards and manifest (no reads of other saves but the incremental base)."""
