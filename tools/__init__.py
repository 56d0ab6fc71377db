"""Developer tools (README generation)."""
