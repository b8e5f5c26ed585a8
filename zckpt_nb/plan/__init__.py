"""Planning: the cost model from a config alone, in bytes and seconds, and its calibration against measurements."""
