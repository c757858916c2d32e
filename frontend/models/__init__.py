"""Models: the registry, archives and downloads, settings, snapshots and management operations."""
