"""The paged-attention inference engine; filled in by the engine issues."""
