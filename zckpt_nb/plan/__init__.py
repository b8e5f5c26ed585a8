"""Planning: the cost model from a config alone (`costs`), seconds at any scale (`planning`), how often to save
(`interval`). `benchmarks/compare_world_sizes.py` measures real runs against it."""
