"""The launcher side: options, torchrun jobs that never hang, locks, lifelines, several nodes."""
