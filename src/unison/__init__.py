"""unison."""
