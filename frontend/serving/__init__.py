"""The inference plane, batching, policies, and the dispatch of batches to worker processes."""
