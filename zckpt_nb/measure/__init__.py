"""Meters: what a save costs (time, memory, bytes, collectives), measured in the process or from outside."""
