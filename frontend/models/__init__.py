"""Models: the registry, archives and downloads, a version at run time, snapshots."""
