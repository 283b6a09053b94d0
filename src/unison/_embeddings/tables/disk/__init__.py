"""A disk tier for dynamic tables: ``DiskStorage`` (the setting), the cold rows on disk, and the tiered table."""
