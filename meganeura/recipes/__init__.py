"""End-to-end jobs behind the CLI."""
