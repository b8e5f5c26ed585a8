"""The checkpoint format, at the bottom: folder layout, manifest, client state, durable files, file sizes."""
