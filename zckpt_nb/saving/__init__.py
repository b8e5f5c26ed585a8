"""The save path inside the ranks: one way in (`api`), the commit protocol, async saves, rotation, resume."""
