#!/bin/sh
# The SageMaker image's entry point (docker/Dockerfile.sagemaker, docs/container.md).
#
# SageMaker starts a hosting container as `docker run IMAGE serve`. For `serve` (also the
# image's CMD) this runs the toolkit's own `serve` (sagemaker-pytorch-inference), as AWS's
# PyTorch inference images did: it writes /etc/sagemaker-ts.properties, runs
# `torchserve --start` (batchserve), finds the server among the processes by its
# org.pytorch.serve.ModelServer argument, waits on it and forwards SIGTERM to it. `exec`, so
# that the toolkit is PID 1 and receives the container's SIGTERM itself. Any other command
# runs in its place (`docker run -it IMAGE bash`).
set -eu

if [ "$#" -eq 0 ] || [ "$1" = serve ]; then
    # AWS's entry point sets the toolkit's default_workers_per_model to the CPU count,
    # overwriting the variable; here only when it is not set (nproc: the CPUs this container
    # may run on).
    if [ -z "${SAGEMAKER_MODEL_SERVER_WORKERS:-}" ]; then
        SAGEMAKER_MODEL_SERVER_WORKERS=$(nproc)
        export SAGEMAKER_MODEL_SERVER_WORKERS
    fi
    exec serve
fi
exec "$@"
