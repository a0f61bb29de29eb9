"""Reading a save: open, the lazy Checkpoint and its views, fetching chunks, the dask read graph, export."""
