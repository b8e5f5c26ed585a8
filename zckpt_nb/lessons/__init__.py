"""What the notebooks measure and say: comparisons, stalls, claims computed from runs, notebook execution."""
