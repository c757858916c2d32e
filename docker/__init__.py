"""The container image: docker/Dockerfile, and ``python -m docker.build`` that builds it here."""
