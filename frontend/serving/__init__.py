"""Batching, policies, sequences, and the dispatch of batches to worker processes."""
