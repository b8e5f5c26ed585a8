"""Planning: the cost model from a config alone (`costs`), seconds at any scale (`planning`), how often to save
(`interval`). `zckpt_nb.compare` measures real runs against it."""
