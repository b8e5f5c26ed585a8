"""Reading and converting checkpoints offline: verify, safe loading, inspect, reshard, zero_to_fp32, export."""
