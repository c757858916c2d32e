"""batchserve's frontend process: HTTP and gRPC APIs, batching, worker management."""

import os

# NOTE: worker processes are forked from this process while grpc.aio threads run. grpcio's
# fork handlers then crash the child before it can exec (SIGSEGV). We never use gRPC in a
# forked child, so turn them off; grpcio reads this when it is first imported.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
